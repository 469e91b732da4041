"""`dspark-jax inspect CKPT`: what a drafter is and which serving engines load it; what a target checkpoint holds."""

from __future__ import annotations

import argparse
import json

HELP = ("summarise a checkpoint: a drafter and which serving engines load it (and why not), or a "
        "target (layers, parameter counts, stored dtypes and quantization, DeepSeek-V4's attention "
        "types, MoE routing and mtp.* tensors)")


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help=HELP, description=HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", metavar="CKPT", help="drafter or target checkpoint directory (either format)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def describe_draft(path) -> dict:
    """JSON-able summary: family, head, layer ids, block size, tensors, sidecars, engines."""
    from pathlib import Path

    import numpy as np

    from dspark_jax.convert import checkpoint, engines, formats, mapping

    p = Path(path)
    cfg, params = checkpoint.load_draft(p)
    f = engines.facts(cfg)
    shapes = mapping.draft_tensor_shapes(cfg)
    itemsize = np.dtype(next(iter(_leaves(params))).dtype).itemsize
    nbytes = int(sum(int(np.prod(s)) for s in shapes.values()) * itemsize)
    extras = formats.read_extras(p)
    sidecars = {}
    if extras.get("sts_temperatures") is not None:
        sidecars["sts_temperatures"] = [round(float(t), 4) for t in extras["sts_temperatures"]]
    for name in (engines.STS_FILE, engines.SPS_FILE):
        if (p / name).is_file():
            sidecars[name] = str(p / name)
    per_engine = {}
    for engine in engines.TARGETS:
        why = engines.check(cfg, engine)
        notes = [w for rule, w in engines.violations(cfg, engine, "warning")]
        per_engine[engine] = {"loadable": why is None, "why_not": why, "notes": notes,
                              "checked": engines.checked_against(engine, f.family) or ["read"]}
    arch = (cfg.to_hf().get("architectures") or ["?"])[0]
    return {"path": str(p), "format": formats.detect_format(p), "family": f.family, "architecture": arch,
            "head": f.head, "markov_rank": f.markov_rank, "confidence_head": f.enable_confidence_head,
            "target_layer_ids": list(f.target_layer_ids), "num_target_layers": f.num_target_layers,
            "block_size": f.block_size, "mask_token_id": f.mask_token_id,
            "draft_layers": cfg.num_hidden_layers, "tensors": len(shapes), "bytes": nbytes,
            "sidecars": sidecars, "engines": per_engine}


def _leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def run(args) -> int:
    from dspark_jax.convert import formats
    if formats.detect_kind(args.ckpt) == "target":
        return _print_target(args)
    info = describe_draft(args.ckpt)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{info['path']}  ({info['format']} format)")
    print(f"  family {info['family']} ({info['architecture']}), head {info['head']} (markov_rank {info['markov_rank']}), "
          f"confidence head {'yes' if info['confidence_head'] else 'no'}")
    print(f"  target layers {info['target_layer_ids']} of {info['num_target_layers']}, "
          f"block size {info['block_size']}, mask token {info['mask_token_id']}, "
          f"{info['draft_layers']} drafter layers")
    print(f"  {info['tensors']} tensors, {info['bytes']} bytes")
    if info["sidecars"]:
        for k, v in info["sidecars"].items():
            print(f"  {k}: {v}")
    else:
        print("  no STS / SPS sidecars")
    for engine, e in info["engines"].items():
        status = "loadable" if e["loadable"] else f"NOT loadable: {e['why_not']}"
        checked = ", ".join(e["checked"]) if e["checked"] != ["read"] else "rules read from its source"
        print(f"  {engine:<11} {status}  [{checked}]")
        for note in e["notes"]:
            print(f"  {'':<11} note: {note}")
    return 0


def _print_target(args) -> int:
    from dspark_jax.convert import describe
    info = describe.describe_target(args.ckpt)
    if args.json:
        print(json.dumps(info))
        return 0
    n = info["params"]
    print(f"{info['path']}  ({info['format']} format)")
    print(f"  target {info['family']} ({info['architecture']}): {info['layers']} layers, hidden "
          f"{info['hidden_size']}, vocab {info['vocab_size']}")
    active = f", active per token {n['active_per_token']:,}" if "active_per_token" in n else ""
    print(f"  parameters {n['total']:,} (embedding + head {n['embedding_and_head']:,}, routed experts "
          f"{n['routed_experts']:,}{active})")
    for kind, ids in (info.get("attention") or {}).items():
        print(f"  {kind}: {len(ids)} layers {ids}")
    if "moe" in info:
        m = info["moe"]
        print(f"  MoE: {m['routed_experts']} routed experts (width {m['expert_width']}), top-{m['top_k']}, "
              f"{m['shared_experts']} shared; hash-routed layers {m['hash_layers']}")
    dtypes = ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items())
    print(f"  {info['tensors']} tensors stored: {dtypes}")
    if info["quantized"]:
        q = ", ".join(f"{v} {k}" for k, v in info["quantized"].items())
        print(f"  quantized: {q} (scales {', '.join(info['scale_dtypes'])})")
    else:
        print("  quantized: none (stored unquantized)")
    a = info["aside"]
    if a["tensors"]:
        print(f"  kept aside: {a['tensors']} mtp.* tensors ({a['bytes']:,} bytes), DSpark stages {a['mtp_stages']}")
    else:
        print("  no mtp.* tensors")
    d = info.get("dspark")
    if d:
        print(f"  DSpark module: block {d['block_size']}, target layers {d['target_layer_ids']}, "
              f"{d['stages']} stages, Markov rank {d['markov_rank']}, {d['heads']} heads, "
              f"window {d['window']}, noise token {d['noise_token_id']}, experts {d['experts']}")
    else:
        print("  DSpark module: none (no dspark_* keys)")
    return 0
