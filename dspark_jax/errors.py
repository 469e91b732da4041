"""Error types for bad user input. The CLI prints these as one line (exit code 2)."""


class DSparkError(ValueError):
    """Base class: the input (config, checkpoint, prompt, data, flag) is wrong, not the code."""


class ConfigError(DSparkError):
    """A config field is missing, has the wrong type, or contradicts another field."""


class CheckpointError(DSparkError):
    """A checkpoint is missing, corrupted, or does not match its config."""


class InputError(DSparkError):
    """Bad runtime input: prompts, datasets, command-line values, output paths."""


def require_positive_int(value, what: str, error: type[DSparkError] = InputError) -> int:
    """``value`` when it is an int > 0 (bools refused); else ``error("<what> must be a positive int")``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{what} must be a positive int, got {value!r}")
    return value


def os_error_line(e: OSError) -> str:
    """One line for an OSError the environment raised: the path(s), the reason, the errno."""
    paths = " -> ".join(repr(str(p)) for p in (e.filename, e.filename2) if p is not None)
    reason = e.strerror or str(e)
    return f"{paths + ': ' if paths else ''}{reason}" + (f" (errno {e.errno})" if e.errno else "")


def warn(message: str) -> None:
    """One ``dspark-jax: warning: <message>`` line on stderr (a choice the user may not expect)."""
    import sys
    print(f"dspark-jax: warning: {message}", file=sys.stderr, flush=True)
