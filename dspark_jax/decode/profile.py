"""Profile the decode cost the prefix scheduler plans with.

Round tables (``measure_rounds``; ``profile-sps --draft``, what the scheduler should use): whole
speculative rounds per second of the program that decodes (``programs.build_decode(mesh).spec.chunk``,
the continuous engine's device loop of rounds), at each slot count B and each compiled
verification width w (``shapes.round_widths``). The policy is a forced length (every row l = w-1,
read from the policy state), so the one compiled program per B (every width a ``lax.switch``
branch, as under the scheduler) is timed at every width. Each (B, w) runs chunks of ``rounds``
rounds from a cache of ``cache_length`` positions (rolled back between chunks); per B, chunks go
round-robin over the widths (at least ``repeats`` passes and ``min_seconds`` per width), the
fastest chunk counts. The stored latency (1/rps) is made non-decreasing in w and in B: other
processes only ever slow a chunk down, so a latency above that of a wider (or taller) round is
noise and is capped by it (reverse cumulative min). Raw values: ``meta["raw_rps"]``.

Token tables (``measure_sps``, ``profile-sps`` without ``--draft``): SPS(B), target
verification steps per second at B verification tokens (the verify forward alone).

The measured call is the real verification forward: the target family's runtime forward over a
cache that already holds ``cache_length`` positions, plus the LM head over every new
position (what rejection sampling reads), jitted with the cache donated. Layouts:

- ``"rows"`` (default): B rows of one token each, every row with its own cache of
  ``cache_length`` (B tokens spread over B requests: the memory-bound, pessimistic case);
- ``"block"``: one row of B tokens over one cache (compute-bound, optimistic).

Each batch size compiles once and runs ``warmup`` untimed calls; then ``repeats`` passes go
round-robin over all sizes, each pass timing one chunk of at least ``iters`` calls and
``min_seconds`` per size. SPS = calls / seconds of the fastest chunk of each size (other
processes only ever slow a chunk down), and interleaving the passes spreads a busy spell of
the machine over all sizes instead of carving a false cliff into a few neighbouring ones.

``fit`` (see ``dspark_jax.decode.tables``, default ``"convex"``) turns the measurements
into the stored curve: ``none``, ``monotone`` (isotonic SPS), ``linear`` (latency a + b*B) or
``convex`` (non-decreasing convex piecewise-linear latency). Raw values: ``meta["raw_sps"]``.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import families, runtime, sampling
from dspark_jax.config import TargetConfig
from dspark_jax.decode.tables import DEFAULT_FIT, FITS, SPSTable, fit_sps
from dspark_jax.errors import InputError
from dspark_jax.decode import sharded

LAYOUTS = ("rows", "block")


def default_batch_sizes(max_batch: int, dense_up_to: int = 16, growth: float = 1.25) -> list[int]:
    """1..dense_up_to every integer, then geometric steps (x``growth``), always ending at max_batch."""
    if max_batch < 1:
        raise InputError(f"max batch must be >= 1, got {max_batch}")
    sizes = list(range(1, min(dense_up_to, max_batch) + 1))
    b = sizes[-1]
    while b < max_batch:
        b = min(max_batch, max(b + 1, int(round(b * growth))))
        sizes.append(b)
    return sizes


def _verify_fn(config: TargetConfig, compute_dtype):
    rt = families.target_runtime(config)

    def verify(params, cache, tokens):
        hidden, _, delta = rt.forward(params, config, tokens, cache,
                                      ctx=runtime.Context(dtype=compute_dtype), taps=(), span=None)
        logits = rt.logits(params, config, hidden)                        # [rows, T, V]
        # Commit nothing, as a fully rejected round would (the masked scatter still runs).
        return jnp.argmax(logits, axis=-1), cache.commit(delta, jnp.zeros_like(cache.lengths))
    return jax.jit(verify, donate_argnums=(1,))


def measure_sps(
    config: TargetConfig,
    params: dict,
    batch_sizes: Sequence[int],
    cache_length: int,
    *,
    layout: str = "rows",
    warmup: int = 2,
    iters: int = 5,
    min_seconds: float = 0.2,
    repeats: int = 3,
    fit: str = DEFAULT_FIT,
    monotone: bool | None = None,
    cache_dtype=None,
    compute_dtype=None,
    meta: dict | None = None,
    progress: Callable[[int, float], None] | None = None,
    mesh=None,
) -> SPSTable:
    """SPS table for ``batch_sizes`` (verification tokens per forward) at ``cache_length``.

    ``fit``: one of ``none|monotone|linear|convex``; ``monotone=True`` (legacy flag) means
    ``fit="monotone"``, ``monotone=False`` leaves ``fit`` as given. ``progress(B, sps)`` is
    called once per size after the last pass. ``mesh``: measure on the mesh the decode engine
    runs on, params and cache placed by the same logical axes (``decode.sharded``) as
    ``build_decode`` places them (rows split over data where they divide, KV heads over tensor).
    """
    if monotone:
        fit = "monotone"
    sizes = _check_inputs(config, batch_sizes, cache_length, fit, layout, warmup, iters)
    dtype = cache_dtype or runtime.compute_dtype(params)
    verify = _verify_fn(config, compute_dtype)
    if mesh is not None:
        sharded.check_mesh(mesh, config, None, 1)
        params = sharded.place_params(params, config, mesh)
    state = _warm_states(config, params, verify, sizes, cache_length, layout, dtype, warmup, mesh)
    best = _time_states(params, verify, state, repeats, iters, min_seconds)
    del state
    if progress is not None:
        for b, v in zip(sizes, best):
            progress(b, float(v))
    info = _table_meta(config, cache_length, layout, dtype, meta,
                       warmup=warmup, iters=iters, min_seconds=min_seconds, repeats=repeats)
    return fit_sps(sizes, best, fit, meta=info)


def _check_inputs(config, batch_sizes, cache_length, fit, layout, warmup, iters) -> list[int]:
    """Sorted distinct batch sizes; InputError on a bad fit, layout, size, cache length or count."""
    if fit not in FITS:
        raise InputError(f"fit must be one of {FITS}, got {fit!r}")
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise InputError(f"batch sizes must be positive ints, got {list(batch_sizes)}")
    if cache_length < 0 or cache_length + (sizes[-1] if layout == "block" else 1) > config.max_position_embeddings:
        raise InputError(f"cache length {cache_length} (+ new tokens) must be in [0, "
                         f"max_position_embeddings={config.max_position_embeddings}]")
    if warmup < 0 or iters < 1:
        raise InputError(f"--warmup must be >= 0 and --iters >= 1, got {warmup} and {iters}")
    return sizes


def _place(x, axes, mesh):
    if mesh is None:
        return x
    from dspark_jax import sharding
    spec = sharding.logical_to_spec(axes, sharded.DECODE_RULES, x.shape, mesh)
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


def _warm_states(config, params, verify, sizes, cache_length, layout, dtype, warmup,
                 mesh=None) -> list:
    """Per size: [cache, tokens] after ``max(warmup, 1)`` untimed calls (the first compiles)."""
    rt = families.target_runtime(config)
    rng = np.random.default_rng(0)
    state = []
    for b in sizes:
        rows, t = (b, 1) if layout == "rows" else (1, b)
        cache = rt.init_cache(config, rows, cache_length + t, dtype, t)
        # A cache that claims cache_length committed positions (timing only: its zeros stand in).
        cache = cache.replace(lengths=jnp.full((rows,), cache_length, jnp.int32))
        if mesh is not None:
            cache = jax.tree.map(lambda x, a: _place(x, a, mesh), cache, cache.axes())
        tokens = _place(jnp.asarray(rng.integers(0, config.vocab_size, (rows, t)), jnp.int32),
                        ("batch", None), mesh)
        for _ in range(max(warmup, 1)):  # the first call compiles: never timed
            out, cache = verify(params, cache, tokens)
        jax.block_until_ready((out, cache))
        state.append([cache, tokens])
    return state


def _time_states(params, verify, state, repeats, iters, min_seconds) -> np.ndarray:
    """Best calls/second per size over ``repeats`` interleaved passes (each pass: at least
    ``iters`` calls and ``min_seconds``)."""
    best = np.zeros(len(state))
    for _ in range(max(repeats, 1)):
        for i, (cache, tokens) in enumerate(state):
            calls, t0 = 0, time.perf_counter()
            while True:
                out, cache = verify(params, cache, tokens)
                calls += 1
                if calls >= iters:
                    jax.block_until_ready((out, cache))
                    elapsed = time.perf_counter() - t0
                    if elapsed >= min_seconds:
                        break
            state[i][0] = cache
            best[i] = max(best[i], calls / elapsed)
    return best


def _table_meta(config, cache_length, layout, dtype, meta, **settings) -> dict:
    """The SPS table's meta: device, measurement settings, model shape, date, plus ``meta``."""
    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "num_devices": jax.device_count(),
        "cache_length": int(cache_length),
        "layout": layout,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **settings,
        "dtype": str(np.dtype(dtype)),
        "model": {"num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                  "vocab_size": config.vocab_size, "num_attention_heads": config.num_attention_heads,
                  "num_key_value_heads": getattr(config, "num_key_value_heads", None)},  # V4: no field (one shared K = V head)
        **(meta or {}),
    }


# ----------------------------------------------------------------------------- round tables


@dataclasses.dataclass(frozen=True)
class ForcedLength:
    """A verification policy returning its state (an int32 scalar) as every row's length: the
    width a profiled round runs is set from the host without recompiling. Not lossless in
    general (it is a profiling device)."""

    def init_state(self, batch_size: int, block_size: int):
        del batch_size, block_size
        return jnp.zeros((), jnp.int32)

    def __call__(self, state, confidences, active):
        return jnp.full(active.shape, state, jnp.int32), state


def default_round_batches(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, then ``max_batch`` (slot counts of a round table)."""
    if max_batch < 1:
        raise InputError(f"max batch must be >= 1, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def _time_rounds(sizes, ws, prefill, reset, chunk, rounds, warmup, repeats, min_seconds):
    """(latency, raw) seconds per round [len(sizes), len(ws)]: per B a prefilled state
    (``prefill(B)``) warmed at every width, then chunks round-robin over the widths (at least
    ``repeats`` passes and ``min_seconds`` per width), the fastest chunk of each counting.
    Noise only ever slows a chunk down: a latency above that of a wider width (or more rows) is
    noise, so each entry is capped by every wider / taller one (reverse cumulative min)."""
    states = {}
    for b in sizes:
        state = prefill(b)
        for w in ws:
            for _ in range(max(warmup, 1)):
                state = chunk(reset(state, b, w))
        jax.block_until_ready(state.pos)
        states[b] = state
    best = {(b, w): np.inf for b in sizes for w in ws}
    for b in sizes:
        spent = {w: 0.0 for w in ws}
        done = 0
        while done < repeats or min(spent.values()) < min_seconds:
            for w in ws:  # one chunk per width in turn: a busy spell hits every width alike
                state = reset(states[b], b, w)
                jax.block_until_ready(state.pos)
                t0 = time.perf_counter()
                state = chunk(state)
                jax.block_until_ready(state.pos)
                dt = time.perf_counter() - t0
                states[b] = state
                spent[w] += dt
                best[(b, w)] = min(best[(b, w)], dt / rounds)
            done += 1
    raw = np.array([[best[(b, w)] for w in ws] for b in sizes])
    lat = np.minimum.accumulate(raw[:, ::-1], axis=1)[:, ::-1]
    return np.minimum.accumulate(lat[::-1], axis=0)[::-1], raw


def _round_sizes(target_cfg, draft_cfg, batch_sizes, cache_length, widths, rounds, warmup, repeats):
    """(widths, sorted slot counts, cache capacity) of a round table: the compiled widths
    ``shapes.verify_widths(G, widths)`` and a capacity holding ``cache_length`` positions plus
    ``rounds + 1`` rounds of G + 1 tokens. InputError on bad sizes or a cache past the pair's
    positions."""
    from dspark_jax.decode import shapes

    g = draft_cfg.block_size
    ws = shapes.verify_widths(g, widths)
    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise InputError(f"batch sizes must be positive ints, got {list(batch_sizes)}")
    if rounds < 1 or warmup < 0 or repeats < 1:
        raise InputError("rounds and repeats must be >= 1, warmup >= 0")
    max_len = shapes.round_up(cache_length + (g + 1) * (rounds + 1), shapes.CACHE_BUCKET)
    max_pos = min(target_cfg.max_position_embeddings, draft_cfg.max_position_embeddings)
    if cache_length < 1 or max_len > max_pos:
        raise InputError(f"cache length {cache_length} + {rounds} rounds of {g + 1} tokens needs "
                         f"{max_len} positions; the pair has {max_pos}")
    return ws, sizes, max_len


def _replicate(mesh):
    """x -> x placed whole on every device of ``mesh`` (the identity without a mesh)."""
    if mesh is None:
        return lambda x: x
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return lambda x: jax.device_put(x, whole)


def _round_steps(prog, tp, dp, static, target_cfg, draft_cfg, mesh, cache_length, rounds, max_len):
    """(prefill, reset, chunk) of the decode program ``prog`` for ``_time_rounds``:
    ``prefill(B)`` a state of B random prompts of ``cache_length`` tokens; ``reset(state, B, w)``
    every row rewound to that length with the forced width w; ``chunk(state)`` ``rounds`` rounds."""
    from dspark_jax.decode import shapes

    g = draft_cfg.block_size
    rep = _replicate(mesh)
    temp = rep(jnp.float32(sampling.GREEDY_EPS))
    stop = rep(jnp.full((shapes.MAX_STOP_IDS,), -1, jnp.int32))
    conf_t = rep(jnp.ones((g,), jnp.float32))
    steps, until = rep(np.int32(rounds)), rep(np.bool_(False))
    pre = dataclasses.replace(static, policy=None)
    rng = np.random.default_rng(0)

    def prefill(b):
        if mesh is not None:
            sharded.check_mesh(mesh, target_cfg, draft_cfg, b)
        prompts = rng.integers(0, target_cfg.vocab_size, (b, cache_length)).astype(np.int32)
        lens = np.full((b,), cache_length, np.int32)
        budget = np.full((b,), (g + 1) * (rounds + 1), np.int32)
        return prog.spec.prefill(tp, dp, prog.place(prompts), prog.place(lens),
                                 prog.place(np.ones((b,), bool)), rep(jax.random.PRNGKey(0)), temp,
                                 stop, static=pre, max_len=max_len, max_new=prog.place(budget))

    def reset(state, b, w):
        pos = np.full((b,), cache_length, np.int32)
        # Timing only: a cache told it holds cache_length positions again (a family with folded
        # state would be corrupted by this, but the round's cost does not depend on its values).
        return state.replace(pos=prog.place(pos), active=prog.place(np.ones((b,), bool)),
                             cache=state.cache.replace(lengths=prog.place(pos)),
                             policy_state=rep(jnp.int32(w - 1)))

    def chunk(state):
        return prog.spec.chunk(tp, dp, state, temp, stop, conf_t, steps, until, static=static)

    return prefill, reset, chunk


def measure_rounds(
    target_cfg: TargetConfig,
    target_params: dict,
    draft_cfg,
    draft_params: dict,
    batch_sizes: Sequence[int],
    cache_length: int,
    *,
    widths: Sequence[int] | None = None,
    rounds: int = 16,
    warmup: int = 1,
    min_seconds: float = 0.05,
    repeats: int = 10,
    mesh=None,
    meta: dict | None = None,
    progress: Callable[[int, int, float], None] | None = None,
):
    """Round table (``tables.RoundTable``) of the decode program for ``batch_sizes`` slot counts
    at widths ``shapes.verify_widths(G, widths)``, from a cache of ``cache_length`` positions.

    ``progress(B, w, rps)`` is called per (B, w) after the last pass. InputError on bad sizes or
    a cache that does not fit."""
    from dspark_jax.decode import programs
    from dspark_jax.decode.state import DecodeStatic
    from dspark_jax.decode.tables import RoundTable

    ws, sizes, max_len = _round_sizes(target_cfg, draft_cfg, batch_sizes, cache_length, widths,
                                      rounds, warmup, repeats)
    if mesh is not None:
        sharded.check_mesh(mesh, target_cfg, draft_cfg, 1)
    prog = programs.build_decode(mesh, sharded.decode_rules(target_cfg))
    tp, dp = prog.place_params(target_params, target_cfg), prog.place_params(draft_params, draft_cfg)
    static = DecodeStatic(target_cfg, draft_cfg, ForcedLength(), True, rounds, widths=ws)
    steps = _round_steps(prog, tp, dp, static, target_cfg, draft_cfg, mesh, cache_length, rounds, max_len)
    lat, raw = _time_rounds(sizes, ws, *steps, rounds, warmup, repeats, min_seconds)
    rps = [[float(1.0 / v) for v in row] for row in lat]
    if progress is not None:
        for b, row in zip(sizes, rps):
            for w, r in zip(ws, row):
                progress(b, w, r)
    info = _table_meta(target_cfg, cache_length, "rounds", runtime.compute_dtype(target_params),
                       meta, rounds=rounds, warmup=warmup, min_seconds=min_seconds, repeats=repeats)
    info.update(block_size=draft_cfg.block_size, program="programs.build_decode().spec.chunk",
                raw_rps=[[float(1.0 / v) for v in row] for row in raw])
    return RoundTable(tuple(sizes), ws, tuple(tuple(row) for row in rps), info)
