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
"""

from __future__ import annotations

from typing import Callable, Sequence

from dspark_jax.costs import hardware
from dspark_jax.pipelines import plan as plan_lib


def compiled_round_table(draft_cfg, target_cfg, mesh, hw, batches: Sequence[int], *, max_len: int,
                         dtype, cpu_compiled: bool = False,
                         log: Callable[[str], None] = print) -> dict:
    """The round table JSON of ``draft_cfg`` + ``target_cfg`` on ``mesh`` of ``hw`` (a
    ``hardware.Hardware``) at slot counts ``batches`` and cache capacity ``max_len``
    (``cpu_compiled``: ``mesh`` holds simulated CPU devices; ``hw`` gives the rates only)."""
    from dspark_jax.decode import shapes
    from dspark_jax.decode.policies import FixedPolicy
    from dspark_jax.decode.tables import ROUND_FORMAT
    from dspark_jax.pipelines.bench_inputs import model_signature

    g = draft_cfg.block_size
    widths = shapes.verify_widths(g)
    rps, ar_rps, programs = [], [], []
    for b in batches:
        plan, sizes = plan_lib.plan_decode_round(None, target_cfg, mesh, batch=b, max_len=max_len,
                                                 dtype=dtype)
        ar_rps.append(1.0 / _seconds(plan, hw, programs, "ar_step", b, None, sizes, log))
        row = []
        for w in widths:
            plan, sizes = plan_lib.plan_decode_round(draft_cfg, target_cfg, mesh, batch=b,
                                                     max_len=max_len, dtype=dtype,
                                                     policy=FixedPolicy(w - 1))
            row.append(1.0 / _seconds(plan, hw, programs, "round", b, w, sizes, log))
        rps.append(row)
    if cpu_compiled:
        device = (f"{hw.chip.name} rates on XLA:CPU-compiled programs ({mesh.size} simulated CPU "
                  "devices; projected)")
        source = (f"compiled by XLA:CPU on {mesh.size} simulated CPU devices, mesh "
                  f"{dict(mesh.shape)}; each program's per-device flops / bytes charged at "
                  f"{hw.chip.name}'s {hw.chip.peak_flops / 1e12:g} TFLOP/s / "
                  f"{hw.chip.bandwidth / 1e12:g} TB/s: max(bytes / bandwidth, flops / peak) "
                  "(collectives not charged; XLA:CPU's bf16->f32 copies included)")
    else:
        device = f"{hw.spec} (compiled, projected)"
        source = (f"compiled for {hw.spec}: max(bytes / bandwidth, flops / peak) per program "
                  "per width (collectives not charged)")
    return {"format": ROUND_FORMAT, "batch_sizes": list(batches), "widths": list(widths),
            "rps": rps, "ar_rps": ar_rps, "block_size": g, "model": model_signature(target_cfg),
            "device": device, "mesh": dict(mesh.shape), "cache_length": max_len,
            "hardware": hw.to_json(), "source": source, "programs": programs}


def _seconds(plan, hw, programs: list, name: str, batch: int, width, sizes: dict, log) -> float:
    proj = plan_lib.projected(plan, hw.chip)
    programs.append({"program": name, "batch": batch, "width": width, "seconds": proj["seconds"],
                     "bound": proj["bound"], "step_flops": plan.step_flops,
                     "step_bytes": plan.step_bytes, "peak_bytes_per_chip": plan.peak_bytes,
                     "fits": hardware.fits(plan.peak_bytes, hw.chip),
                     "collectives": plan.collectives, "kv_cache_bytes": sizes.get("kv_cache_bytes"),
                     "upcast_bytes": plan.upcast_bytes, "platform": plan.platform,
                     "compile_seconds": plan.compile_seconds})
    log(f"{name} B={batch}" + (f" w={width}" if width else "")
        + f": {1e3 * proj['seconds']:.3f} ms ({proj['bound']}-bound), "
        f"peak {plan.peak_bytes / 2**30:.2f} GiB/chip, compiled in {plan.compile_seconds:.0f} s")
    return proj["seconds"]
