"""Requests in, results out: input validation (before anything compiles) and ``Result``s.

Every check raises ``InputError`` / ``ConfigError`` naming the offending field, before a
program is traced; the host-side result builders turn a finished row of a decode state (its
``host_view``) into one request's ``Result``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import sampling
from dspark_jax.decode.shapes import MAX_STOP_IDS
from dspark_jax.errors import CheckpointError, InputError, require_positive_int


@dataclasses.dataclass
class Result:
    """One request's output. ``confidence_logits``: per round [G] raw logits (None without a head)."""

    output_ids: list[int]
    acceptance_lengths: list[int]
    proposal_lengths: list[int]
    accepted_drafts: list[int]
    confidence_logits: list[list[float]] | None
    prompt_length: int
    batch_index: int
    batch_seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class StreamResult(Result):
    """A request's Result plus its latency: ``queued_s`` (wait for a slot), ``ttft_s`` (from
    arrival (t=0 of the stream) to its first token), ``latency_s`` (arrival to last token),
    ``tokens_per_second`` (its tokens / (finish - slot start)), ``slot``. ``batch_index`` is 0
    and ``batch_seconds`` the stream's wall time (so ``summarize`` gives the stream throughput)."""

    slot: int = -1
    queued_s: float = 0.0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    tokens_per_second: float = 0.0


def validate_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """Check prompts are non-empty lists of in-vocabulary ints; returns list[list[int]]."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise InputError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        p = list(np.asarray(p).reshape(-1).tolist()) if not isinstance(p, list) else p
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty")
        for j, t in enumerate(p):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise InputError(f"prompt {i}: token {j} is {t!r}, not an int")
            if not 0 <= int(t) < vocab_size:
                raise InputError(f"prompt {i}: token id {int(t)} at index {j} is outside the "
                                 f"vocabulary [0, {vocab_size})")
        out.append([int(t) for t in p])
    return out


def validate_common(tcfg, prompts, max_new_tokens, temperature, batch_size, stop_token_ids):
    prompts = validate_prompts(prompts, tcfg.vocab_size)
    require_positive_int(max_new_tokens, "max_new_tokens")
    require_positive_int(batch_size, "batch_size")
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        raise InputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    stops = list(stop_token_ids or [])
    if len(stops) > MAX_STOP_IDS:
        raise InputError(f"at most {MAX_STOP_IDS} stop token ids are supported, got {len(stops)}")
    for t in stops:
        if not 0 <= int(t) < tcfg.vocab_size:
            raise InputError(f"stop token id {t} is outside the vocabulary [0, {tcfg.vocab_size})")
    stop_arr = jnp.asarray(stops + [-1] * (MAX_STOP_IDS - len(stops)), jnp.int32)
    return prompts, stop_arr, stops


def confidence_temperatures(temperatures, block_size: int) -> jax.Array:
    """[G] float32 STS temperatures (ones when None); InputError unless G positive numbers."""
    if temperatures is None:
        return jnp.ones((block_size,), jnp.float32)
    temps = [float(t) for t in temperatures]
    if len(temps) != block_size or not all(t > 0 and math.isfinite(t) for t in temps):
        raise InputError(f"confidence_temperatures must be {block_size} positive numbers (one per "
                         f"block position), got {list(temperatures)}")
    return jnp.asarray(temps, jnp.float32)


def per_request_budgets(max_new_tokens, n: int) -> list[int]:
    """One output budget per request from an int or a sequence of n ints; InputError otherwise."""
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        vals = list(max_new_tokens)
        if len(vals) != n:
            raise InputError(f"max_new_tokens: {len(vals)} values for {n} prompts")
        for i, v in enumerate(vals):
            require_positive_int(v, f"max_new_tokens[{i}]")
        return [int(v) for v in vals]
    require_positive_int(max_new_tokens, "max_new_tokens")
    return [int(max_new_tokens)] * n


def spans_arg(spans) -> tuple[int, ...] | None:
    """A user's ``cache_spans`` as a tuple of positive ints (None stays None); InputError else."""
    if spans is None:
        return None
    try:
        out = tuple(int(x) for x in spans)
    except (TypeError, ValueError):
        raise InputError(f"cache_spans must be a list of positive integers, got {spans!r}") from None
    if not out or min(out) < 1 or any(isinstance(x, bool) or int(x) != x for x in spans):
        raise InputError(f"cache_spans must be a list of positive integers, got {spans!r}")
    return out


def trim(tokens: list[int], max_new: int, stops: list[int]) -> list[int]:
    """A request's new tokens cut at ``max_new`` and after the first stop; a
    ``sampling.NONFINITE`` among them (the target's logits were NaN/Inf) is a CheckpointError."""
    tokens = tokens[:max_new]
    for i, t in enumerate(tokens):
        if t == sampling.NONFINITE:
            raise CheckpointError(f"the target's logits are not finite (NaN/Inf) at new token {i} of a "
                                  "request: its weights (or --dtype) are broken")
        if t in stops:
            return tokens[:i + 1]
    return tokens


def validate_stream(n: int, order, request_keys, top_p: float, speculative: bool):
    """(order, request keys uint32 [N, 2] or None, top_p) of a continuous run of ``n`` prompts;
    InputError unless ``order`` is a permutation, the keys are N PRNG keys and top_p in (0, 1]
    (< 1 only without a drafter)."""
    order = list(range(n)) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(n)):
        raise InputError("order must be a permutation of the prompt indices")
    if request_keys is not None:
        request_keys = np.asarray(request_keys)
        if request_keys.shape != (n, 2) or not np.issubdtype(request_keys.dtype, np.integer):
            raise InputError(f"request_keys must be {n} PRNG keys (uint32 [N, 2]), got "
                             f"shape {request_keys.shape}")
        request_keys = request_keys.astype(np.uint32)
    top_p = float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")
    if speculative and top_p < 1.0:
        raise InputError("top_p < 1 is supported for autoregressive decoding only (speculative "
                         "verification against a nucleus-filtered target is not implemented); "
                         "decode without a drafter or use top_p = 1")
    return order, request_keys, top_p


def speculative_result(host, row: int, start: int, budget: int, stops, with_conf: bool,
                       cls=Result) -> Result:
    """Row ``row`` of a speculative state's ``host_view`` as a ``cls`` (Result or StreamResult)
    for a prompt of length ``start``; batch fields zero (the driver sets them)."""
    n = int(host["rounds"][row])
    acc = [int(x) for x in host["acc"][row, :n]]
    out = trim([int(t) for t in host["seq"][row, start:start + 1 + sum(acc)]], budget, stops)
    conf = [[float(c) for c in r] for r in host["conf"][row, :n]] if with_conf else None
    return cls(out, acc, [int(x) for x in host["prop"][row, :n]],
               [int(x) for x in host["drafts"][row, :n]], conf, start, 0, 0.0)


def autoregressive_result(host, row: int, start: int, budget: int, stops, with_conf: bool = False,
                          cls=Result) -> Result:
    """Row ``row`` of an autoregressive state's ``host_view``: one "round" per generated token
    after the first (acceptance length 1, proposal length 0), so ``summarize`` reads both."""
    out = trim([int(t) for t in host["seq"][row, start:int(host["pos"][row]) + 1]], budget, stops)
    n = max(len(out) - 1, 0)
    return cls(out, [1] * n, [0] * n, [0] * n, None, start, 0, 0.0)
