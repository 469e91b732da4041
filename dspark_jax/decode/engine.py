"""Continuous batching: a request stream served through B slots without recompiling.

A request (prompt of any length, its own output budget, the shared stop tokens) waits in a
queue; a free slot takes the next one with ``prefill_into`` (a one-row prefill written into
row ``slot`` of the batched state, donated). Decoding runs in chunks (``chunk``: a device
``lax.while_loop`` of rounds that returns as soon as a row finishes while requests wait, or
when every row has finished); the host then reads the finished rows, frees their slots and
refills them. Rows that are not live are masked no-ops, so the batched round never changes
shape.

Compiled shapes (the documented set; nothing else compiles after warm-up):

- ``prefill_into`` once per prompt bucket P in ``buckets(L)`` = powers of two from
  ``loop.MIN_PROMPT_BUCKET`` up to the cache capacity L (a prompt of length n uses the smallest
  bucket >= n, so at most log2(L/16)+1 variants, each compiled when first needed);
- ``chunk`` once for the [B, L] state (B = slots);
- no other jitted program: the empty state is built on the host and device_put.

The same program set (``loop.build_decode(mesh)``) serves a mesh: data parallelism splits
the slots, tensor parallelism heads/MLP. The prefix scheduler sees the live rows every round
(its ``active`` argument), so its verification budget follows the concurrency as the queue
drains.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import sampling
from dspark_jax import sharding as sharding_lib
from dspark_jax import families
from dspark_jax.decode import loop as L
from dspark_jax.decode import sharded
from dspark_jax.decode.policies import FullPolicy
from dspark_jax.errors import InputError


@dataclasses.dataclass
class StreamResult(L.Result):
    """A request's Result plus its latency: ``queued_s`` (wait for a slot), ``ttft_s`` (from
    arrival (t=0 of the stream) to its first token), ``latency_s`` (arrival to last token),
    ``tokens_per_second`` (its tokens / (finish - slot start)), ``slot``. ``batch_index`` is 0
    and ``batch_seconds`` the stream's wall time (so ``summarize`` gives the stream throughput)."""

    slot: int = -1
    queued_s: float = 0.0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    tokens_per_second: float = 0.0


def buckets(max_len: int) -> list[int]:
    """The prompt buckets for cache capacity ``max_len`` (powers of two >= MIN_PROMPT_BUCKET)."""
    out, p = [], L.MIN_PROMPT_BUCKET
    while p < max_len:
        out.append(p)
        p *= 2
    out.append(max_len)
    return out


def bucket_of(n: int, max_len: int) -> int:
    return next(b for b in buckets(max_len) if b >= n)


def _empty_state(abstract, sharding=None):
    """Zeros of an abstract state (host arrays, device_put: nothing compiles)."""
    leaves, tree = jax.tree.flatten(abstract)
    state = jax.tree.unflatten(tree, [np.zeros(a.shape, a.dtype) for a in leaves])
    return jax.device_put(state) if sharding is None else jax.device_put(state, sharding)


def serve(
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
    max_rounds_per_chunk: int = 1 << 20,
    progress: Callable[[int], None] | None = None,
    stats: dict | None = None,
    request_keys=None,
    on_result: Callable[[int, StreamResult], None] | None = None,
    top_p: float = 1.0,
    cache_spans: Sequence[int] | None = None,
) -> list[StreamResult]:
    """Serve ``prompts`` through ``slots`` rows with continuous batching; results in input order.

    ``draft_cfg`` None: the autoregressive baseline. ``max_new_tokens``: one budget or one per
    prompt. ``order``: arrival order (default input order). ``stats`` (a dict) receives
    ``seconds``, ``output_tokens``, ``tokens_per_second``, ``chunks``, ``prefills``, ``buckets``.
    ``request_keys`` (optional, ``uint32 [N, 2]``, one PRNG key per prompt): request i samples
    from its own key only (per-row keys in the state), so its output does not depend on
    ``slots``, ``order`` or the other requests; default: one shared key per step (as before).
    ``on_result(i, result)`` is called as request i finishes. ``top_p`` < 1: nucleus sampling
    (autoregressive only). ``cache_spans``: the compiled attention spans over the cache
    (``loop.compiled_spans``; the longest live row picks one). Raises ConfigError / InputError
    before compiling anything.
    """
    spec = draft_cfg is not None
    if spec:
        families.check_pair(draft_cfg, target_cfg)
        draft_cfg.check_compatible(target_cfg)
    budgets = L.per_request_budgets(max_new_tokens, len(prompts) if isinstance(prompts, (list, tuple)) else 0)
    r_cap = max(budgets) if budgets else 1
    prompts, stop_arr, stops = L._validate_common(target_cfg, prompts, r_cap, temperature, slots,
                                                  stop_token_ids)
    sharded.check_mesh(mesh, target_cfg, draft_cfg, slots)
    order = list(range(len(prompts))) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(len(prompts))):
        raise InputError("order must be a permutation of the prompt indices")
    row_keys = request_keys is not None
    if row_keys:
        request_keys = np.asarray(request_keys)
        if request_keys.shape != (len(prompts), 2) or not np.issubdtype(request_keys.dtype, np.integer):
            raise InputError(f"request_keys must be {len(prompts)} PRNG keys (uint32 [N, 2]), got "
                             f"shape {request_keys.shape}")
        request_keys = request_keys.astype(np.uint32)
    top_p = float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")
    if spec and top_p < 1.0:
        raise InputError("top_p < 1 is supported for autoregressive decoding only (speculative "
                         "verification against a nucleus-filtered target is not implemented); "
                         "decode without a drafter or use top_p = 1")
    g = draft_cfg.block_size if spec else 1
    max_pos = target_cfg.max_position_embeddings
    if spec:
        max_pos = min(max_pos, draft_cfg.max_position_embeddings)
    _, max_len = L.plan_shapes(prompts, r_cap, g, max_pos, max_cache_len)
    conf_temps = L._confidence_temperatures(confidence_temperatures, g) if spec else None
    policy = (policy if policy is not None else FullPolicy()) if spec else None
    greedy = sampling.is_greedy(temperature)
    static = L._Static(target_cfg, draft_cfg, policy, greedy, r_cap, top_p=top_p,
                       spans=L._spans_arg(cache_spans))
    L.compiled_spans(static, max_len)  # ConfigError now, not at trace time
    pre_static = dataclasses.replace(static, policy=None)
    temp = jnp.float32(max(float(temperature), sampling.GREEDY_EPS))

    prog = L.build_decode(mesh, sharded.decode_rules(target_cfg))
    tp = prog.place_params(target_params, target_cfg)
    dp = prog.place_params(draft_params, draft_cfg) if spec else None
    place_rep = (lambda x: x) if mesh is None else (
        lambda x: sharding_lib.to_global(x, sharding_lib.replicated(mesh)))
    temp, stop_arr = place_rep(temp), place_rep(stop_arr)
    conf_temps = place_rep(conf_temps) if spec else None

    # The empty [slots, L] state: shapes from eval_shape (no compile), zeros from the host.
    dummy = (jax.ShapeDtypeStruct((slots, L.MIN_PROMPT_BUCKET), jnp.int32),
             jax.ShapeDtypeStruct((slots,), jnp.int32), jax.ShapeDtypeStruct((slots,), bool))
    key0 = jax.random.PRNGKey(seed)
    state_key = np.zeros((slots, 2), np.uint32) if row_keys else key0
    if spec:
        abstract = jax.eval_shape(
            lambda a, b, c, k: L._spec_prefill(target_params, draft_params, a, b, c, k, temp,
                                               stop_arr, pre_static, max_len), *dummy, key0)
        state = _empty_state(abstract, None)
        state = state.replace(policy_state=policy.init_state(slots, g), key=state_key)
        if mesh is not None:
            state = sharding_lib.to_global(state, prog.state_sharding(state))
    else:
        abstract = jax.eval_shape(
            lambda a, b, c, k: L._ar_prefill(target_params, a, b, c, k, temp, stop_arr, static,
                                             max_len), *dummy, key0)
        state = _empty_state(abstract, None).replace(key=state_key)
        if mesh is not None:
            state = sharding_lib.to_global(state, prog.state_sharding(state))

    host_rng = np.random.default_rng(seed)
    pending = collections.deque(order)
    slot_req: list[int | None] = [None] * slots
    t_start: dict[int, float] = {}
    t_first: dict[int, float] = {}
    results: list[StreamResult | None] = [None] * len(prompts)
    used_buckets: set[int] = set()
    n_chunks = n_prefills = 0
    t0 = time.perf_counter()

    def insert(slot: int, i: int):
        nonlocal state, n_prefills
        p = prompts[i]
        pb = bucket_of(len(p), max_len)
        used_buckets.add(pb)
        arr = np.zeros((1, pb), np.int32)
        arr[0, :len(p)] = p
        k = (request_keys[i] if row_keys
             else np.asarray(host_rng.integers(0, 2**32, size=2, dtype=np.uint32)))
        args = [np.int32(slot), arr, np.asarray([len(p)], np.int32),
                np.asarray([budgets[i]], np.int32), k]
        args = [place_rep(a) for a in args]
        if spec:
            state = prog.prefill_into(tp, dp, state, *args, temp, stop_arr, static=pre_static,
                                      max_len=max_len)
        else:
            state = prog.ar_prefill_into(tp, state, *args, temp, stop_arr, static=static,
                                         max_len=max_len)
        n_prefills += 1

    def harvest(host, slot: int, i: int, now: float):
        start = len(prompts[i])
        if spec:
            n = int(host["rounds"][slot])
            acc = [int(x) for x in host["acc"][slot, :n]]
            count = 1 + sum(acc)
            out = L._trim([int(t) for t in host["seq"][slot, start:start + count]], budgets[i], stops)
            conf = ([[float(c) for c in row] for row in host["conf"][slot, :n]]
                    if draft_cfg.enable_confidence_head else None)
            res = StreamResult(out, acc, [int(x) for x in host["prop"][slot, :n]],
                               [int(x) for x in host["drafts"][slot, :n]], conf, start, slot, 0.0)
        else:
            out = L._trim([int(t) for t in host["seq"][slot, start:int(host["pos"][slot]) + 1]],
                          budgets[i], stops)
            m = max(len(out) - 1, 0)
            res = StreamResult(out, [1] * m, [0] * m, [0] * m, None, start, slot, 0.0)
        res.slot = slot
        res.queued_s = t_start[i] - t0
        res.ttft_s = t_first[i] - t0
        res.latency_s = now - t0
        res.tokens_per_second = len(out) / max(now - t_start[i], 1e-9)
        results[i] = res
        if on_result is not None:
            on_result(i, res)

    while pending or any(r is not None for r in slot_req):
        fresh = []
        for slot in range(slots):
            if slot_req[slot] is None and pending:
                i = pending.popleft()
                t_start[i] = time.perf_counter()
                insert(slot, i)
                slot_req[slot] = i
                fresh.append(i)
        if fresh:
            jax.block_until_ready(state.active)
            now = time.perf_counter()
            for i in fresh:
                t_first[i] = now
        steps, until = np.int32(max_rounds_per_chunk), np.bool_(bool(pending))
        if spec:
            state = prog.chunk(tp, dp, state, temp, stop_arr, conf_temps, place_rep(steps),
                               place_rep(until), static=static)
        else:
            state = prog.ar_chunk(tp, state, temp, stop_arr, place_rep(steps), place_rep(until),
                                  static=static)
        n_chunks += 1
        active = np.asarray(sharding_lib.to_host(state.active))
        now = time.perf_counter()
        done = [s for s in range(slots) if slot_req[s] is not None and not active[s]]
        if not done:
            continue
        if spec:
            host = sharding_lib.to_host({"seq": state.seq, "rounds": state.rounds, "acc": state.acc_rec,
                                   "prop": state.prop_rec, "drafts": state.drafts_rec,
                                   "conf": state.conf_rec})
        else:
            host = sharding_lib.to_host({"seq": state.seq, "pos": state.pos})
        for s in done:
            harvest(host, s, slot_req[s], now)
            slot_req[s] = None
        if progress is not None:
            progress(len(done))

    seconds = time.perf_counter() - t0
    for r in results:
        r.batch_seconds = seconds
        r.batch_index = 0
    if stats is not None:
        tokens = sum(len(r.output_ids) for r in results)
        stats.update(seconds=seconds, output_tokens=tokens,
                     tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
                     chunks=n_chunks, prefills=n_prefills, buckets=sorted(used_buckets),
                     slots=slots, max_len=max_len)
    return results  # type: ignore[return-value]


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
        res = L.autoregressive_generate(target_cfg, target_params, prompts, batching=batching,
                                        mesh=mesh, stats=st, **kw)
    else:
        res = L.speculative_generate(target_cfg, target_params, draft_cfg, draft_params, prompts,
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


def warmup_prompts(prompts, max_len: int) -> list[int]:
    """Indices of one prompt per prompt bucket (the longest in it): decoding them compiles
    every shape a continuous run of ``prompts`` at cache capacity ``max_len`` will use."""
    best: dict[int, int] = {}
    for i, p in enumerate(prompts):
        b = bucket_of(len(p), max_len)
        if b not in best or len(p) > len(prompts[best[b]]):
            best[b] = i
    return sorted(best.values())
