"""Is this drafter for this target? Checked from the two checkpoints' config files alone, before
any weight is read or program compiled, at every entry point that pairs them (generate, eval,
train ``draft_init``, profile-sps ``--draft``, calibrate ``--write-draft``, export ``--target``).

The rule itself is the families' (``families.check_pair``: the drafter's family reads the target's;
``DraftConfig.check_compatible``: sizes, vocabulary, tapped layers); this module only reads the
configs early and names both paths in the one line.
"""

from __future__ import annotations

from pathlib import Path

from dspark_jax import families
from dspark_jax.errors import CheckpointError, ConfigError, DSparkError


def stored_config(path, kind: str):
    """The config of checkpoint ``path`` read as a ``kind`` ("draft" / "target") from its config
    files only (``config.json`` or the project format's metadata; a DeepSeek-V4 checkpoint's
    in-checkpoint module as a drafter). ConfigError / CheckpointError naming the file."""
    from dspark_jax.convert import dspark_v4, formats, module_io, mtp_v4

    p = Path(path)
    module = module_io.module_dir(p) if kind == "draft" else None
    if module is not None:
        return dspark_v4.read_config(module)
    if kind == "draft" and mtp_v4.holds_module(p):
        return mtp_v4.read_config(p)
    if kind == "draft" and mtp_v4.is_v4(p):
        raise CheckpointError(f"{p}: a DeepSeek-V4 checkpoint without a drafter module (no dspark_* keys, "
                              f"no {mtp_v4.MARK} tensor); pass a checkpoint holding one as --draft")
    if formats.detect_format(p) == "jax":
        meta = formats.read_meta(p)
        return formats.config_from_hf(kind, meta["config"], f"{p / formats.META_NAME} 'config'")
    return formats.config_from_hf(kind, formats.read_json_object(p / "config.json", "config.json"),
                                  str(p / "config.json"))


def _described(config) -> str:
    family = families.for_config(config)
    return f"a {family.name} {family.kind}"


def check_pair_paths(target, draft, *, target_flag: str = "--target", draft_flag: str = "--draft") -> None:
    """ConfigError (one line naming both checkpoints and their families) unless the drafter at
    ``draft`` reads the target at ``target``; a checkpoint that is not the kind its flag asks for
    (a target given as the drafter, or the reverse) is named the same way."""
    try:
        tcfg = stored_config(target, "target")
    except DSparkError as e:
        raise type(e)(f"{target_flag} {str(target)!r}: {e}") from None
    try:
        dcfg = stored_config(draft, "draft")
    except ConfigError as e:
        raise ConfigError(f"{draft_flag} {str(draft)!r} is not a drafter for {target_flag} {str(target)!r} "
                          f"({_described(tcfg)}): {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{draft_flag} {str(draft)!r}: {e}") from None
    try:
        families.check_pair(dcfg, tcfg)
        dcfg.check_compatible(tcfg)
    except ConfigError as e:
        raise ConfigError(f"{draft_flag} {str(draft)!r} ({_described(dcfg)}) does not pair with {target_flag} "
                          f"{str(target)!r} ({_described(tcfg)}): {e}") from None
