"""Error types for bad user input. The CLI prints these as one line (exit code 2)."""


class DSparkError(ValueError):
    """Base class: the input (config, checkpoint, prompt, data, flag) is wrong, not the code."""


class ConfigError(DSparkError):
    """A config field is missing, has the wrong type, or contradicts another field."""


class CheckpointError(DSparkError):
    """A checkpoint is missing, corrupted, or does not match its config."""


class InputError(DSparkError):
    """Bad runtime input: prompts, datasets, command-line values, output paths."""
