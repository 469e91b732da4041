"""Write a drafter as a serving engine (or another trainer) loads it: ``dspark-jax export``.

``export_draft`` refuses what the engine cannot load (``engines.check``; for DeepSeek-V4's
in-checkpoint module ``engines_v4.v4_check``) before anything is written, then writes the
engine's config.json, the tensors and the sidecars (SGLang's STS / SPS files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from dspark_jax.convert import engines, engines_v4
from dspark_jax.errors import CheckpointError, ConfigError


def _read_sps(path) -> dict:
    from dspark_jax.errors import InputError
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"--sps {str(p)!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise InputError(f"--sps {str(p)!r}: cannot parse JSON ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"--sps {str(p)!r}: expected a JSON object with batch_sizes and sps")
    return data


def export_draft(src, dst, engine: str, *, force: bool = False, sps=None, target=None,
                 allow_nonfinite: bool = False) -> dict:
    """Write drafter ``src`` (either format) to ``dst`` as ``engine`` loads it; returns a summary.

    A DeepSeek-V4 DSpark module (``src`` a V4 checkpoint with the ``dspark_*`` keys, or a module
    directory with ``target`` the V4 checkpoint) is written into the target's checkpoint
    (``export_v4_module``, checked against ``engines_v4.V4_RULES``).

    Refuses (ConfigError naming the violated rule; nothing written) what ``engine`` cannot load.
    Writes config.json (engine transforms), model.safetensors (mode 0644), the tokenizer files
    found beside ``src``, and for SGLang-family engines the STS sidecar (when ``src`` carries
    extras['sts_temperatures']) and the SPS sidecar (when ``sps`` names a profile-sps JSON).
    """
    import os
    import shutil

    import jax
    import numpy as np

    from dspark_jax.convert import checkpoint, dspark_v4, foreign, formats, mapping, safetensors_io

    engines.rules_for(engine)  # an unknown engine: ConfigError before anything is read
    src = Path(src)
    if dspark_v4.holds_module(src):
        return export_v4_module(src, dst, engine, target=target, force=force,
                                sps=_read_sps(sps) if sps is not None else None)
    if target is not None:
        raise ConfigError("--target is only for a DeepSeek-V4 DSpark module (written into its target)")
    cfg, params = checkpoint.load_draft(src)
    bad = checkpoint.nonfinite(params)
    if bad and not allow_nonfinite:
        raise CheckpointError(f"{src}: tensor {bad[0]!r} holds NaN/inf values ({len(bad)} tensor(s)): an "
                              "engine would serve a drafter whose drafts are all rejected; pass "
                              "--allow-nonfinite to export it anyway")
    why = engines.check(cfg, engine)
    if why:
        raise ConfigError(f"{src}: cannot export for {why}")
    extras = formats.read_extras(src)
    temps = formats.sts_temperatures(src)
    if temps is not None and len(temps) != cfg.block_size:
        raise ConfigError(f"{src}: extras['sts_temperatures'] has {len(temps)} entries, block_size "
                          f"is {cfg.block_size}")
    sps_table = engines.sps_sidecar(_read_sps(sps), cfg.block_size) if sps is not None else None
    sts = engines.sts_sidecar(temps, extras.get("sts_report")) if temps is not None else None
    host = jax.tree.map(np.asarray, params)
    tensors = mapping.draft_to_torch(cfg, host)
    if engine in engines.TRAINERS:  # back to another trainer: its own config layout and tensor names
        tensors = foreign.foreign_tensors(tensors, engine)
        hf = foreign.foreign_config(cfg.to_hf(), engine)
    else:
        hf = engines.export_config(cfg.to_hf(), cfg, engine)
    dtype = next(iter({np.dtype(t.dtype).name for t in tensors.values()}))
    hf["dtype"] = hf["torch_dtype"] = dtype
    if extras:  # as checkpoint.save_draft does: STS temperatures survive a re-export / inspect
        hf["dspark_jax"] = {"extras": dict(extras)}
    sidecars = []
    with checkpoint.atomic_dir(dst, force=force) as tmp:
        safetensors_io.write_tensors(tmp, tensors)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if sts is not None:
            (tmp / engines.STS_FILE).write_text(json.dumps(sts, indent=1) + "\n")
            sidecars.append(engines.STS_FILE)
        if sps_table is not None:
            (tmp / engines.SPS_FILE).write_text(json.dumps(sps_table, indent=1) + "\n")
            sidecars.append(engines.SPS_FILE)
        for name in formats.SIDECAR_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
    nbytes = sum(t.nbytes for t in tensors.values())
    return {"event": "export", "engine": engine, "src": str(src), "dst": str(dst),
            "architecture": hf["architectures"][0], "tensors": len(tensors), "bytes": int(nbytes),
            "dtype": dtype, "sidecars": sidecars,
            "warnings": [w for w in engines.serving_warnings(cfg, [engine]) if "limitation" in w]}


def export_v4_module(draft, dst, engine: str, *, target=None, force: bool = False, sps: Mapping | None = None) -> dict:
    """``dspark-jax export`` of a V4 DSpark module: the V4 checkpoint ``target`` (default ``draft``
    itself, when it is a whole V4 checkpoint) with its module replaced by ``draft``'s
    (``dspark_v4.write_checkpoint``), refused with the engine's rule (``engines_v4.V4_RULES``) before anything is
    written when the engine could not load the result. For SGLang, beside it the STS file (when
    ``draft`` carries calibrated temperatures) and the SPS file of ``sps`` (a profile-sps table
    {batch_sizes, sps}), as for the Qwen3 drafters; vLLM reads neither. Returns a summary."""
    import collections

    import numpy as np

    from dspark_jax.convert import dspark_v4, safetensors_io
    from dspark_jax.convert.formats import read_extras, sts_temperatures

    cfg, params = dspark_v4.load_module(draft)
    src = Path(target) if target is not None else Path(draft)
    reader = safetensors_io.TensorReader(src)
    shared = {s.torch for s in dspark_v4.module_specs_of(cfg, True).values() if not s.torch.startswith(dspark_v4.PREFIX)}
    if all(n.startswith(dspark_v4.PREFIX) or n in shared for n in reader.infos):
        raise CheckpointError(f"{src}: holds the DSpark module but not its target's layers; pass --target "
                              f"(the V4 checkpoint it is written into)")
    src_hf = dspark_v4._target_config(src, cfg)
    tensors = dspark_v4.stored_module(cfg, params, src, reader.infos)
    hf = {**src_hf, **cfg.hf_fields()}
    names = {n: i.dtype for n, i in reader.infos.items() if not n.startswith(dspark_v4.PREFIX)}
    names.update({n: t.dtype for n, t in tensors.items()})
    facts = engines_v4.v4_facts(hf, names)
    why = engines_v4.v4_check(facts, engine)
    if why:
        raise ConfigError(f"{draft}: cannot export for {why}")
    sidecars = {}
    temps = sts_temperatures(draft)
    if temps is not None and engine == "sglang":  # SGLang's STS calibration file, as for Qwen3 drafters
        if len(temps) != cfg.block_size:
            raise ConfigError(f"{draft}: extras['sts_temperatures'] has {len(temps)} entries, "
                              f"dspark_block_size is {cfg.block_size}")
        sidecars[engines.STS_FILE] = json.dumps(engines.sts_sidecar(temps, read_extras(draft).get("sts_report")),
                                                indent=1) + "\n"
    notes = []
    if sps is not None:
        table = engines.sps_sidecar(sps, cfg.block_size)  # validated for every engine
        if engine == "sglang":  # its planner's cost table (dspark_components/dspark_sps.py)
            sidecars[engines.SPS_FILE] = json.dumps(table, indent=1) + "\n"
        else:
            notes.append(f"{engine} reads no SPS file: --sps is not written")
    dspark_v4._write(src, dst, src_hf, cfg, tensors, reader, force, sidecars)
    return {"event": "export", "engine": engine, "src": str(draft), "target": str(src), "dst": str(dst),
            "architecture": hf["architectures"][0], "tensors": len(tensors),
            "bytes": int(sum(t.nbytes for t in tensors.values())), "dtype": str(params["main_norm"].dtype),
            "stored_dtypes": dict(sorted(collections.Counter(np.dtype(t.dtype).name for t in tensors.values()).items())),
            "sidecars": sorted(sidecars), "warnings": notes + [f"{engine} will load it with a limitation: {why} [{r.source}]"
                                                 for r, why in engines_v4.v4_violations(facts, engine, "warning")]}
