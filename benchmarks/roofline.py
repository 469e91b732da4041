"""Roofline projection of the shipped decode round, the AR step and the online train step.

    PYTHONPATH=$PWD nice -n 15 python benchmarks/roofline.py [--families qwen3-8b]
        [--batch-sizes 1 8 64] [--out DIR] [--smoke]

Nothing is materialised: params, states and batches are abstract (``jax.ShapeDtypeStruct``,
random-bf16-weight shapes). Each program is lowered with ``jax.jit(...).lower(abstract
args)`` with every ``lax.scan``/``lax.map`` unrolled (``unrolled_loops``: XLA's cost analysis
counts a loop body once), and ``lowered.cost_analysis()`` gives its ``flops`` (the
backend-independent HLO, every layer counted). Bytes: the compulsory traffic (every argument
-- weights, KV caches, state -- read once; a donated decode state is updated in place), which
is what a fused accelerator program moves at best; the unfused HLO's "bytes accessed"
(``bytes_hlo``, every op to and from HBM) is kept as a pessimistic bound. This host's
*compiled* cost analysis is not used for the projection (``--compile-cost`` records it): on
CPU it reflects CPU code generation (bf16 dots upcast to f32, scatters as loops; measured for
the Qwen3-8B AR step at B=1: 289 GFLOP / 579 GB compiled vs 16.4 GFLOP exact).
Projected time on a chip = max(flops / peak FLOP/s, bytes / memory bandwidth) (``HARDWARE``);
the projected round/AR ratio is the ratio of the two projections.

Train step: ``dspark_jax.train.step.build_train_step`` in online mode (the frozen target
runs inside the step) with the production options of the family's config (bf16 compute over
fp32 masters, remat, chunked loss), one sequence of ``seq_len`` tokens per chip per
micro-step. tokens/s per chip = seq_len / projected step time; MFU = analytic model FLOPs
(``model_flops``: 2 x target matmul params x tokens for the frozen target forward, 6 x
drafter matmul params x block tokens for the drafter, attention included) / (projected time x
peak). The projection is an upper bound (perfect overlap, peak rates, no launch overheads).

Families (``FAMILIES``, keyed by name) give the target, the drafter and the train options; one
``preset_family(preset, config file)`` entry per target: the target is a ``presets.TARGETS``
shape of any registered family (Qwen3, Gemma4), the drafter that family's drafter shaped by the
config file's ``draft`` section, the train options its ``compute_dtype`` and ``memory`` section.

``--hardware CHIP:GRID`` (e.g. ``h200:1``, ``tpu-v5e:2x4``; the ``cuda`` / ``tpu`` extra): instead,
the round and the AR step are compiled by that accelerator's compiler for compile-only devices
(mesh ``tensor=N``, scanned as shipped), and flops, bytes (every loop body x its trip count,
``hlo_cost.step_cost``), memory and the projection come from the compiled programs themselves
(``compiled_decode_costs``).

Writes ``roofline.json`` to ``--out``; prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import round_cost  # noqa: E402  (the decode adapter lives there, once)

from dspark_jax import families  # noqa: E402
from dspark_jax.costs import hardware  # noqa: E402
from dspark_jax.config import DraftConfig, TargetConfig  # noqa: E402
from dspark_jax.draft import model as draft_model  # noqa: E402
from dspark_jax.target import gemma4, qwen3  # noqa: E402
from dspark_jax.costs.compiles import COMPILES
from dspark_jax.costs.flops import model_flops, target_attention_flops  # noqa: E402,F401  (accelerator.py reads them here)

ROOT = Path(__file__).resolve().parents[1]

# name: (peak dense bf16 FLOP/s, memory bandwidth bytes/s) per chip
HARDWARE = {
    "H200": (989e12, 4.8e12),
    "TPU v5e": (197e12, 819e9),
}


# --------------------------------------------------------------------------- families


def _load_config(path: Path) -> dict:
    spec = importlib.util.spec_from_file_location(f"_roofline_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CONFIG


def train_options(cfg: dict) -> dict:
    """compute_dtype / remat / loss_chunk of a config dict (its ``memory`` section, or flat keys)."""
    mem = cfg.get("memory", {})
    return {"compute_dtype": cfg.get("compute_dtype", "bfloat16"),
            "remat": mem.get("remat", cfg.get("remat", "none")),
            "loss_chunk": int(mem.get("loss_chunk", cfg.get("loss_chunk", 0))),
            "max_length": int(cfg.get("max_length", 4096))}


def preset_family(preset: str, config_file: str) -> Callable[[], dict]:
    """A family entry: target preset (any registered family) + the drafter / train options of a
    production config file; the drafter is the target family's (``families.drafter_family``)."""
    def build():
        from dspark_jax.presets import TARGETS
        cfg = _load_config(ROOT / config_file)
        tcfg = TARGETS[preset]
        dcfg = families.drafter_family(tcfg).config_cls.for_target(tcfg, **cfg["draft"])
        return {"target": tcfg, "draft": dcfg, "train": train_options(cfg), "config_file": config_file,
                "init_target": lambda k: families.init_params(tcfg, k, jnp.bfloat16)}
    return build


def tiny_family() -> dict:
    """Smoke-test family: the round_cost 'mid' shape scaled down (hidden 128, 2 layers)."""
    tcfg = TargetConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    dcfg = DraftConfig.for_target(tcfg, num_hidden_layers=1, block_size=5, target_layer_ids=(0, 2),
                                  mask_token_id=1023, num_anchors=16, markov_rank=16)
    train = train_options({"compute_dtype": "bfloat16", "remat": "dots", "loss_chunk": 8, "max_length": 256})
    return {"target": tcfg, "draft": dcfg, "train": train, "config_file": None,
            "init_target": lambda k: qwen3.init_params(tcfg, k, jnp.bfloat16)}


def tiny_gemma4_family() -> dict:
    """Smoke-test family for the Gemma4 path: 6 layers (5 sliding, window 32 : 1 full, k = v)."""
    from dspark_jax.draft.gemma4 import Gemma4DraftConfig
    tcfg = gemma4.Gemma4TargetConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
        attention_k_eq_v=True, layer_types=(gemma4.SLIDING,) * 5 + (gemma4.FULL,), sliding_window=32,
        final_logit_softcapping=30.0, max_position_embeddings=4096)
    dcfg = Gemma4DraftConfig.for_target(tcfg, 1, block_size=5, target_layer_ids=(0, 2), mask_token_id=4,
                                        num_anchors=16, markov_rank=16)
    train = train_options({"compute_dtype": "bfloat16", "remat": "dots", "loss_chunk": 8, "max_length": 256})
    return {"target": tcfg, "draft": dcfg, "train": train, "config_file": None,
            "init_target": lambda k: families.init_params(tcfg, k, jnp.bfloat16)}


FAMILIES: dict[str, Callable[[], dict]] = {
    "qwen3-8b": preset_family("Qwen/Qwen3-8B", "configs/dspark_qwen3_8b_production.py"),
    "qwen3-4b": preset_family("Qwen/Qwen3-4B", "configs/dspark_qwen3_4b.py"),
    "gemma4-12b": preset_family("google/gemma-4-12B-it", "configs/dspark_gemma4_12b.py"),
    "tiny": tiny_family,
    "tiny-gemma4": tiny_gemma4_family,
}


# --------------------------------------------------------------------------- costs


unrolled_loops = hardware.unrolled_loops  # lower with every scan unrolled (loop bodies x trip counts)


def tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _cost(obj) -> dict:
    ca = obj.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {"flops": float(ca.get("flops", 0.0)), "bytes_hlo": float(ca.get("bytes accessed", 0.0))}


COMPILE_COST = [False]  # --compile-cost


def program_cost(lower: Callable, min_bytes: int, compile_cost: bool | None = None) -> dict:
    """Cost of one program: ``lower()`` is called with all loops unrolled.

    flops: the lowered HLO's cost analysis (exact matmul/elementwise counts, every layer).
    bytes: ``min_bytes`` = the compulsory traffic (every argument read once, written state
    counted by the caller), what a fused accelerator program moves at best; ``bytes_hlo``:
    the unfused HLO's "bytes accessed" (every op reads and writes HBM: a pessimistic bound).
    ``compile_cost`` adds this host backend's compiled numbers (``*_compiled``); on CPU they are
    not a GPU/TPU estimate (bf16 dots are upcast, scatters become loops), so they are off by
    default.
    """
    t0 = time.perf_counter()
    with unrolled_loops():
        lowered = lower()
    out = _cost(lowered)
    out["bytes"] = float(min_bytes)
    if COMPILE_COST[0] if compile_cost is None else compile_cost:
        c = _cost(lowered.compile())
        out.update(flops_compiled=c["flops"], bytes_compiled=c["bytes_hlo"])
    out["seconds_to_lower"] = time.perf_counter() - t0
    return out


def project(cost: dict) -> dict:
    """Projected seconds per chip: max(flops / peak, bytes / bandwidth), and which bound holds;
    ``seconds_hlo_bytes`` uses the unfused HLO bytes instead (pessimistic)."""
    out = {}
    for name, (peak, bw) in HARDWARE.items():
        tc, tm = cost["flops"] / peak, cost["bytes"] / bw
        out[name] = {"seconds": max(tc, tm), "compute_s": tc, "memory_s": tm,
                     "bound": "compute" if tc >= tm else "memory",
                     "seconds_hlo_bytes": max(tc, cost["bytes_hlo"] / bw)}
    return out


def spanned_cache_bytes(state, max_len: int) -> int:
    """Bytes of the state's caches whose slot axis is the capacity ``max_len`` (target KV cache,
    drafter context cache; not a sliding-window ring): what attention reads per step in full."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = [str(getattr(k, "name", getattr(k, "key", ""))) for k in path]
        if names and names[0] in ("cache", "ctx") and "sliding" not in names and leaf.ndim == 5 \
                and leaf.shape[2] == max_len:
            total += int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    return total


def at_span(cost: dict, cache_bytes: int, span: int, max_len: int) -> dict:
    """``cost`` with the cache reads cut to the first ``span`` of ``max_len`` slots (the compiled
    span a step at the prompt's length reads, ``shapes.compiled_spans``). FLOPs stay those of the
    whole capacity (an upper bound; attention FLOPs shrink too)."""
    return dict(cost, bytes=cost["bytes"] - cache_bytes * (1.0 - span / max_len))


def abstract(tree, dtype=None):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype), tree)


def decode_costs(fam: dict, batch: int, prompt_len: int, max_new: int) -> dict:
    tcfg, dcfg = fam["target"], fam["draft"]
    key = jax.random.PRNGKey(0)
    tp = abstract(jax.eval_shape(fam["init_target"], key), jnp.bfloat16)
    dp = abstract(jax.eval_shape(lambda k: families.init_params(dcfg, k), key), jnp.bfloat16)
    a = round_cost.decode_programs(tcfg, tp, dcfg, dp, batch, prompt_len, max_new, abstract=True)
    # Compulsory traffic: params + state read once; the donated state is updated in place.
    dp_own = {k: v for k, v in dp.items() if k not in draft_model.FROZEN_KEYS}  # embed / LM head: the target's
    rnd = program_cost(lambda: a["round"].lower(a["spec_state"]), tree_bytes((tp, dp_own, a["spec_state"])))
    ar = program_cost(lambda: a["ar_step"].lower(a["ar_state"]), tree_bytes((tp, a["ar_state"])))
    proj_r, proj_a = project(rnd), project(ar)
    span, cap = a["span"], a["max_len"]
    span_r = project(at_span(rnd, spanned_cache_bytes(a["spec_state"], cap), span, cap))
    span_a = project(at_span(ar, spanned_cache_bytes(a["ar_state"], cap), span, cap))
    return {"batch": batch, "prompt_len": prompt_len, "cache_len": cap, "span": span,
            "spans": list(a["spans"]), "block_size": dcfg.block_size, "round": rnd, "ar_step": ar,
            "at_span": {hw: {"round_s": span_r[hw]["seconds"], "ar_s": span_a[hw]["seconds"],
                             "round_over_ar": span_r[hw]["seconds"] / span_a[hw]["seconds"],
                             "round_bound": span_r[hw]["bound"], "ar_bound": span_a[hw]["bound"]}
                        for hw in HARDWARE},
            "projected": {hw: {"round_s": proj_r[hw]["seconds"], "ar_s": proj_a[hw]["seconds"],
                               "round_over_ar": proj_r[hw]["seconds"] / proj_a[hw]["seconds"],
                               "round_s_hlo_bytes": proj_r[hw]["seconds_hlo_bytes"],
                               "ar_s_hlo_bytes": proj_a[hw]["seconds_hlo_bytes"],
                               "round_over_ar_hlo_bytes": proj_r[hw]["seconds_hlo_bytes"]
                               / proj_a[hw]["seconds_hlo_bytes"],
                               "round_bound": proj_r[hw]["bound"], "ar_bound": proj_a[hw]["bound"]}
                          for hw in HARDWARE}}


def compiled_decode_costs(fam: dict, batch: int, prompt_len: int, max_new: int, hw, devices) -> dict:
    """The round and the AR step compiled for ``hw`` (compile-only devices, mesh ``tensor=N``), as
    shipped (scanned layers): per-device flops and bytes per step from the compiled HLO with every
    loop body counted per trip (``hlo_cost.step_cost``, recorded as ``step_flops`` / ``step_bytes``),
    memory from its buffer assignment, projected on ``hw.chip``.
    The cache capacity is the CPU projection's (prompt + new tokens, ``decode_programs``);
    attention reads all of it (one compiled span, the capacity)."""
    from dspark_jax import sharding
    from dspark_jax.pipelines import plan as plan_lib

    tcfg, dcfg = fam["target"], fam["draft"]
    key = jax.random.PRNGKey(0)
    tp = abstract(jax.eval_shape(fam["init_target"], key), jnp.bfloat16)
    dp = abstract(jax.eval_shape(lambda k: families.init_params(dcfg, k), key), jnp.bfloat16)
    cap = round_cost.decode_programs(tcfg, tp, dcfg, dp, batch, prompt_len, max_new, abstract=True)["max_len"]
    mesh = sharding.make_mesh(f"tensor={len(devices)}", devices)
    out = {"batch": batch, "prompt_len": prompt_len, "cache_len": cap, "block_size": dcfg.block_size,
           "hardware": hw.spec, "mesh": dict(mesh.shape)}
    for name, draft in (("round", dcfg), ("ar_step", None)):
        plan, sizes = plan_lib.plan_decode_round(draft, tcfg, mesh, batch=batch, max_len=cap,
                                                 max_new_tokens=max_new, spans=(cap,))
        proj = plan_lib.projected(plan, hw.chip)
        out[name] = dict(plan.to_json(), **sizes, projected=proj, fits=hardware.fits(plan.peak_bytes, hw.chip),
                         compulsory_bytes=sizes["target_bytes"] + sizes["draft_bytes"] + sizes["state_bytes"])
    out["round_over_ar"] = out["round"]["projected"]["seconds"] / out["ar_step"]["projected"]["seconds"]
    return out


def print_compiled(report: dict) -> None:
    for name, fam in report["families"].items():
        rows = fam.get("compiled_decode") or []
        if not rows:
            continue
        d0 = rows[0]
        print(f"\n{name}: decode compiled for {d0['hardware']} (mesh {d0['mesh']}, cache {d0['cache_len']}, "
              f"block {d0['block_size']}; per device, every loop body x its trip count)")
        print(f"{'B':>4} {'round GFLOP':>12} {'round GB':>9} {'AR GFLOP':>9} {'AR GB':>7} {'round/AR ms':>18} "
              f"{'ratio':>6} {'temp rnd/AR GiB':>16} {'fits':>5} {'compile s':>10}")
        for d in rows:
            r, a = d["round"], d["ar_step"]
            print(f"{d['batch']:>4} {r['step_flops'] / 1e9:>12.1f} {r['step_bytes'] / 1e9:>9.2f} "
                  f"{a['step_flops'] / 1e9:>9.1f} {a['step_bytes'] / 1e9:>7.2f} "
                  f"{r['projected']['seconds'] * 1e3:>8.3f}/{a['projected']['seconds'] * 1e3:<9.3f} "
                  f"{d['round_over_ar']:>6.2f} {r['temp_bytes'] / 2**30:>7.2f}/{a['temp_bytes'] / 2**30:<8.2f} "
                  f"{str(r['fits'] and a['fits']):>5} {r['compile_seconds']:>5.0f}/{a['compile_seconds']:<4.0f}")
            for prog in (r, a):
                big = ", ".join(f"{v['shape']} {v['op']}" for v in prog["largest"][:3])
                print(f"       {prog['name']} largest: {big}")


def train_costs(fam: dict, seq: int) -> dict:
    import optax  # noqa: F401
    from dspark_jax.train import optim, step as step_lib
    from dspark_jax.train.config import TrainConfig

    tcfg, dcfg, tr = fam["target"], fam["draft"], fam["train"]
    cfg = TrainConfig(target="x", data="x", batch_size=1, max_length=seq, steps=1000)
    opt, sched = optim.make_optimizer(cfg.optimizer, cfg.steps)
    compute = jnp.bfloat16 if tr.get("compute_dtype", "bfloat16") == "bfloat16" else jnp.float32
    fn = step_lib.build_train_step(dcfg, cfg.loss, opt, sched, target_cfg=tcfg, compute_dtype=compute,
                                   remat=tr["remat"], loss_chunk=tr["loss_chunk"])
    key = jax.random.PRNGKey(0)
    dshape = jax.eval_shape(lambda k: families.init_params(dcfg, k), key)
    trainable, frozen = optim.split_params(dshape, dcfg)
    state = jax.eval_shape(lambda p: step_lib.init_state(p, opt, 0), abstract(trainable, jnp.float32))
    frozen = abstract(frozen, jnp.bfloat16)
    tp = abstract(jax.eval_shape(fam["init_target"], key), jnp.bfloat16)
    batch = {"input_ids": jax.ShapeDtypeStruct((1, 1, seq), jnp.int32),
             "loss_mask": jax.ShapeDtypeStruct((1, 1, seq), jnp.float32)}
    # Compulsory traffic: everything read once, the train state (params + Adam moments) written once.
    cost = program_cost(lambda: jax.jit(fn, donate_argnums=(0,)).lower(state, frozen, tp, batch),
                        tree_bytes((state, frozen, tp, batch)) + tree_bytes(state))
    mf = model_flops(tcfg, dcfg, seq)
    proj = project(cost)
    return {"seq_len": seq, "sequences_per_chip": 1, "options": {k: tr.get(k) for k in
                                                                  ("compute_dtype", "remat", "loss_chunk")},
            "cost": cost, "model_flops": mf,
            "projected": {hw: {"step_s": p["seconds"], "bound": p["bound"], "tokens_per_s": seq / p["seconds"],
                               "mfu": mf / (p["seconds"] * HARDWARE[hw][0]),
                               "hlo_flops_over_model": cost["flops"] / mf,
                               "step_s_hlo_bytes": p["seconds_hlo_bytes"]}
                          for hw, p in proj.items()}}


# --------------------------------------------------------------------------- main


def print_tables(report: dict) -> None:
    for name, fam in report["families"].items():
        if "skipped" in fam:
            print(f"{name}: skipped ({fam['skipped']})")
            continue
        d0 = fam["decode"][0]
        print(f"\n{name}: decode (cache {d0['cache_len']} slots, block {d0['block_size']}; "
              f"'@span': cache reads cut to span {d0['span']}, the span a step at position "
              f"{d0['prompt_len']} reads)")
        print(f"{'B':>4} {'round GFLOP':>12} {'round GB':>9} {'AR GFLOP':>10} {'AR GB':>7}  "
              + "  ".join(f"{hw + ' rnd/AR ms':>22} {'ratio':>6} {'@span rnd/AR ms':>22} {'ratio':>6}"
                          for hw in HARDWARE))
        for d in fam["decode"]:
            cells = "  ".join(
                f"{d['projected'][hw]['round_s'] * 1e3:>10.3f}/{d['projected'][hw]['ar_s'] * 1e3:<11.3f} "
                f"{d['projected'][hw]['round_over_ar']:>6.2f} "
                f"{d['at_span'][hw]['round_s'] * 1e3:>10.3f}/{d['at_span'][hw]['ar_s'] * 1e3:<11.3f} "
                f"{d['at_span'][hw]['round_over_ar']:>6.2f}" for hw in HARDWARE)
            print(f"{d['batch']:>4} {d['round']['flops'] / 1e9:>12.1f} {d['round']['bytes'] / 1e9:>9.2f} "
                  f"{d['ar_step']['flops'] / 1e9:>10.1f} {d['ar_step']['bytes'] / 1e9:>7.2f}  {cells}")
        t = fam.get("train")
        if t:
            print(f"train step (online, {t['options']}, 1 x {t['seq_len']} tokens/chip): "
                  f"HLO {t['cost']['flops'] / 1e12:.2f} TFLOP, {t['cost']['bytes'] / 1e9:.1f} GB, "
                  f"model {t['model_flops'] / 1e12:.2f} TFLOP")
            for hw, p in t["projected"].items():
                print(f"  {hw:<8} step {p['step_s'] * 1e3:8.1f} ms ({p['bound']}-bound)  "
                      f"{p['tokens_per_s']:9.0f} tokens/s/chip  MFU <= {p['mfu'] * 100:5.1f}%")


def config_json(cfg) -> dict:
    """A target / drafter config as JSON: its Hugging Face config.json (``to_hf``) when it has one."""
    if hasattr(cfg, "to_hf"):
        return cfg.to_hf()
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="qwen3-8b,gemma4-12b", help=f"comma list of {','.join(FAMILIES)}")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--train-seq", type=int, default=0, help="train tokens per chip (0: the config's max_length)")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--compile-cost", action="store_true", help="also record this host's compiled cost analysis")
    ap.add_argument("--hardware", default=None, metavar="CHIP:GRID",
                    help="instead of the abstract projection, compile the round and AR step for these "
                         "compile-only devices (tpu-v5e:2x4, h200:1, ...; mesh tensor=N) and project from the "
                         "compiler's own flops / bytes / memory (needs the tpu or cuda extra)")
    ap.add_argument("--out", default=None, help="folder for roofline.json")
    ap.add_argument("--smoke", action="store_true", help="tiny Qwen3 and Gemma4 families, B=1,2 (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.families, args.batch_sizes, args.prompt_len, args.max_new_tokens = "tiny,tiny-gemma4", [1, 2], 64, 64
        args.train_seq = 128
    COMPILE_COST[0] = args.compile_cost
    hw = devices = None
    if args.hardware:
        from dspark_jax.errors import InputError
        try:
            hw = hardware.parse(args.hardware)
            devices = hardware.compile_devices(hw)
        except InputError as e:
            raise SystemExit(f"roofline.py: {e}")
    compiles_before = COMPILES[0]
    report = {"benchmark": "roofline",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "backend": jax.default_backend(), "jax": jax.__version__,
              "hardware": (hw.to_json() if hw else
                           {k: {"peak_flops": p, "bandwidth": b} for k, (p, b) in HARDWARE.items()}),
              "assumptions": "random bf16 weights (abstract), static cache of cache_len slots read in full, "
                             "greedy decoding, FullPolicy; time = max(flops/peak, bytes/bandwidth)",
              "families": {}}
    for name in args.families.split(","):
        if name not in FAMILIES:
            raise SystemExit(f"unknown family {name!r}; known: {sorted(FAMILIES)}")
        try:
            fam = FAMILIES[name]()
        except NotImplementedError as e:
            report["families"][name] = {"skipped": str(e)}
            continue
        entry = {"target": config_json(fam["target"]), "draft": config_json(fam["draft"]),
                 "config_file": fam["config_file"], "decode": []}
        for b in args.batch_sizes:
            if hw is not None:
                entry.setdefault("compiled_decode", []).append(
                    compiled_decode_costs(fam, b, args.prompt_len, args.max_new_tokens, hw, devices))
            else:
                entry["decode"].append(decode_costs(fam, b, args.prompt_len, args.max_new_tokens))
            print(f"{name} B={b}: done", flush=True)
        if not args.no_train and hw is None:
            entry["train"] = train_costs(fam, args.train_seq or int(fam["train"].get("max_length", 4096)))
        report["families"][name] = entry
    report["compiles"] = (COMPILES[0] - compiles_before)
    (print_compiled if hw else print_tables)(report)
    print(f"compiles: {(COMPILES[0] - compiles_before)} (costs come from lowered programs; nothing is timed)")
    if args.out:
        round_cost.write_json(Path(args.out) / "roofline.json", report)
        print(f"wrote {Path(args.out) / 'roofline.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
