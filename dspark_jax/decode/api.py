"""The decode API's front door: speculative and autoregressive generation, static or continuous.

``speculative_generate`` / ``autoregressive_generate`` validate everything (``requests``,
``shapes``, ``sharded.check_mesh``: ConfigError / InputError before anything compiles), then run
the static driver (``static``: fixed batches) or the continuous engine (``engine.serve``:
``batching="continuous"``). ``decode_requests`` picks the mode from ``draft_cfg``.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax.numpy as jnp

from dspark_jax import families, sampling
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.decode import engine, policies, programs, requests, sharded, static
from dspark_jax.decode.memory import check_decode_memory
from dspark_jax.decode.policies import FullPolicy, VerifyPolicy
from dspark_jax.decode.requests import Result
from dspark_jax.decode.shapes import compiled_spans, plan_shapes
from dspark_jax.decode.state import DecodeStatic
from dspark_jax.errors import InputError


def speculative_generate(
    target_cfg: TargetConfig,
    target_params: dict,
    draft_cfg: DraftConfig,
    draft_params: dict,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 128,
    temperature: float = 0.0,
    policy: VerifyPolicy | None = None,
    batch_size: int = 1,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    confidence_temperatures: Sequence[float] | None = None,
    max_cache_len: int | None = None,
    loop: str = "device",
    progress: Callable[[int], None] | None = None,
    mesh=None,
    batching: str = "static",
    stats: dict | None = None,
    cache_spans: Sequence[int] | None = None,
) -> list[Result]:
    """Speculative decoding of ``prompts`` (token-id lists) in batches of ``batch_size``.

    Returns one Result per prompt (same order): new tokens only (at most
    max_new_tokens, cut after the first stop token), per-round acceptance
    lengths (bonus included), proposal lengths, accepted drafts and raw
    confidence logits. ``policy`` defaults to FullPolicy; ``loop`` is "device"
    (lax.while_loop) or "host" (Python loop over one compiled round);
    ``progress(n)`` is called with the number of requests finished per batch; ``mesh``
    (a ``jax.sharding.Mesh``, see ``sharded.make_decode_mesh``) shards params by their declared
    axes and the state by its declared axes (``sharded.state_axes``, ``programs.build_decode``).
    ``batching="continuous"`` serves the prompts through ``batch_size`` slots instead
    (``decode.engine.serve``: StreamResults with per-request latency; ``stats`` receives the
    stream's throughput). ``cache_spans``: the compiled attention spans over the cache (default
    ``default_spans`` of the capacity; outputs do not depend on them, only the time does).
    Raises ConfigError / InputError before compiling anything.
    """
    if batching != "static":
        return _continuous(target_cfg, target_params, draft_cfg, draft_params, prompts, batching,
                           max_new_tokens=max_new_tokens, temperature=temperature, policy=policy,
                           slots=batch_size, seed=seed, stop_token_ids=stop_token_ids,
                           confidence_temperatures=confidence_temperatures,
                           max_cache_len=max_cache_len, mesh=mesh, progress=progress, stats=stats,
                           cache_spans=cache_spans)
    families.check_pair(draft_cfg, target_cfg)
    draft_cfg.check_compatible(target_cfg)
    policies.require_confidence(policy, draft_cfg)
    sharded.check_mesh(mesh, target_cfg, draft_cfg, batch_size)
    budgets, prompts, stop_arr, stops = _common(target_cfg, prompts, max_new_tokens, temperature,
                                                batch_size, stop_token_ids)
    g = draft_cfg.block_size
    conf_temps = requests.confidence_temperatures(confidence_temperatures, g)
    if loop not in ("device", "host"):
        raise InputError(f"loop must be 'device' or 'host', got {loop!r}")
    max_pos = min(target_cfg.max_position_embeddings, draft_cfg.max_position_embeddings)
    p_len, max_len = plan_shapes(prompts, max(budgets), g, max_pos, max_cache_len)
    check_decode_memory(target_cfg, target_params, draft_cfg, draft_params, batch_size, max_len, mesh)
    st = DecodeStatic(target_cfg, draft_cfg, policy if policy is not None else FullPolicy(),
                      sampling.is_greedy(temperature), max(budgets),
                      spans=requests.spans_arg(cache_spans))
    compiled_spans(st, max_len)  # ConfigError now, not at trace time
    prog = programs.build_decode(mesh, sharded.decode_rules(target_cfg))
    mode = programs.speculative(prog, st, prog.place_params(draft_params, draft_cfg), conf_temps)
    return static.generate(mode, prog, prog.place_params(target_params, target_cfg), prompts,
                           budgets, stops, stop_arr, _temperature(temperature),
                           batch_size=batch_size, p_len=p_len, max_len=max_len, seed=seed,
                           loop=loop, progress=progress)


def autoregressive_generate(
    target_cfg: TargetConfig,
    target_params: dict,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 128,
    temperature: float = 0.0,
    batch_size: int = 1,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    max_cache_len: int | None = None,
    progress: Callable[[int], None] | None = None,
    mesh=None,
    batching: str = "static",
    stats: dict | None = None,
    cache_spans: Sequence[int] | None = None,
) -> list[Result]:
    """Baseline: one target token per step, same cache code, no drafter.

    Results have one "round" per generated token after the first (acceptance
    length 1, proposal length 0) so ``summarize`` works on both. ``mesh`` / ``batching`` /
    ``stats`` / ``cache_spans``: as for ``speculative_generate``.
    """
    if batching != "static":
        return _continuous(target_cfg, target_params, None, None, prompts, batching,
                           max_new_tokens=max_new_tokens, temperature=temperature, slots=batch_size,
                           seed=seed, stop_token_ids=stop_token_ids, max_cache_len=max_cache_len,
                           mesh=mesh, progress=progress, stats=stats, cache_spans=cache_spans)
    budgets, prompts, stop_arr, stops = _common(target_cfg, prompts, max_new_tokens, temperature,
                                                batch_size, stop_token_ids)
    sharded.check_mesh(mesh, target_cfg, None, batch_size)
    p_len, max_len = plan_shapes(prompts, max(budgets), 1, target_cfg.max_position_embeddings,
                                 max_cache_len)
    check_decode_memory(target_cfg, target_params, None, None, batch_size, max_len, mesh)
    st = DecodeStatic(target_cfg, None, None, sampling.is_greedy(temperature), max(budgets),
                      spans=requests.spans_arg(cache_spans))
    compiled_spans(st, max_len)  # ConfigError now, not at trace time
    prog = programs.build_decode(mesh, sharded.decode_rules(target_cfg))
    return static.generate(programs.autoregressive(prog, st), prog,
                           prog.place_params(target_params, target_cfg), prompts, budgets, stops,
                           stop_arr, _temperature(temperature), batch_size=batch_size,
                           p_len=p_len, max_len=max_len, seed=seed, loop="device",
                           progress=progress)


def _common(target_cfg, prompts, max_new_tokens, temperature, batch_size, stop_token_ids):
    """(budgets, prompts, stop ids [MAX_STOP_IDS], stops) of a static run, validated."""
    budgets = requests.per_request_budgets(
        max_new_tokens, len(prompts) if isinstance(prompts, (list, tuple)) else 0)
    r = max(budgets) if budgets else max_new_tokens
    prompts, stop_arr, stops = requests.validate_common(target_cfg, prompts, r, temperature,
                                                        batch_size, stop_token_ids)
    return budgets, prompts, stop_arr, stops


def _temperature(temperature: float):
    return jnp.float32(max(float(temperature), sampling.GREEDY_EPS))


def _continuous(target_cfg, target_params, draft_cfg, draft_params, prompts, batching, **kw):
    if batching != "continuous":
        raise InputError(f"batching must be 'continuous' or 'static', got {batching!r}")
    return engine.serve(target_cfg, target_params, draft_cfg, draft_params, prompts, **kw)


def decode_requests(target_cfg, target_params, prompts, *, draft_cfg=None, draft_params=None,
                    batching: str = "continuous", mesh=None, policy=None,
                    confidence_temperatures=None, **kw):
    """``speculative_generate`` (``draft_cfg`` given) or ``autoregressive_generate`` with
    ``batching`` ("continuous" | "static") and ``mesh`` (a Mesh, a spec string or None)."""
    if isinstance(mesh, str) or mesh is None:
        mesh = sharded.make_decode_mesh(mesh)
    t0 = time.perf_counter()
    stats = kw.pop("stats", None)
    st: dict = {}
    if draft_cfg is None:
        res = autoregressive_generate(target_cfg, target_params, prompts, batching=batching,
                                        mesh=mesh, stats=st, **kw)
    else:
        res = speculative_generate(target_cfg, target_params, draft_cfg, draft_params, prompts,
                                     policy=policy, confidence_temperatures=confidence_temperatures,
                                     batching=batching, mesh=mesh, stats=st, **kw)
    if stats is not None:
        if not st:
            seconds = time.perf_counter() - t0
            tokens = sum(len(r.output_ids) for r in res)
            st = dict(seconds=seconds, output_tokens=tokens,
                      tokens_per_second=tokens / seconds if seconds > 0 else 0.0)
        stats.update(st)
    return res
