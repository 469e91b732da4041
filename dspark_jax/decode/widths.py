"""The width rule: how wide a padded decode round verifies under a round table (``tables.RoundTable``).

The decode round (``step.speculative_round``) verifies a
padded block: every one of its B rows (slots) runs ``w`` tokens, w the smallest compiled width
(``shapes.round_widths``, default 1, 2, 4, .., G+1) >= the longest active proposal + 1, so a round
costs what its *width* costs, not what its ``sum_r (1 + l_r)`` tokens would. A
``tables.RoundTable`` (``profile-sps --draft``, ``profile.measure_rounds``) holds whole rounds per
second of that program at each (slot count B, width w). With such a table the
``scheduler.PrefixScheduler`` chooses the round's width, and every active row verifies all the drafts
that width holds (a narrower prefix would cost the same padded round and can only accept fewer
tokens). The choice is a stopping rule over depth (``width_by_depth``): starting at the
narrowest width, it opens the next one when some wider width w' is estimated to pay,
``(tau_known + est(w')) * RPS(B, w') > tau_known * RPS(B, w)``, where ``tau_known`` sums the
survivals the current width holds and ``est`` extrapolates each active row geometrically from
its first position d outside the width (``a_rd * c_rd ** (k - d)``); the first refusal stops.
Deciding whether position d is verified reads confidences at positions <= d only (each row's
own and other rows'), never the confidences that are functions of the draft being verified, so
the scheduler stays non-anticipating (lossless), as Algorithm 1's early stop does. With a token table
(``tables.SPSTable``) the scheduler is the paper's Algorithm 1 over ``R + n`` tokens (``scheduler``).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decode.tables import RoundTable


def width_by_depth(confidences: jax.Array, active: jax.Array, widths: Sequence[int], rates) -> jax.Array:
    """The width-aware choice (module doc): a stopping rule over depth, vectorised over rows.

    confidences [B, G], active [B] bool, widths [NW] sorted (last = G+1), rates [NW] rounds/s of
    a B-row round at each width (static). Starting at the narrowest width, the round opens the
    next width when, for some wider width w', the estimated throughput
    ``(tau_known + est(w')) * RPS(w')`` beats the current ``tau_known * RPS(w)``: ``tau_known``
    sums the survivals the current width already holds; ``est`` extrapolates each active row
    from its first position outside the width (index d): ``a_rd * c_rd ** (k - d)`` for
    positions k in [d, w' - 1). The first refusal stops. The decision to verify position d
    reads confidences at positions <= d only, so it never depends on the drafts it verifies.
    Returns lengths [B] int32: w - 1 for active rows (capped at their positive-survival
    prefix), 0 for inactive ones.
    """
    b, g = confidences.shape
    c = jnp.clip(confidences.astype(jnp.float32), 0.0, 1.0)
    a = jnp.cumprod(c, axis=-1)                                # [B, G] prefix survival (c clipped)
    act = active.astype(bool)
    af = act.astype(jnp.float32)
    held = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), jnp.cumsum(a, axis=-1)], axis=-1)
    drafts = [min(int(w) - 1, g) for w in widths]                            # d_i, increasing
    rates = [float(x) for x in rates]
    known = [jnp.sum(af) + jnp.sum(af * held[:, d]) for d in drafts]         # tau at each width
    chosen = jnp.zeros((), jnp.int32)
    going = jnp.ones((), bool)
    for i, d in enumerate(drafts[:-1]):
        best = jnp.float32(-jnp.inf)
        for j in range(i + 1, len(drafts)):
            powers = c[:, d:d + 1] ** jnp.arange(drafts[j] - d, dtype=jnp.float32)  # [B, n]
            est = jnp.sum(af * jnp.sum(a[:, d:d + 1] * powers, axis=-1))
            best = jnp.maximum(best, (known[i] + est) * rates[j])
        going = going & (best > known[i] * rates[i])
        chosen = jnp.where(going, i + 1, chosen)
    depth = jnp.asarray(drafts, jnp.int32)[chosen]
    positive = jnp.sum((a > 0).astype(jnp.int32), axis=-1)                # a is non-increasing
    return jnp.where(act, jnp.minimum(depth, positive), 0).astype(jnp.int32)


def schedule_widths(confidences, active, table: RoundTable) -> jax.Array:
    """Per-row lengths [B] int32 of the width-aware scheduler under a round table (jittable;
    ``table`` static; B = the round's rows, so the table is read at this slot count)."""
    b, g = confidences.shape
    widths, rates = table.width_rates(b, g)
    return width_by_depth(confidences, active, widths, rates)


def expected_round_throughput(confidences, active, lengths, table: RoundTable) -> float:
    """Theta = tau * RPS(B, w) of given lengths, w the width they run at (numpy; tests, benchmarks)."""
    c = np.clip(np.asarray(confidences, np.float64), 0, 1)
    b, g = c.shape
    a = np.cumprod(c, axis=-1)
    act = np.asarray(active, bool)
    lengths = np.asarray(lengths)
    if not act.any():
        return 0.0
    mask = np.arange(g)[None, :] < lengths[:, None]
    tau = np.sum(act) + np.sum(np.where(mask & act[:, None], a, 0.0))
    widths, rates = table.width_rates(b, g)
    need = int(np.max(np.where(act, lengths, 0))) + 1
    i = next(k for k, w in enumerate(widths) if w >= need)
    return float(tau * rates[i])
