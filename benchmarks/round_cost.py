"""Where a speculative round's time goes: the round, the AR step and the round's parts, timed apart.

    PYTHONPATH=$PWD nice -n 15 python benchmarks/round_cost.py [--sizes tiny,mid,large]
        [--batch-sizes 1 8 32] [--repeats 7] [--out DIR] [--smoke]

For each target size and batch size B this compiles (once, ahead of time) and times:

- ``ar_step``: the shipped autoregressive step (one target token per row);
- ``round``: the shipped speculative round (draft block, Markov scan, confidence, policy,
  target verification of G+1 tokens, rejection sampling, commits), state donated;
- its parts, each its own jitted program built from the public component APIs:
  ``draft_backbone`` (block embedding + draft layers), ``draft_lm_head`` (base logits
  [B, G, V]), ``markov_scan`` (sequential Markov bias + sampling, ``lax.scan``),
  ``confidence`` (head + sigmoid + policy lengths), ``target_verify`` (target extend over
  G+1 tokens + LM head, cache donated), ``rejection`` (``verify.rejection_sample``),
  ``commit`` (token / position / record scatters, context projection and the draft
  context cache scatter);
- ``dispatch``: an empty jitted program (the per-call floor every part pays once).

Sizes: ``tiny`` is the test fixture (hidden 64, 6 layers, vocab 512, drafter 2 layers);
``mid`` a random Qwen3 target of hidden 1024, 8 layers, vocab 32000 (162M parameters) with
a 1-layer block-7 drafter; ``large`` hidden 2048, 10 layers, vocab 32000 (634M, ~3.9x mid).

Timing: every program is compiled and warmed up first; then ``--repeats`` passes go
round-robin over all programs of one (size, B), each pass timing a chunk of calls of at
least ``--min-seconds``; the reported time per call is the median over passes (a noisy,
shared machine slows single chunks down; interleaving spreads that over all programs).
Compile counts: total, and during the timed passes (must be 0).
Each program's XLA op count is the number of HLO instructions in ``compiled.as_text()``
(``hlo_ops``: all, fusion bodies included; ``hlo_top``: instructions outside fusion bodies,
about the number of kernels/loops the backend runs).

``--compile-only --hardware CHIP:GRID`` times nothing: it compiles the shipped AR step and
round for compile-only TPU / GPU devices and prints that compiler's memory, largest values and
flops / bytes (``compile_only``), marking each copy of a whole cache, of one layer's cache and of
one layer's weight among the largest values (``copies``); the target's weights as ``generate``
places them (per-layer buffers on GPUs, stacked elsewhere), or ``--per-layer`` / ``--stacked``.

Writes ``round_cost.json`` (and ``round_cost.png``, a stacked bar of the parts per
(size, B) in units of one AR step) to ``--out``; prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_jax.config import DraftConfig, TargetConfig  # noqa: E402
from dspark_jax import runtime, sampling  # noqa: E402
from dspark_jax.decode.policies import FullPolicy  # noqa: E402
from dspark_jax.decode.verify import rejection_sample  # noqa: E402
from dspark_jax.draft import backbone, confidence, markov  # noqa: E402
from dspark_jax.draft import decode as draft_decode  # noqa: E402
from dspark_jax.draft import model as draft_model  # noqa: E402
from dspark_jax.target import qwen3  # noqa: E402
from dspark_jax.costs.compiles import COMPILES

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/dspark_qwen3_tiny"
PARTS = ("draft_backbone", "draft_lm_head", "markov_scan", "confidence", "target_verify",
         "rejection", "commit")
# --------------------------------------------------------------------------- models

SIZES = {
    # name: (TargetConfig kwargs, DraftConfig kwargs); "tiny" loads the test fixture instead.
    "mid": (dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=64, rope_theta=1e6,
                 max_position_embeddings=4096),
            dict(num_hidden_layers=1, block_size=7, target_layer_ids=(1, 4, 6), mask_token_id=31999,
                 num_anchors=64, markov_rank=256)),
    "large": (dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=10,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                   max_position_embeddings=4096),
              dict(num_hidden_layers=1, block_size=7, target_layer_ids=(1, 5, 8), mask_token_id=31999,
                   num_anchors=64, markov_rank=256)),
}


def random_like(tree, seed: int, dtype=np.float32) -> dict:
    """numpy init of an abstract params tree (norms 1, biases 0, rest N(0, 0.02^2)); no XLA compile."""
    rng = np.random.default_rng(seed)

    def leaf(path, a):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            x = np.ones(a.shape, np.float32)
        elif "bias" in name:
            x = np.zeros(a.shape, np.float32)
        else:
            x = rng.standard_normal(a.shape, dtype=np.float32) * np.float32(0.02)
        return jnp.asarray(x, dtype)
    return jax.tree_util.tree_map_with_path(leaf, tree)


def random_pair(tkw: dict, dkw: dict, dtype=jnp.float32, seed: int = 0):
    """(tcfg, tparams, dcfg, dparams): random target and drafter sharing embedding / LM head."""
    tcfg = TargetConfig(**tkw)
    dcfg = DraftConfig.for_target(tcfg, **dkw)
    key = jax.random.PRNGKey(0)  # eval_shape only: nothing runs
    tp = random_like(jax.eval_shape(lambda k: qwen3.init_params(tcfg, k), key), seed, dtype)
    dshape = jax.eval_shape(lambda k: draft_model.init_params(dcfg, k), key)
    dshape = {k: v for k, v in dshape.items() if k not in draft_model.FROZEN_KEYS}
    dp = random_like(dshape, seed + 1, dtype)
    dp["embed_tokens"], dp["lm_head"] = tp["embed_tokens"], qwen3.lm_head_kernel(tp)
    return tcfg, tp, dcfg, dp


def load_size(name: str):
    if name == "tiny":
        from dspark_jax.convert.checkpoint import load_draft, load_target
        tc, tp = load_target(FIXTURE / "target")
        dc, dp = load_draft(FIXTURE / "draft")
        return tc, tp, dc, dp
    if name not in SIZES:
        raise SystemExit(f"unknown size {name!r}; choose from tiny,{','.join(SIZES)}")
    return random_pair(*SIZES[name])


def param_count(tree) -> int:
    return int(sum(np.prod(a.shape) for a in jax.tree.leaves(tree)))


# --------------------------------------------------------------------------- adapter


def decode_programs(tcfg, tparams, dcfg, dparams, batch: int, prompt_len: int, max_new: int,
                    temperature: float = 0.0, seed: int = 0, abstract: bool = False, spans=None):
    """ADAPTER -- the only code here that touches dspark_jax.decode internals.

    Builds the shipped programs for B = ``batch`` random prompts of ``prompt_len`` tokens:
    returns a dict with ``round`` / ``ar_step`` (jitted functions of the donated state,
    ``lower(state)`` gives their lowering), the prefilled ``spec_state`` / ``ar_state``, and
    ``max_len`` (cache capacity). ``abstract=True``: params may be ShapeDtypeStructs and the
    states are abstract too (``jax.eval_shape``; nothing runs, for lowering/cost analysis only).
    ``spans``: the compiled cache spans (default: the shipped ``shapes.default_spans``; ``(max_len,)``:
    attention over the whole capacity, the program before spans; ``"prompt"``: the default span a
    step at ``prompt_len`` reads, and the capacity: the same kernels run, fewer compile); the dict's
    ``spans`` / ``span`` are the compiled spans and the one the programs read at ``prompt_len``.
    Re-point this function when the decode internals move.
    """
    import functools
    from dspark_jax.decode import programs, shapes
    from dspark_jax.decode.state import DecodeStatic

    local = programs.build_decode()

    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, tcfg.vocab_size - 1, (batch, prompt_len)).tolist()
    p_len, max_len = shapes.plan_shapes(prompts, max_new, dcfg.block_size,
                                        min(tcfg.max_position_embeddings, dcfg.max_position_embeddings), None)
    if spans == "prompt":  # only the default span a step at prompt_len reads (+ the capacity)
        spans = (next(s for s in shapes.default_spans(max_len) if s >= prompt_len),)
    arr = jnp.asarray(prompts, jnp.int32)
    arr = jnp.pad(arr, ((0, 0), (0, p_len - prompt_len)))
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    valid = jnp.ones((batch,), bool)
    key = jax.random.PRNGKey(seed)
    temp = jnp.float32(max(float(temperature), sampling.GREEDY_EPS))
    stop = jnp.full((shapes.MAX_STOP_IDS,), -1, jnp.int32)
    conf_temps = jnp.ones((dcfg.block_size,), jnp.float32)
    policy = FullPolicy()
    static = DecodeStatic(tcfg, dcfg, policy, sampling.is_greedy(temperature), max_new,
                         spans=None if spans is None else tuple(spans))
    compiled = shapes.compiled_spans(static, max_len)
    span = next(s for s in compiled if s >= prompt_len)
    pre_static = dataclasses.replace(static, policy=None)
    call = ((lambda f, *a, **k: jax.eval_shape(functools.partial(f, **k), *a)) if abstract
            else (lambda f, *a, **k: f(*a, **k)))
    spec_state = call(local.spec.prefill, tparams, dparams, arr, lens, valid, key, temp, stop,
                      static=pre_static, max_len=max_len)
    spec_state = dataclasses.replace(spec_state, policy_state=policy.init_state(batch, dcfg.block_size))
    ar_static = DecodeStatic(tcfg, None, None, sampling.is_greedy(temperature), max_new,
                            spans=static.spans)
    ar_state = call(local.ar.prefill, tparams, None, arr, lens, valid, key, temp, stop, static=ar_static,
                    max_len=max_len)

    class _Prog:
        def __init__(self, jitted, args, kwargs):
            self.jitted, self.args, self.kwargs = jitted, args, kwargs

        def lower(self, state):
            return self.jitted.lower(*self.args[:-1], state, *self.args[-1], **self.kwargs)

    rnd = _Prog(local.spec.step, (tparams, dparams, (temp, stop, conf_temps)), {"static": static})
    ar = _Prog(local.ar.step, (tparams, None, (temp, stop, None)), {"static": ar_static})
    return {"round": rnd, "ar_step": ar, "spec_state": spec_state, "ar_state": ar_state,
            "max_len": max_len, "temperature": temp, "stop_ids": stop, "conf_temps": conf_temps,
            "spans": compiled, "span": span}


# --------------------------------------------------------------------------- parts


def make_parts(tcfg: TargetConfig, dcfg: DraftConfig, greedy: bool, span: int | None = None):
    """The round's parts as pure functions of public component APIs (shapes as in decode.step;
    attention over the first ``span`` cache slots, the span the shipped round reads there)."""
    g = dcfg.block_size

    def draft_backbone(dp, seq, pos, ctx_k, ctx_v):
        anchor = seq[jnp.arange(seq.shape[0]), pos]
        return draft_decode.block_hidden(dp, dcfg, anchor, pos, draft_decode.ContextCache(ctx_k, ctx_v),
                                         span), anchor

    def draft_lm_head(dp, hidden):
        return draft_model.compute_logits(dp, hidden)

    def markov_scan(dp, base, hidden, anchor, key, temperature):
        """``draft.decode.sample_block``'s scan on given base logits (greedy: tokens only, as in
        the shipped round, where the recomputed logits have no reader)."""
        b = anchor.shape[0]

        def step(carry, xs):
            prev, mstate = carry
            u_k, h_k, key_k = xs
            if dcfg.has_markov:
                bias, mstate = markov.step(dp["markov_head"], dcfg, mstate, prev, h_k)
                u_k = u_k + bias
            x_k = sampling.sample_logits(key_k, u_k, temperature, greedy)
            return (x_k, mstate), (x_k if greedy else (x_k, u_k))

        _, ys = jax.lax.scan(
            step, (anchor, markov.init_state(dcfg, (b,), jnp.float32)),
            (jnp.moveaxis(base, 1, 0), jnp.moveaxis(hidden, 1, 0), jax.random.split(key, g)))
        if greedy:
            return jnp.moveaxis(ys, 0, 1), base  # rejection_sample ignores draft logits when greedy
        return jnp.moveaxis(ys[0], 0, 1), jnp.moveaxis(ys[1], 0, 1)

    def conf_and_policy(dp, hidden, anchor, drafts, conf_temps):
        b = anchor.shape[0]
        if dcfg.enable_confidence_head:
            prev = jnp.concatenate([anchor[:, None], drafts[:, :-1]], axis=1)
            c_logits = confidence.logits(dp, dcfg, hidden, prev)
            conf = jax.nn.sigmoid(c_logits / conf_temps)
        else:
            c_logits = conf = jnp.ones((b, g), jnp.float32)
        lengths, _ = FullPolicy()((), conf, jnp.ones((b,), bool))
        return c_logits, jnp.clip(lengths.astype(jnp.int32), 0, g)

    def target_verify(tp, cache, tokens):
        hidden, taps, delta = qwen3.forward_pure(tp, tcfg, tokens, cache, taps=dcfg.target_layer_ids,
                                                 span=span)
        n_new = jnp.zeros_like(cache.lengths)  # commit nothing (the masked scatter still runs)
        return qwen3.compute_logits(tp, hidden), taps, cache.commit(delta, n_new)

    def rejection(key, target_logits, draft_logits, drafts, lengths, temperature, stop_ids):
        return rejection_sample(key, target_logits, draft_logits, drafts, lengths, temperature, greedy,
                                stop_ids)

    def commit(dp, seq, pos, active, ctx_k, ctx_v, rec, conf_rec, drafts, accepted, next_token, stopped,
               prop_len, conf_logits, taps):
        b, max_len = seq.shape
        rows = jnp.arange(b)
        k_idx = jnp.arange(g + 1, dtype=jnp.int32)[None, :]
        acc_len = jnp.where(stopped, accepted, accepted + 1)
        padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
        new_tokens = jnp.where(k_idx == accepted[:, None], next_token[:, None], padded)
        slots = jnp.where(active[:, None], pos[:, None] + 1 + k_idx, max_len)
        seq = seq.at[rows[:, None], slots].set(new_tokens, mode="drop")
        new_pos = jnp.where(active, pos + acc_len, pos)
        ctx = backbone.project_context(dp, dcfg, taps)
        ctx_pos = pos[:, None] + k_idx
        k_new, v_new = backbone.context_kv(dp, dcfg, ctx, ctx_pos)
        ctx_slots = jnp.where(active[:, None], ctx_pos, max_len)
        ctx_k = runtime.write_steps(ctx_k, k_new, ctx_slots)
        ctx_v = runtime.write_steps(ctx_v, v_new, ctx_slots)
        r = jnp.zeros((b,), jnp.int32)
        rec = rec.at[:, rows, r].set(jnp.stack([acc_len, prop_len, accepted]), mode="drop")
        conf_rec = conf_rec.at[rows, r].set(conf_logits, mode="drop")
        return seq, new_pos, ctx_k, ctx_v, rec, conf_rec

    return {"draft_backbone": draft_backbone, "draft_lm_head": draft_lm_head, "markov_scan": markov_scan,
            "confidence": conf_and_policy, "target_verify": target_verify, "rejection": rejection,
            "commit": commit}


# --------------------------------------------------------------------------- programs


def hlo_counts(compiled) -> tuple[int, int]:
    """(all HLO instructions, instructions outside fusion bodies) of a compiled program."""
    total = top = 0
    in_fused = False
    for line in compiled.as_text().splitlines():
        s = line.strip()
        if s.endswith("{") and ("->" in s or s.startswith("ENTRY")):
            name = s.split()[1] if s.startswith("ENTRY") else s.split()[0]
            in_fused = "fused" in name or "fusion" in name
            continue
        if re.match(r"^(ROOT\s+)?%?[\w.\-]+\s*=\s", s):
            total += 1
            top += 0 if in_fused else 1
    return total, top


class Program:
    """An AOT-compiled program and the way to call it repeatedly.

    ``step(args) -> args`` feeds outputs back (donated buffers) or returns the same args.
    """

    def __init__(self, name, compiled, args, feed=None):
        self.name, self.compiled, self.args, self.feed = name, compiled, args, feed
        self.hlo_ops, self.hlo_top = hlo_counts(compiled)
        self.out = None

    def call(self):
        out = self.compiled(*self.args)
        if self.feed is not None:
            self.args = self.feed(self.args, out)
        self.out = out
        return out


def build_programs(tcfg, tp, dcfg, dp, batch, prompt_len, max_new, temperature, spans=None):
    """All programs of one (size, B), compiled and called once (their outputs feed the next part).
    When the shipped programs read less than the capacity at ``prompt_len``, ``round@capacity`` /
    ``ar_step@capacity`` (one span: the whole cache, the program before spans) run beside them."""
    greedy = sampling.is_greedy(temperature)
    progs = {}
    a = decode_programs(tcfg, tp, dcfg, dp, batch, prompt_len, max_new, temperature, spans=spans)
    st = a["spec_state"]

    def aot(fn, args, donate=()):
        return jax.jit(fn, donate_argnums=donate).lower(*args).compile()

    c = jax.jit(lambda x: x + 1).lower(jnp.zeros((), jnp.int32)).compile()
    progs["dispatch"] = Program("dispatch", c, (jnp.zeros((), jnp.int32),))

    progs["ar_step"] = shipped_programs(a, ("ar_step",))["ar_step"]
    temp, stop = a["temperature"], a["stop_ids"]
    # Parts (from a copy of the prefilled state: the round donates its own).
    parts = make_parts(tcfg, dcfg, greedy, a["span"])
    seq, pos = jnp.array(st.seq), jnp.array(st.pos)
    ctx_k, ctx_v = jnp.array(st.ctx.k), jnp.array(st.ctx.v)
    cache = jax.tree.map(jnp.array, st.cache)
    key = jax.random.PRNGKey(1)

    def run(name, fn, args, donate=(), feed=None):
        p = Program(name, aot(fn, args, donate), args, feed)
        p.call()
        jax.block_until_ready(p.out)
        progs[name] = p
        return p.out

    hidden, anchor = run("draft_backbone", parts["draft_backbone"], (dp, seq, pos, ctx_k, ctx_v))
    base = run("draft_lm_head", parts["draft_lm_head"], (dp, hidden))
    drafts, dlogits = run("markov_scan", parts["markov_scan"], (dp, base, hidden, anchor, key, temp))
    c_logits, lengths = run("confidence", parts["confidence"], (dp, hidden, anchor, drafts, a["conf_temps"]))
    tokens = jnp.concatenate([anchor[:, None], drafts], axis=1)
    tlogits, taps, _ = run("target_verify", parts["target_verify"], (tp, cache, tokens), donate=(1,),
                           feed=lambda args, out: (args[0], out[2], args[2]))
    v = run("rejection", parts["rejection"], (key, tlogits, dlogits, drafts, lengths, temp, stop))
    b, r = batch, max_new
    rec = jnp.zeros((3, b, r), jnp.int32)
    conf_rec = jnp.zeros((b, r, dcfg.block_size), jnp.float32)
    active = jnp.ones((b,), bool)
    own = jnp.array  # commit donates its buffers: give it copies the other parts do not hold
    commit_args = (dp, own(seq), pos, active, own(ctx_k), own(ctx_v), rec, conf_rec, drafts, v.accepted, v.next_token,
                   v.stopped, v.proposal_length, c_logits, taps)

    def commit_feed(args, out):  # donated buffers come back; the position stays (same slots each call)
        return (args[0], out[0], args[2], args[3], out[2], out[3], out[4], out[5], *args[8:])
    run("commit", parts["commit"], commit_args, donate=(1, 4, 5, 6, 7), feed=commit_feed)

    progs["round"] = shipped_programs(a, ("round",))["round"]
    if a["span"] < a["max_len"]:
        full = decode_programs(tcfg, tp, dcfg, dp, batch, prompt_len, max_new, temperature,
                               spans=(a["max_len"],))
        for name, p in shipped_programs(full).items():
            progs[f"{name}@capacity"] = p
    return progs, a["max_len"], a["spans"], a["span"]


def _stay(state):
    """``feed`` for a donated decode state: the next call runs at the same positions, every row
    active (the cost of a step at ``prompt_len``, whatever the outputs; attention reads the same
    span every call). Fresh copies of the prefilled positions each call: they are donated."""
    pos = np.asarray(state.pos)
    lengths = np.asarray(state.cache.lengths)
    active = np.ones(pos.shape, bool)

    def feed(o):  # jax.device_put: no compile (jnp.asarray of a numpy array compiles a copy)
        extra = {"round": jax.device_put(np.int32(0))} if hasattr(o, "round") else {}
        return o.replace(pos=jax.device_put(pos), active=jax.device_put(active),
                         cache=o.cache.replace(lengths=jax.device_put(lengths)), **extra)
    return feed


def shipped_programs(a: dict, names=("ar_step", "round"), compiler_options=None) -> dict:
    """Compiled shipped AR step / round (from ``decode_programs``) as Programs that feed their
    donated state back at the same positions (``_stay``).
    ``compiler_options`` go to ``Lowered.compile`` (e.g. fast CPU compiles for smoke runs)."""
    out = {}
    if "ar_step" in names:
        tp, dp, extra = a["ar_step"].args  # dp, conf_temps: None (one signature for both modes)
        stay = _stay(a["ar_state"])
        out["ar_step"] = Program("ar_step", a["ar_step"].lower(a["ar_state"]).compile(compiler_options),
                                 (tp, dp, a["ar_state"], *extra),
                                 feed=lambda args, o: (args[0], args[1], stay(o), *args[3:]))
    if "round" in names:
        tp, dp, extra = a["round"].args
        stay = _stay(a["spec_state"])
        out["round"] = Program("round", a["round"].lower(a["spec_state"]).compile(compiler_options),
                               (tp, dp, a["spec_state"], *extra),
                               feed=lambda args, o: (args[0], args[1], stay(o), *args[3:]))
    return out


def time_programs(progs: dict, repeats: int, min_seconds: float, warmup: int = 2) -> dict:
    """Median seconds per call of each program over ``repeats`` interleaved passes."""
    iters = {}
    for name, p in progs.items():
        for _ in range(warmup):
            p.call()
        jax.block_until_ready(p.out)
        t0 = time.perf_counter()
        p.call()
        jax.block_until_ready(p.out)
        one = max(time.perf_counter() - t0, 1e-6)
        iters[name] = max(1, int(min_seconds / one))
    samples = {name: [] for name in progs}
    for _ in range(repeats):
        for name, p in progs.items():
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                p.call()
            jax.block_until_ready(p.out)
            samples[name].append((time.perf_counter() - t0) / iters[name])
    return {name: {"median_s": statistics.median(s), "min_s": min(s), "calls_per_pass": iters[name]}
            for name, s in samples.items()}


# --------------------------------------------------------------------------- report


def measure(size: str, batches, repeats, min_seconds, prompt_len, max_new, temperature,
            spans=None) -> list[dict]:
    tcfg, tp, dcfg, dp = load_size(size)
    rows = []
    for b in batches:
        before = COMPILES[0]
        t0 = time.perf_counter()
        progs, max_len, compiled_spans, span = build_programs(tcfg, tp, dcfg, dp, b, prompt_len, max_new,
                                                              temperature, spans)
        build_s = time.perf_counter() - t0
        compiles_build = COMPILES[0] - before
        before = COMPILES[0]
        times = time_programs(progs, repeats, min_seconds)
        compiles_timed = COMPILES[0] - before
        ar = times["ar_step"]["median_s"]
        rnd = times["round"]["median_s"]
        parts_sum = sum(times[p]["median_s"] for p in PARTS)
        row = {
            "size": size, "batch": b, "prompt_len": prompt_len, "cache_len": max_len,
            "spans": list(compiled_spans), "span": span,
            "block_size": dcfg.block_size, "draft_layers": dcfg.num_hidden_layers,
            "target_params": param_count(tp),
            "target": {"hidden": tcfg.hidden_size, "layers": tcfg.num_hidden_layers, "vocab": tcfg.vocab_size,
                       "intermediate": tcfg.intermediate_size},
            "seconds": {k: v["median_s"] for k, v in times.items()},
            "seconds_min": {k: v["min_s"] for k, v in times.items()},
            "calls_per_pass": {k: v["calls_per_pass"] for k, v in times.items()},
            "hlo_ops": {k: p.hlo_ops for k, p in progs.items()},
            "hlo_top": {k: p.hlo_top for k, p in progs.items()},
            "round_over_ar": rnd / ar,
            "capacity_over_span": ({k: times[f"{k}@capacity"]["median_s"] / times[k]["median_s"]
                                    for k in ("ar_step", "round")} if "round@capacity" in times else None),
            "parts_sum_s": parts_sum,
            "non_target_share_of_parts": 1.0 - times["target_verify"]["median_s"] / parts_sum,
            "verify_over_ar": times["target_verify"]["median_s"] / ar,
            "build_seconds": build_s, "compiles_build": compiles_build, "compiles_timed": compiles_timed,
        }
        rows.append(row)
        print_row(row)
        del progs
    return rows


COLS = ("ar_step", "round", "target_verify", "draft_backbone", "draft_lm_head", "markov_scan", "confidence",
        "rejection", "commit", "dispatch", "ar_step@capacity", "round@capacity")
HEADER = (f"{'size':<6}{'B':>4}" + "".join(f"{c[:9]:>10}" for c in COLS) + f"{'rnd/AR':>7}{'ops rnd/AR':>12}"
          f"{'compiles':>10}   (ms per call, medians)")


def print_row(r: dict) -> None:
    cells = "".join(f"{r['seconds'][c] * 1e3:>10.4g}" if c in r["seconds"] else f"{'-':>10}" for c in COLS)
    print(f"{r['size']:<6}{r['batch']:>4}{cells}{r['round_over_ar']:>7.2f}"
          f"{r['hlo_ops']['round']:>6}/{r['hlo_ops']['ar_step']:<5}"
          f"{r['compiles_build']:>5}/{r['compiles_timed']:<4}", flush=True)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['size']}\nB={r['batch']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 5))
    bottom = np.zeros(len(rows))
    for part in PARTS:
        h = np.array([r["seconds"][part] / r["seconds"]["ar_step"] for r in rows])
        ax.bar(x - 0.2, h, 0.4, bottom=bottom, label=part)
        bottom += h
    ax.bar(x + 0.2, [r["round_over_ar"] for r in rows], 0.4, color="black", alpha=0.6,
           label="shipped round")
    ax.axhline(1.0, color="red", lw=1, ls="--", label="1 AR step")
    ax.set_xticks(x)
    ax.set_xticklabels(labels)
    ax.set_ylabel("time / AR step")
    ax.set_title("Speculative round: parts (left, timed apart) vs the shipped round (right)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)
    return True


def _dims_key(dims) -> tuple:
    """A shape as the sorted tuple of its dims other than 1: the same for every layout of it."""
    return tuple(sorted(int(d) for d in dims if int(d) != 1))


def watched_shapes(tcfg, dcfg, batch: int, cache_len: int, mesh=None) -> dict:
    """What a decode program should never copy: ``{"cache": keys, "cache_layer": keys, "weight":
    keys}`` (``_dims_key``) of the target cache's position-indexed leaves and the drafter's
    context cache (whole; one layer's), and of one layer's slice of every stacked target /
    drafter weight. ``mesh``: one device's shard of each (placed by the decode rules)."""
    from dspark_jax import families, sharding
    from dspark_jax.decode import sharded

    rules = sharded.decode_rules(tcfg)

    def shard(shape, axes):
        if mesh is None:
            return tuple(shape)
        spec = sharding.logical_to_spec(axes, rules, shape, mesh)
        return jax.sharding.NamedSharding(mesh, spec).shard_shape(tuple(shape))

    def per_layer(shape, axes):
        return _dims_key(d for d, a in zip(shard(shape, axes), axes) if a != "layers")

    cache = jax.eval_shape(lambda: families.target_runtime(tcfg).init_cache(tcfg, batch, cache_len, jnp.bfloat16))
    leaves = [(leaf.shape, axes) for leaf, axes in zip(
        jax.tree.leaves(cache), jax.tree.leaves(cache.axes(), is_leaf=lambda a: isinstance(a, tuple)))]
    leaves.append(((dcfg.num_hidden_layers, batch, dcfg.num_key_value_heads, cache_len, dcfg.head_dim),
                   draft_decode.CONTEXT_AXES))
    keys = {"cache": set(), "cache_layer": set(), "weight": set()}
    for shape, axes in leaves:
        if runtime.STEP in axes:
            keys["cache"].add(_dims_key(shard(shape, axes)))
            if "layers" in axes:
                keys["cache_layer"].add(per_layer(shape, axes))
    for cfg in (tcfg, dcfg):
        by_input = {}  # kernels reading the same input: XLA:GPU's dot merger concatenates them
        for spec in families.declare(cfg).values():
            if spec.axes and spec.axes[0] == "layers" and len(spec.shape) > 2:
                keys["weight"].add(per_layer(spec.shape, spec.axes))
                if len(spec.shape) == 3:
                    d_in, d_out = shard(spec.shape, spec.axes)[1:]
                    by_input.setdefault(d_in, []).append(d_out)
        for d_in, outs in by_input.items():
            for n in range(2, len(outs) + 1):
                for group in itertools.combinations(outs, n):
                    keys["weight"].add(_dims_key((d_in, sum(group))))
    return keys


def copies(values: list[dict], watch: dict) -> dict:
    """Mark each of ``values`` (``plan.largest_values``) that holds a whole cache (``copy_of=
    "cache"``), one layer's cache (``"cache_layer"``) or one layer's weight (``"weight"``) in
    another buffer -- in-place updates (scatters, dynamic-update-slices) excepted -- and total
    them: {kind: {count, bytes}}."""
    out = {kind: {"count": 0, "bytes": 0} for kind in watch}
    for v in values:
        if "scatter" in v["name"] or "dynamic-update" in v["op"] or "dynamic_update" in v["name"]:
            continue
        key = _dims_key(re.findall(r"[0-9]+", v["shape"].split("[", 1)[1]))
        for kind in watch:
            if key in watch[kind]:
                v["copy_of"] = kind
                out[kind]["count"] += 1
                out[kind]["bytes"] += v["bytes"]
                break
    return out


def compile_only(sizes, batches, hw_spec: str, cache_len: int, unrolled: bool, per_layer: bool | None = None) -> list[dict]:
    """The shipped round and AR step compiled (not run) for ``hw_spec``'s compile-only devices
    (mesh ``tensor=N``), attention over the whole ``cache_len`` cache: per-device memory from
    that compiler (arguments, temporaries, peak, fits), the largest values it materialises,
    flops / bytes from its cost analysis (``unrolled``: every loop unrolled, so per step; else a
    loop's body counted once). Sizes: ``presets.TARGETS`` names (released DSpark drafter) or
    tiny / mid / large. ``per_layer``: the target's weights as per-layer buffers (True,
    ``--per-layer``), stacked (False, ``--stacked``) or as the decode places them (None)."""
    from dspark_jax import families, presets, sharding
    from dspark_jax.costs import hardware
    from dspark_jax import params as params_lib
    from dspark_jax.errors import InputError
    from dspark_jax.pipelines import plan as plan_lib

    try:
        hw = hardware.parse(hw_spec)
        devices = hardware.compile_devices(hw)
    except InputError as e:
        raise SystemExit(f"round_cost.py: {e}")
    mesh = sharding.make_mesh(f"tensor={len(devices)}", devices)
    rows = []
    for size in sizes:
        if size in presets.TARGETS:
            tcfg, dcfg = presets.resolve_target(size), presets.released_drafter(size, kind="dspark")
        elif size == "tiny":
            from dspark_jax.convert.checkpoint import load_draft, load_target
            tcfg, dcfg = load_target(FIXTURE / "target")[0], load_draft(FIXTURE / "draft")[0]
        elif size in SIZES:
            tcfg = TargetConfig(**SIZES[size][0])
            dcfg = DraftConfig.for_target(tcfg, **SIZES[size][1])
        else:
            raise SystemExit(f"unknown size {size!r}; a preset ({', '.join(presets.TARGETS)}) or tiny,mid,large")
        for b in batches:
            row = {"size": size, "batch": b, "hardware": hw.spec, "cache_len": cache_len, "unrolled": unrolled,
                   "per_layer": per_layer if per_layer is not None else bool(
                       families.target_runtime(tcfg).per_layer and hw.chip.platform in params_lib.PER_LAYER_PLATFORMS)}
            watch = watched_shapes(tcfg, dcfg, b, cache_len, mesh)
            for name, draft in (("ar_step", None), ("round", dcfg)):
                ctx = hardware.unrolled_loops() if unrolled else contextlib.nullcontext()
                cpu0 = time.process_time()
                with ctx:
                    plan, sizes_ = plan_lib.plan_decode_round(draft, tcfg, mesh, batch=b, max_len=cache_len,
                                                              spans=(cache_len,), per_layer=per_layer)
                row[name] = dict(plan.to_json(), **sizes_, fits=hardware.fits(plan.peak_bytes, hw.chip),
                                 projected=hardware.project(plan.flops, plan.bytes_accessed, hw.chip),
                                 cpu_seconds=time.process_time() - cpu0,  # trace + lower + compile
                                 step_projected=plan_lib.projected(plan, hw.chip))
                p = row[name]
                print(f"{size} B={b} {name:<8} on {hw.spec}: args {p['argument_bytes'] / 2**30:.2f} GiB, "
                      f"temporaries {p['temp_bytes'] / 2**30:.2f} GiB, peak {p['peak_bytes'] / 2**30:.2f} GiB "
                      f"({'fits' if p['fits'] else 'DOES NOT FIT'}), {p['flops'] / 1e9:.1f} GFLOP, "
                      f"{p['bytes_accessed'] / 1e9:.2f} GB accessed{'' if unrolled else ' (loop bodies once)'}, "
                      f"projected {p['projected']['seconds'] * 1e3:.3f} ms, compiled in {p['compile_seconds']:.0f} s "
                      f"({p['cpu_seconds']:.0f} CPU s); "
                      f"per step (loops x trips, hlo_cost): {p['step_flops'] / 1e9:.1f} GFLOP, "
                      f"{p['step_bytes'] / 1e9:.2f} GB, {p['step_projected']['seconds'] * 1e3:.3f} ms", flush=True)
                p["copies"] = copies(p["largest"], watch)
                print("    copies among the 32 largest values: " + ", ".join(
                    f"{kind} {c['count']} ({c['bytes'] / 2**20:.0f} MiB)" for kind, c in p["copies"].items()))
                for v in p["largest"][:6]:
                    print(f"    {v['bytes'] / 2**20:9.1f} MiB  {v['shape']:<28} {v['op']:<16} {v['name']}"
                          f"{'  <- ' + v['copy_of'] if v.get('copy_of') else ''}")
            row["round_over_ar"] = row["round"]["projected"]["seconds"] / row["ar_step"]["projected"]["seconds"]
            row["step_round_over_ar"] = (row["round"]["step_projected"]["seconds"]
                                         / row["ar_step"]["step_projected"]["seconds"])
            print(f"{size} B={b} round/AR per step (loops x trips): {row['step_round_over_ar']:.2f}", flush=True)
            rows.append(row)
    return rows


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,mid", help="comma list of tiny,mid,large")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--min-seconds", type=float, default=0.2, help="per timed chunk")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256, help="sets the cache capacity")
    ap.add_argument("--cache-spans", type=int, nargs="+", default=None, metavar="S",
                    help="compiled cache spans of the shipped programs (default: shapes.default_spans of "
                         "the capacity); when the span read at --prompt-len is below the capacity, "
                         "round@capacity / ar_step@capacity (attention over the whole cache) run beside")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default=None, help="folder for round_cost.json / round_cost.png")
    ap.add_argument("--smoke", action="store_true", help="tiny fixture, B=1,2, few repeats (seconds)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile the round and AR step for --hardware (no timing): memory, largest values, "
                         "flops / bytes from that compiler; --sizes may name presets (Qwen/Qwen3-8B)")
    ap.add_argument("--hardware", default="h200:1", metavar="CHIP:GRID",
                    help="compile-only target of --compile-only (default h200:1; tpu-v5e:2x4, ...)")
    ap.add_argument("--cache-len", type=int, default=4096, help="--compile-only: cache capacity (default 4096)")
    ap.add_argument("--unrolled", action="store_true",
                    help="--compile-only: unroll every loop (flops / bytes per step, slower compiles)")
    layers = ap.add_mutually_exclusive_group()
    layers.add_argument("--per-layer", dest="per_layer", action="store_const", const=True, default=None,
                        help="--compile-only: the target's layer weights as separate per-layer buffers "
                             "(params.unstack_layers; an unrolled layer loop), whatever the platform")
    layers.add_argument("--stacked", dest="per_layer", action="store_const", const=False,
                        help="--compile-only: the target's layer weights stacked (a lax.scan over layers), "
                             "whatever the platform (default: as generate places them: per-layer on GPUs)")
    args = ap.parse_args(argv)
    if args.compile_only:
        sizes = args.sizes.split(",") if not args.smoke else ["tiny"]
        rows = compile_only(sizes, args.batch_sizes if not args.smoke else [1], args.hardware,
                            args.cache_len if not args.smoke else 128, args.unrolled, args.per_layer)
        if args.out:
            write_json(Path(args.out) / "round_cost_compiled.json",
                       {"benchmark": "round_cost --compile-only", "jax": jax.__version__, "rows": rows,
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        return 0
    if args.smoke:
        args.sizes, args.batch_sizes, args.repeats, args.min_seconds = "tiny", [1, 2], 2, 0.01
        args.prompt_len, args.max_new_tokens = 16, 32
    print(HEADER, flush=True)
    rows = []
    for size in args.sizes.split(","):
        rows += measure(size, args.batch_sizes, args.repeats, args.min_seconds, args.prompt_len,
                        args.max_new_tokens, args.temperature, args.cache_spans)
    report = {
        "benchmark": "round_cost",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0]), "backend": jax.default_backend(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "jax": jax.__version__, "temperature": args.temperature,
        "repeats": args.repeats, "min_seconds": args.min_seconds, "parts": list(PARTS),
        "total_compiles": COMPILES[0], "compiles_timed": sum(r["compiles_timed"] for r in rows),
        "rows": rows,
    }
    if args.out:
        out = Path(args.out)
        write_json(out / "round_cost.json", report)
        if plot(rows, out / "round_cost.png"):
            print(f"wrote {out / 'round_cost.json'} and {out / 'round_cost.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
