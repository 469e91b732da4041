"""A round table compiled for a chip: ``plan --hardware CHIP --round-table FILE``.

For each slot count B of ``batches``: the AR step (``build_decode(mesh).ar.step``) and the
speculative round (``spec.step``) at every verification width w the round compiles
(``shapes.verify_widths(G)``; the round is compiled with ``FixedPolicy(w - 1)``, one width per
program) are compiled for the chip's compile-only devices on ``mesh``; each program's cost is
its roofline on one chip, max(bytes / bandwidth, flops / peak) of its per-run flops and bytes
(loop bodies x trip counts, ``hlo_cost.step_cost``; collectives not charged). The result is a
``RoundTable`` JSON (rounds/s = 1 / seconds) plus ``ar_rps`` and, per program, peak bytes per
chip and collectives: what ``bench --round-table`` projects from. Every number is a projection.

``cpu_compiled``: where no compiler plugin for the chip is installed, the programs are compiled
by XLA:CPU on simulated CPU devices (``plan --rates CHIP``) and their flops / bytes charged at the
chip's peak / bandwidth. Such a table says so in its ``device`` and ``source``: XLA:CPU runs bf16
dots in f32 and makes f32 copies of bf16 weights (``ProgramPlan.upcast_bytes``, reported per
program), so its bytes overstate the chip's own compiler's.

``analytic_round_table``: the same table from ``costs.analytic`` (declared shapes, no compile;
``plan --rates CHIP --analytic``), for a mixture-of-experts target whose compiled counts are not
usable here; its ``source`` says analytic.
"""

from __future__ import annotations

from typing import Callable, Sequence

from dspark_jax.costs import hardware
from dspark_jax.pipelines import plan as plan_lib


def compiled_round_table(draft_cfg, target_cfg, mesh, hw, batches: Sequence[int], *, max_len: int,
                         dtype, cpu_compiled: bool = False, ar: bool = True,
                         log: Callable[[str], None] = print) -> dict:
    """The round table JSON of ``draft_cfg`` + ``target_cfg`` on ``mesh`` of ``hw`` (a
    ``hardware.Hardware``) at slot counts ``batches`` and cache capacity ``max_len``
    (``cpu_compiled``: ``mesh`` holds simulated CPU devices; ``hw`` gives the rates only;
    ``ar`` False: no AR step, for a second drafter of a target whose other table carries it)."""
    from dspark_jax.decode.policies import FixedPolicy

    def cost(batch: int, width: int | None) -> dict:
        plan, sizes = plan_lib.plan_decode_round(
            draft_cfg if width else None, target_cfg, mesh, batch=batch, max_len=max_len,
            dtype=dtype, policy=FixedPolicy(width - 1) if width else None)
        return {"step_flops": plan.step_flops, "step_bytes": plan.step_bytes,
                "peak_bytes_per_chip": plan.peak_bytes, "fits": hardware.fits(plan.peak_bytes, hw.chip),
                "collectives": plan.collectives, "kv_cache_bytes": sizes.get("kv_cache_bytes"),
                "upcast_bytes": plan.upcast_bytes, "platform": plan.platform,
                "compile_seconds": plan.compile_seconds}

    if cpu_compiled:
        device = (f"{hw.chip.name} rates on XLA:CPU-compiled programs ({mesh.size} simulated CPU "
                  "devices; projected)")
        source = (f"compiled by XLA:CPU on {mesh.size} simulated CPU devices, mesh "
                  f"{dict(mesh.shape)}; each program's per-device flops / bytes charged at "
                  f"{_rates(hw)}: max(bytes / bandwidth, flops / peak) "
                  "(collectives not charged; XLA:CPU's bf16->f32 copies included)")
    else:
        device = f"{hw.spec} (compiled, projected)"
        source = (f"compiled for {hw.spec}: max(bytes / bandwidth, flops / peak) per program "
                  "per width (collectives not charged)")
    return _table(draft_cfg, target_cfg, hw, batches, cost, ar, log, device=device, source=source,
                  mesh=dict(mesh.shape), cache_length=max_len)


def analytic_round_table(draft_cfg, target_cfg, hw, batches: Sequence[int], *, max_len: int,
                         expert_shards: int, ar: bool = True,
                         log: Callable[[str], None] = print) -> dict:
    """The round table JSON from ``costs.analytic.program_cost`` (per device on a mesh whose
    ``expert`` axis has ``expert_shards`` devices, everything else replicated) at ``hw``'s
    rates: nothing compiled."""
    from dspark_jax.costs import analytic

    def cost(batch: int, width: int | None) -> dict:
        rec = analytic.program_cost(target_cfg, draft_cfg if width else None, batch=batch,
                                    width=width or 1, max_len=max_len, expert_shards=expert_shards)
        return dict(rec, fits=hardware.fits(rec["resident_bytes_per_device"], hw.chip))

    source = (f"analytic (costs.analytic: declared shapes, not compiled): per-device weights "
              f"read (bf16; routed experts sharded over expert={expert_shards}, those the tokens "
              f"route to under uniform routing), KV cache read, 2 x params x tokens FLOPs, "
              f"charged at {_rates(hw)}: max(bytes / bandwidth, flops / peak) (attention FLOPs, "
              "activations, collectives and host time not charged)")
    return _table(draft_cfg, target_cfg, hw, batches, cost, ar, log,
                  device=f"{hw.spec} rates, analytic costs (projected)", source=source,
                  mesh={"expert": expert_shards}, cache_length=max_len)


def _rates(hw) -> str:
    return (f"{hw.chip.name}'s {hw.chip.peak_flops / 1e12:g} TFLOP/s / "
            f"{hw.chip.bandwidth / 1e12:g} TB/s (costs/hardware.py)")


def _table(draft_cfg, target_cfg, hw, batches, cost: Callable[[int, int | None], dict], ar: bool,
           log, **meta) -> dict:
    """AR step (``cost(b, None)``) and round at every verification width (``cost(b, w)``) per
    slot count, each charged max(bytes / bandwidth, flops / peak) on ``hw``'s chip."""
    from dspark_jax.decode import shapes
    from dspark_jax.decode.tables import ROUND_FORMAT
    from dspark_jax.pipelines.bench_inputs import model_signature

    g = draft_cfg.block_size
    widths = shapes.verify_widths(g)
    rps, ar_rps, programs = [], [], []
    for b in batches:
        if ar:
            ar_rps.append(1.0 / _seconds(cost(b, None), hw, programs, "ar_step", b, None, log))
        rps.append([1.0 / _seconds(cost(b, w), hw, programs, "round", b, w, log) for w in widths])
    return {"format": ROUND_FORMAT, "batch_sizes": list(batches), "widths": list(widths),
            "rps": rps, "ar_rps": ar_rps if ar else None, "block_size": g,
            "model": model_signature(target_cfg), **meta, "hardware": hw.to_json(),
            "programs": programs}


def _seconds(rec: dict, hw, programs: list, name: str, batch: int, width, log) -> float:
    proj = hardware.project(rec["step_flops"], rec["step_bytes"], hw.chip)
    programs.append({"program": name, "batch": batch, "width": width, "seconds": proj["seconds"],
                     "bound": proj["bound"], **rec})
    peak = rec.get("peak_bytes_per_chip")
    log(f"{name} B={batch}" + (f" w={width}" if width else "")
        + f": {1e3 * proj['seconds']:.3f} ms ({proj['bound']}-bound)"
        + (f", peak {peak / 2**30:.2f} GiB/chip, compiled in {rec['compile_seconds']:.0f} s"
           if peak is not None else f", {rec['step_bytes'] / 1e9:.2f} GB, "
           f"{rec['step_flops'] / 1e12:.3f} TFLOP per device"))
    return proj["seconds"]
