"""Hardware-aware prefix scheduler (paper Algorithm 1 and section 5.2): the verification policies.

Given per-request confidences ``c [R, G]`` (calibrated probabilities that draft
position k survives given that positions < k did) and a profiled steps-per-second
curve ``SPS(B)`` (B = verification tokens in one target forward), choose per-request
verification lengths ``l_r`` in ``[0, G]`` that maximise the expected token throughput
``Theta = tau * SPS(B)`` with ``B = sum_r (1 + l_r)`` and ``tau = sum_r (1 + sum_{j<=l_r} a_rj)``,
``a_rj = prod_{i<=j} c_ri`` (prefix survival).

Two verification policies (the ``VerifyPolicy`` protocol of ``decode/policies.py``:
hashable, pure, ``init_state(batch, block) -> state``,
``__call__(state, confidences [B, G], active [B]) -> (lengths [B] int32, state)``):

- :class:`PrefixScheduler` (``--verify scheduler``): Algorithm 1. Candidates (r, j) are
  visited in descending survival; each admission must strictly raise Theta, otherwise the
  search stops at once. The early stop makes the admission of x_rk depend only on
  quantities known before x_rk was sampled (a_rj for j <= k and other rows), which is what
  keeps speculative decoding lossless (paper Appendix A).
- :class:`AsyncPrefixScheduler` (``--verify scheduler-async``): section 5.2. The capacity K
  (extra verification tokens) comes from an *unconstrained* search (global argmax of Theta,
  no early stop) over the confidences of ``delay`` rounds ago; the current round admits the
  top-K candidates by current survival. K cannot depend on the current tokens, and top-K by
  survival never ranks (r, k+1) above (r, k), so it stays lossless. The first ``delay`` rounds
  (no history yet) use Algorithm 1. ``delay=0`` is the *retrospective* same-round global
  search of Appendix A: NOT lossless, provided only to demonstrate the counterexample.

Under a round table (``tables.RoundTable``) :class:`PrefixScheduler` picks the round's width
instead (``widths``: the stopping rule over depth). The speed tables and their fits live in
``tables``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decode.tables import RoundTable, SPSTable, load_table
from dspark_jax.decode.widths import schedule_widths
from dspark_jax.errors import ConfigError


# ----------------------------------------------------------------------------- core search


def survival(confidences: jax.Array) -> jax.Array:
    """Prefix survival ``a [.., G] = cumprod(clip(c, 0, 1))`` (non-increasing along G)."""
    return jnp.cumprod(jnp.clip(confidences.astype(jnp.float32), 0.0, 1.0), axis=-1)


def greedy_path(confidences: jax.Array, active: jax.Array, sps_dense: jax.Array):
    """The admission path of Algorithm 1, vectorised.

    confidences [B, G], active [B] bool, sps_dense [>= B*(G+1)+1] (token count -> SPS).
    Returns ``(rank [B, G] int32, valid [N] bool, theta [N+1] float32)`` with N = B*G:
    ``rank`` = position of candidate (r, j) in the descending-survival order (ties keep
    (r, j) row-major order, so (r, j) always precedes (r, j+1)); ``valid[n]`` = the n-th
    sorted candidate is real (active row, survival > 0; valid ones come first);
    ``theta[n]`` = expected throughput after admitting the first n sorted candidates
    (``theta[0] = R * SPS(R)``; -inf past the valid ones).
    """
    b, g = confidences.shape
    a = survival(confidences)
    ok = active.astype(bool)[:, None] & (a > 0)
    key = jnp.where(ok, a, -1.0).reshape(-1)
    order = jnp.argsort(-key, stable=True)
    sorted_a = key[order]
    valid = sorted_a > 0
    r = jnp.sum(active.astype(jnp.int32))
    rf = r.astype(jnp.float32)
    tau = rf + jnp.cumsum(jnp.where(valid, sorted_a, 0.0))
    tokens = r + jnp.arange(1, b * g + 1, dtype=jnp.int32)
    theta = jnp.where(valid, tau * sps_dense[tokens], -jnp.inf)
    theta = jnp.concatenate([(rf * sps_dense[r])[None], theta])
    rank = jnp.zeros((b * g,), jnp.int32).at[order].set(jnp.arange(b * g, dtype=jnp.int32))
    return rank.reshape(b, g), valid, theta


def count_early_stop(valid: jax.Array, theta: jax.Array) -> jax.Array:
    """Admissions of Algorithm 1: the leading run of strict improvements (scalar int32)."""
    improve = valid & (theta[1:] > theta[:-1])
    return jnp.sum(jnp.cumprod(improve.astype(jnp.int32)))


def count_unconstrained(valid: jax.Array, theta: jax.Array) -> jax.Array:
    """Admissions of the unconstrained search: the smallest n maximising theta[n] (scalar int32)."""
    del valid  # theta is already -inf past the valid candidates
    return jnp.argmax(theta).astype(jnp.int32)


def lengths_from_rank(rank: jax.Array, count: jax.Array) -> jax.Array:
    """Admit the ``count`` best-ranked candidates; ``l_r`` = admitted positions of row r ([B] int32)."""
    return jnp.sum((rank < count).astype(jnp.int32), axis=-1)


def schedule(confidences, active, sps: SPSTable, mode: str = "early_stop") -> jax.Array:
    """Per-row verification lengths [B] int32 for one round (jittable; ``sps`` static).

    mode ``"early_stop"``: Algorithm 1 (lossless). ``"unconstrained"``: global argmax of
    Theta along the same path without the break (the retrospective search of Appendix A
    when applied to the current round's confidences: NOT lossless).
    """
    b, g = confidences.shape
    dense = jnp.asarray(sps.dense(b * (g + 1) + 1))
    rank, valid, theta = greedy_path(confidences, active, dense)
    if mode == "early_stop":
        count = count_early_stop(valid, theta)
    elif mode == "unconstrained":
        count = count_unconstrained(valid, theta)
    else:
        raise ConfigError(f"schedule mode must be 'early_stop' or 'unconstrained', got {mode!r}")
    return jnp.where(active.astype(bool), lengths_from_rank(rank, count), 0).astype(jnp.int32)


def expected_throughput(confidences, active, lengths, sps: SPSTable) -> np.ndarray:
    """Theta = tau * SPS(B) for given lengths (numpy, for tests and benchmarks). Shapes [B, G], [B], [B]."""
    c = np.clip(np.asarray(confidences, np.float64), 0, 1)
    a = np.cumprod(c, axis=-1)
    act = np.asarray(active, bool)
    lengths = np.asarray(lengths)
    mask = np.arange(c.shape[-1])[None, :] < lengths[:, None]
    tau = np.sum(act) + np.sum(np.where(mask & act[:, None], a, 0.0))
    tokens = np.sum(act) + np.sum(np.where(act, lengths, 0))
    return tau * sps(max(tokens, 1)) if np.sum(act) else np.float64(0.0)


# ----------------------------------------------------------------------------- policies


@dataclasses.dataclass(frozen=True)
class PrefixScheduler:
    """``--verify scheduler``: paper Algorithm 1 with the early stop (token table), or the
    width-aware stopping rule over depth (round table; module doc). Stateless."""

    sps: SPSTable | RoundTable

    @property
    def verify_widths(self) -> tuple[int, ...] | None:
        """The widths a round table was measured at (the round compiles those), else None."""
        return self.sps.widths if isinstance(self.sps, RoundTable) else None

    def init_state(self, batch_size: int, block_size: int):
        del batch_size, block_size
        return jnp.zeros((), jnp.int32)  # round counter (no information is carried)

    def __call__(self, state, confidences, active):
        if isinstance(self.sps, RoundTable):
            return schedule_widths(confidences, active, self.sps), state + 1
        return schedule(confidences, active, self.sps, "early_stop"), state + 1


@dataclasses.dataclass(frozen=True)
class AsyncPrefixScheduler:
    """``--verify scheduler-async``: capacity K from the confidences of ``delay`` rounds ago
    (unconstrained search), then top-K by current survival (paper section 5.2).

    State: ``{"conf": [max(delay,1), B, G], "active": [max(delay,1), B], "round": int32}``
    (oldest first). Rounds before ``delay`` rounds of history exist use Algorithm 1.
    ``delay=0`` is the retrospective same-round search: NOT lossless (tests only).
    """

    sps: SPSTable
    delay: int = 2

    def __post_init__(self):
        if not isinstance(self.delay, int) or self.delay < 0:
            raise ConfigError(f"AsyncPrefixScheduler.delay must be an int >= 0, got {self.delay!r}")

    def init_state(self, batch_size: int, block_size: int):
        d = max(self.delay, 1)
        return {"conf": jnp.zeros((d, batch_size, block_size), jnp.float32),
                "active": jnp.zeros((d, batch_size), bool),
                "round": jnp.zeros((), jnp.int32)}

    def __call__(self, state, confidences, active):
        b, g = confidences.shape
        active = active.astype(bool)
        confidences = confidences.astype(jnp.float32)
        dense = jnp.asarray(self.sps.dense(b * (g + 1) + 1))
        rank, valid, theta = greedy_path(confidences, active, dense)
        if self.delay == 0:
            count = count_unconstrained(valid, theta)
        else:
            old_active = state["active"][0] & active
            _, old_valid, old_theta = greedy_path(state["conf"][0], old_active, dense)
            capacity = count_unconstrained(old_valid, old_theta)
            count = jnp.where(state["round"] >= self.delay,
                              jnp.minimum(capacity, jnp.sum(valid.astype(jnp.int32))),
                              count_early_stop(valid, theta))
        lengths = jnp.where(active, lengths_from_rank(rank, count), 0).astype(jnp.int32)
        new_state = {
            "conf": jnp.concatenate([state["conf"][1:], confidences[None]], axis=0),
            "active": jnp.concatenate([state["active"][1:], active[None]], axis=0),
            "round": state["round"] + 1,
        }
        return lengths, new_state


POLICY_NAMES = ("scheduler", "scheduler-async")


def make_policy(spec: str, sps_table, **kwargs):
    """A scheduler policy from its ``--verify`` name.

    spec: ``"scheduler"`` or ``"scheduler-async"`` (optionally ``"scheduler-async:D"`` for a
    delay of D rounds, default 2); sps_table: an :class:`SPSTable` or a path to its JSON.
    kwargs: ``delay`` (scheduler-async only).
    """
    name, _, arg = spec.partition(":")
    if name not in POLICY_NAMES:
        raise ConfigError(f"unknown scheduler policy {spec!r} (expected one of {POLICY_NAMES})")
    if sps_table is None:
        raise ConfigError(f"--verify {name} needs an SPS table (--sps FILE, from `dspark-jax profile-sps`)")
    if not isinstance(sps_table, (SPSTable, RoundTable)):
        sps_table = load_table(sps_table)
    if name == "scheduler":
        if arg or kwargs:
            raise ConfigError(f"--verify scheduler takes no options, got {spec!r} {kwargs or ''}")
        return PrefixScheduler(sps_table)
    if isinstance(sps_table, RoundTable):
        raise ConfigError(f"--verify {name} needs a token SPS table (`profile-sps` without --draft); "
                          "a round table serves --verify scheduler")
    delay = kwargs.pop("delay", 2)
    if kwargs:
        raise ConfigError(f"scheduler-async: unknown options {sorted(kwargs)}")
    if arg:
        try:
            delay = int(arg)
        except ValueError:
            raise ConfigError(f"--verify {spec!r}: the delay after ':' must be an int") from None
    if delay < 1:
        raise ConfigError(f"--verify {spec!r}: delay must be >= 1 (0 is the lossy retrospective search)")
    return AsyncPrefixScheduler(sps_table, delay=delay)
