"""Measured serving: request streams through the continuous engine, and the costs they ran at.

``serve_point`` serves one (curve, concurrency) stream after a warm-up that compiles every
shape it will use (one prompt per prompt bucket at full budget), so the timed run compiles
nothing (its count is reported). ``profile_costs`` measures, on this machine, what projected
mode reads: the drafter's round table (``decode.profile.measure_rounds`` at the concurrencies),
AR steps/s and the per-request host cost (prefill into a slot + the harvest of a finished row)
at each concurrency, both timed on the engine's own stream (``engine.open_stream``).
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np

from dspark_jax import sharding as sharding_lib
from dspark_jax.costs.compiles import COMPILES
from dspark_jax.decode import engine, shapes
from dspark_jax.pipelines import bench_project as P


def stream_requests(prompts: Sequence[Sequence[int]], concurrency: int, per_slot: int,
                    minimum: int) -> list[int]:
    """Prompt indices of a stream at ``concurrency``: max(per_slot * C, minimum) requests cycling
    through the prompts (request i asks prompt i mod P)."""
    n = max(per_slot * concurrency, minimum)
    return [i % len(prompts) for i in range(n)]


def _cache_len(tc, dc, prompts, max_new: int) -> int:
    g = dc.block_size if dc is not None else 1
    max_pos = tc.max_position_embeddings
    if dc is not None:
        max_pos = min(max_pos, dc.max_position_embeddings)
    return shapes.plan_shapes(prompts, max_new, g, max_pos, None)[1]


def serve_point(pair, prompts, *, policy, slots: int, max_new: int, stops, temps,
                repeats: int = 1) -> tuple[list, dict]:
    """(results, stats) of the fastest of ``repeats`` timed streams (a shared machine only ever
    slows a run down); stats adds ``timed_compiles`` (all timed runs together)."""
    tc, tp, dc, dp = pair
    kw = dict(policy=policy, slots=slots, slots_flag="--concurrency", stop_token_ids=stops,
              confidence_temperatures=temps,
              max_cache_len=_cache_len(tc, dc, prompts, max_new))
    if dc is None:
        kw.pop("policy"), kw.pop("confidence_temperatures")
    warm = [prompts[i] for i in shapes.warmup_prompts(prompts, kw["max_cache_len"])]
    engine.serve(tc, tp, dc, dp, warm, max_new_tokens=max_new, **kw)
    before, best = COMPILES[0], None
    for _ in range(repeats):
        st: dict = {}
        res = engine.serve(tc, tp, dc, dp, prompts, max_new_tokens=max_new, stats=st, **kw)
        if best is None or st["seconds"] < best[1]["seconds"]:
            best = (res, st)
    best[1]["timed_compiles"] = COMPILES[0] - before
    return best


def measured_row(results, stats: dict, speculative: bool) -> dict:
    """The row fields of a measured stream (as ``bench_project.served_row`` for projected)."""
    served = P.Served(np.array([len(r.output_ids) for r in results]),
                      np.array([r.tokens_per_second for r in results]),
                      np.array([r.ttft_s for r in results]), float(stats["seconds"]))
    if speculative:
        served.round_tokens = [a for r in results for a in r.acceptance_lengths]
        served.round_budget = [1 + p for r in results for p in r.proposal_lengths]
    row = P.served_row(served, speculative)
    row["timed_compiles"] = int(stats["timed_compiles"])
    return row


def _timed(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls of ``fn`` (it blocks on its own result)."""
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return float(best)


def stream_costs(pair, prompt, slots: int, max_new: int, *, rounds: int = 8,
                 repeats: int = 5) -> tuple[float, float]:
    """(seconds per step of the stream's chunk with every slot live, seconds of one request's
    host work: prefill into a slot, one more chunk dispatch and host read of ``active``, the state
    read back and the result built), fastest of ``repeats`` each, on a stream of ``slots`` slots
    of ``prompt`` (``engine.open_stream``; the engine's own programs)."""
    tc, tp, dc, dp = pair
    budget = max(max_new, rounds * (repeats + 2) * ((dc.block_size + 1) if dc is not None else 1))
    stream, _ = engine.open_stream(tc, tp, dc, dp, [prompt] * slots, max_new_tokens=budget,
                                   slots=slots, max_cache_len=_cache_len(tc, dc, [prompt], budget))
    mode, rep = stream.mode, stream.prog.replicate

    def insert(slot):
        stream._insert(slot, slot)
        jax.block_until_ready(stream.state.active)

    for s in range(slots):
        insert(s)  # the first compiles

    def chunk(n):
        steps, until = rep(np.int32(n)), rep(np.bool_(False))
        stream.state = mode.programs.chunk(stream.tparams, mode.dparams, stream.state, stream.temp,
                                           stream.stop_arr, mode.conf_temps, steps, until,
                                           static=mode.static)
        np.asarray(sharding_lib.to_host(stream.state.active))

    chunk(rounds)  # compiles
    step_s = _timed(lambda: chunk(rounds), repeats) / rounds
    dispatch_s = _timed(lambda: chunk(0), repeats)
    prefill_s = _timed(lambda: insert(0), repeats)
    harvest_s = _timed(lambda: mode.result(stream.state.host_view(), 0, len(prompt), budget,
                                           stream.stops), repeats)
    return step_s, prefill_s + dispatch_s + harvest_s


def ar_costs(pair, prompts, concurrencies: Sequence[int], max_new: int) -> dict:
    """AR steps/s and per-request host seconds at each concurrency (round-table meta fields)."""
    prompt = max(prompts, key=len)
    ar = [stream_costs(pair[:2] + (None, None), prompt, c, max_new) for c in concurrencies]
    return {"ar_rps": [1.0 / s for s in P.capped([s for s, _ in ar])],
            "ar_request_seconds": P.capped([r for _, r in ar]),
            "ar_raw": [[s, r] for s, r in ar]}


def round_table(pair, prompts, concurrencies: Sequence[int], max_new: int, *, meta=None,
                quick: bool = False) -> dict:
    """The drafter's round table JSON (``decode.profile.measure_rounds`` at ``concurrencies``
    from a cache of the median prompt + half the budget) plus ``request_seconds`` per C."""
    from dspark_jax.decode import profile

    tc, tp, dc, dp = pair
    typical = int(np.median([len(p) for p in prompts])) + max_new // 2
    table = profile.measure_rounds(tc, tp, dc, dp, concurrencies, max(typical, 1),
                                   rounds=4 if quick else 8, warmup=1,
                                   min_seconds=0.0 if quick else 0.05,
                                   repeats=2 if quick else 5, meta=meta)
    obj = table.to_json()
    prompt = max(prompts, key=len)
    raw = [stream_costs(pair, prompt, c, max_new)[1] for c in concurrencies]
    obj["request_seconds"], obj["request_raw"] = P.capped(raw), raw
    return obj


def ar_table(target_cfg, concurrencies: Sequence[int], ar: dict) -> dict:
    """A one-width table holding only the AR costs (an AR-only run's cost file)."""
    from dspark_jax.decode.tables import ROUND_FORMAT
    from dspark_jax.pipelines.bench_inputs import model_signature

    return {"format": ROUND_FORMAT, "model": model_signature(target_cfg),
            "batch_sizes": list(concurrencies), "widths": [1],
            "rps": [[v] for v in ar["ar_rps"]], **ar}
