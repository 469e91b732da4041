"""Continuous batching: a request stream served through B slots without recompiling.

A request (prompt of any length, its own output budget, the shared stop tokens) waits in a
queue; a free slot takes the next one with the mode's ``prefill_into`` (a one-row prefill
written into row ``slot`` of the batched state, donated). Decoding runs in chunks (``chunk``: a
device ``lax.while_loop`` of steps that returns as soon as a row finishes while requests wait,
or when every row has finished); the host then reads the finished rows, frees their slots and
refills them. Rows that are not live are masked no-ops, so the batched step never changes shape.
The mode (``programs.speculative`` / ``programs.autoregressive``) is chosen once; the slot loop
runs either.

Compiled shapes (the documented set; nothing else compiles after warm-up):

- ``prefill_into`` once per prompt bucket P in ``shapes.buckets(L)`` = powers of two from
  ``shapes.MIN_PROMPT_BUCKET`` up to the cache capacity L (a prompt of length n uses the
  smallest bucket >= n, so at most log2(L/16)+1 variants, each compiled when first needed);
- ``chunk`` once for the [B, L] state (B = slots);
- no other jitted program: the empty state is built on the host and device_put.

The same program set (``programs.build_decode(mesh)``) serves a mesh: data parallelism splits
the slots, tensor parallelism heads/MLP. The prefix scheduler sees the live rows every round
(its ``active`` argument), so its verification budget follows the concurrency as the queue
drains.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import families, sampling
from dspark_jax import sharding as sharding_lib
from dspark_jax.decode import programs, requests, sharded
from dspark_jax.decode.memory import check_decode_memory
from dspark_jax.decode.policies import FullPolicy, require_confidence
from dspark_jax.decode.requests import StreamResult
from dspark_jax.decode.shapes import MIN_PROMPT_BUCKET, bucket_of, compiled_spans, plan_shapes
from dspark_jax.decode.state import DecodeStatic, empty_state


def open_stream(
    target_cfg,
    target_params: dict,
    draft_cfg,
    draft_params: dict | None,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 128,
    temperature: float = 0.0,
    policy=None,
    slots: int = 8,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    confidence_temperatures: Sequence[float] | None = None,
    max_cache_len: int | None = None,
    mesh=None,
    order: Sequence[int] | None = None,
    request_keys=None,
    on_result: Callable[[int, StreamResult], None] | None = None,
    top_p: float = 1.0,
    cache_spans: Sequence[int] | None = None,
    slots_flag: str = "--batch-size",
) -> tuple["_Stream", list[int]]:
    """The validated stream of ``serve`` (its programs, params placed, the empty state) and the
    arrival order; nothing compiled yet (profilers time its pieces: ``_insert``, ``chunk``).

    ``draft_cfg`` None: the autoregressive baseline. ``max_new_tokens``: one budget or one per
    prompt. ``order``: arrival order (default input order). ``request_keys`` (optional,
    ``uint32 [N, 2]``, one PRNG key per prompt): request i samples from its own key only
    (per-row keys in the state), so its output does not depend on ``slots``, ``order`` or the
    other requests; default: one shared key per step.
    ``on_result(i, result)`` is called as request i finishes. ``top_p`` < 1: nucleus sampling
    (autoregressive only). ``cache_spans``: the compiled attention spans over the cache
    (``shapes.compiled_spans``; the longest live row picks one). ``slots_flag``: the caller's flag
    for ``slots``, named when they cannot fit in memory. Raises ConfigError / InputError before
    compiling anything.
    """
    speculative = draft_cfg is not None
    if speculative:
        families.check_pair(draft_cfg, target_cfg)
        draft_cfg.check_compatible(target_cfg)
        require_confidence(policy, draft_cfg)
    budgets = requests.per_request_budgets(
        max_new_tokens, len(prompts) if isinstance(prompts, (list, tuple)) else 0)
    r_cap = max(budgets) if budgets else 1
    prompts, stop_arr, stops = requests.validate_common(target_cfg, prompts, r_cap, temperature,
                                                        slots, stop_token_ids)
    sharded.check_mesh(mesh, target_cfg, draft_cfg, slots)
    order, request_keys, top_p = requests.validate_stream(len(prompts), order, request_keys, top_p,
                                                          speculative)
    g = draft_cfg.block_size if speculative else 1
    max_pos = target_cfg.max_position_embeddings
    if speculative:
        max_pos = min(max_pos, draft_cfg.max_position_embeddings)
    _, max_len = plan_shapes(prompts, r_cap, g, max_pos, max_cache_len)
    check_decode_memory(target_cfg, target_params, draft_cfg, draft_params if speculative else None,
                        slots, max_len, mesh, flag=slots_flag)
    st = DecodeStatic(target_cfg, draft_cfg, (policy or FullPolicy()) if speculative else None,
                      sampling.is_greedy(temperature), r_cap, top_p=top_p,
                      spans=requests.spans_arg(cache_spans))
    compiled_spans(st, max_len)  # ConfigError now, not at trace time
    prog = programs.build_decode(mesh, sharded.decode_rules(target_cfg))
    if speculative:
        conf = prog.replicate(requests.confidence_temperatures(confidence_temperatures, g))
        mode = programs.speculative(prog, st, prog.place_params(draft_params, draft_cfg), conf)
    else:
        mode = programs.autoregressive(prog, st)
    stream = _Stream(mode, prog, prog.place_params(target_params, target_cfg), prompts, budgets,
                     stops, prog.replicate(stop_arr),
                     prog.replicate(jnp.float32(max(float(temperature), sampling.GREEDY_EPS))),
                     slots, max_len, seed, request_keys, on_result)
    return stream, order


def serve(target_cfg, target_params: dict, draft_cfg, draft_params: dict | None,
          prompts: Sequence[Sequence[int]], *, max_rounds_per_chunk: int = 1 << 20,
          progress: Callable[[int], None] | None = None, stats: dict | None = None,
          **kw) -> list[StreamResult]:
    """Serve ``prompts`` through ``slots`` rows with continuous batching; results in input order.

    Keyword arguments: those of ``open_stream``. ``stats`` (a dict) receives ``seconds``,
    ``output_tokens``, ``tokens_per_second``, ``chunks``, ``prefills``, ``buckets``.
    Raises ConfigError / InputError before compiling anything.
    """
    stream, order = open_stream(target_cfg, target_params, draft_cfg, draft_params, prompts, **kw)
    results = stream.run(order, max_rounds_per_chunk, progress)
    if stats is not None:
        stats.update(stream.stats(results))
    return results


class _Stream:
    """The slot loop of one ``serve`` call: its state, the queue and the timings."""

    def __init__(self, mode: programs.Mode, prog, tparams, prompts, budgets, stops, stop_arr, temp,
                 slots: int, max_len: int, seed: int, request_keys, on_result):
        self.mode, self.prog, self.tparams = mode, prog, tparams
        self.prompts, self.budgets, self.stops = prompts, budgets, stops
        self.stop_arr, self.temp, self.slots, self.max_len = stop_arr, temp, slots, max_len
        self.request_keys, self.on_result = request_keys, on_result
        self.host_rng = np.random.default_rng(seed)
        self.state = self._empty(jax.random.PRNGKey(seed))
        self.t_start: dict[int, float] = {}
        self.t_first: dict[int, float] = {}
        self.used_buckets: set[int] = set()
        self.n_chunks = self.n_prefills = 0
        self.t0 = 0.0

    def _empty(self, key0):
        """The empty [slots, L] state: shapes from eval_shape (no compile), zeros from the host."""
        mode, b = self.mode, self.slots
        dummy = (jax.ShapeDtypeStruct((b, MIN_PROMPT_BUCKET), jnp.int32),
                 jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), bool))
        prefill = functools.partial(mode.programs.prefill, static=mode.prefill_static,
                                    max_len=self.max_len)
        abstract = jax.eval_shape(lambda a, l, v, k: prefill(self.tparams, mode.dparams, a, l, v, k,
                                                             self.temp, self.stop_arr), *dummy, key0)
        key = np.zeros((b, 2), np.uint32) if self.request_keys is not None else key0
        state = mode.init_policy_state(empty_state(abstract, None), b).replace(key=key)
        if self.prog.mesh is not None:
            state = sharding_lib.to_global(state, self.prog.state_sharding(state))
        return state

    def _insert(self, slot: int, i: int):
        p = self.prompts[i]
        pb = bucket_of(len(p), self.max_len)
        self.used_buckets.add(pb)
        arr = np.zeros((1, pb), np.int32)
        arr[0, :len(p)] = p
        k = (self.request_keys[i] if self.request_keys is not None
             else np.asarray(self.host_rng.integers(0, 2**32, size=2, dtype=np.uint32)))
        args = [np.int32(slot), arr, np.asarray([len(p)], np.int32),
                np.asarray([self.budgets[i]], np.int32), k]
        mode = self.mode
        self.state = mode.programs.prefill_into(
            self.tparams, mode.dparams, self.state, *[self.prog.replicate(a) for a in args],
            self.temp, self.stop_arr, static=mode.prefill_static, max_len=self.max_len)
        self.n_prefills += 1

    def _harvest(self, host, slot: int, i: int, now: float) -> StreamResult:
        res = self.mode.result(host, slot, len(self.prompts[i]), self.budgets[i], self.stops,
                               cls=StreamResult)
        res.batch_index = slot  # as before: overwritten with 0 once the stream ends
        res.slot = slot
        res.queued_s = self.t_start[i] - self.t0
        res.ttft_s = self.t_first[i] - self.t0
        res.latency_s = now - self.t0
        res.tokens_per_second = len(res.output_ids) / max(now - self.t_start[i], 1e-9)
        if self.on_result is not None:
            self.on_result(i, res)
        return res

    def _fill(self, pending, slot_req) -> None:
        fresh = []
        for slot in range(self.slots):
            if slot_req[slot] is None and pending:
                i = pending.popleft()
                self.t_start[i] = time.perf_counter()
                self._insert(slot, i)
                slot_req[slot] = i
                fresh.append(i)
        if fresh:
            jax.block_until_ready(self.state.active)
            now = time.perf_counter()
            for i in fresh:
                self.t_first[i] = now

    def run(self, order, max_rounds_per_chunk: int, progress) -> list[StreamResult]:
        mode, rep = self.mode, self.prog.replicate
        pending = collections.deque(order)
        slot_req: list[int | None] = [None] * self.slots
        results: list[StreamResult | None] = [None] * len(self.prompts)
        self.t0 = time.perf_counter()
        if progress is not None:
            progress(0)  # validated: the work starts
        while pending or any(r is not None for r in slot_req):
            self._fill(pending, slot_req)
            steps, until = rep(np.int32(max_rounds_per_chunk)), rep(np.bool_(bool(pending)))
            self.state = mode.programs.chunk(self.tparams, mode.dparams, self.state, self.temp,
                                             self.stop_arr, mode.conf_temps, steps, until,
                                             static=mode.static)
            self.n_chunks += 1
            active = np.asarray(sharding_lib.to_host(self.state.active))
            now = time.perf_counter()
            done = [s for s in range(self.slots) if slot_req[s] is not None and not active[s]]
            if not done:
                continue
            host = self.state.host_view()
            for s in done:
                results[slot_req[s]] = self._harvest(host, s, slot_req[s], now)
                slot_req[s] = None
            if progress is not None:
                progress(len(done))
        self.seconds = time.perf_counter() - self.t0
        for r in results:
            r.batch_seconds, r.batch_index = self.seconds, 0
        return results  # type: ignore[return-value]

    def stats(self, results) -> dict:
        tokens = sum(len(r.output_ids) for r in results)
        return dict(seconds=self.seconds, output_tokens=tokens,
                    tokens_per_second=tokens / self.seconds if self.seconds > 0 else 0.0,
                    chunks=self.n_chunks, prefills=self.n_prefills, buckets=sorted(self.used_buckets),
                    slots=self.slots, max_len=self.max_len)
