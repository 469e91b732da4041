"""Hardware-aware prefix scheduler (paper Algorithm 1 and section 5.2).

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

Round tables and the width-aware objective. The decode round (``step.speculative_round``) verifies a
padded block: every one of its B rows (slots) runs ``w`` tokens, w the smallest compiled width
(``shapes.round_widths``, default 1, 2, 4, .., G+1) >= the longest active proposal + 1, so a round
costs what its *width* costs, not what its ``sum_r (1 + l_r)`` tokens would. A
:class:`RoundTable` (``profile-sps --draft``, ``profile.measure_rounds``) holds whole rounds per
second of that program at each (slot count B, width w). With such a table the
:class:`PrefixScheduler` chooses the round's width, and every active row verifies all the drafts
that width holds (a narrower prefix would cost the same padded round and can only accept fewer
tokens). The choice is a stopping rule over depth (:func:`width_by_depth`): starting at the
narrowest width, it opens the next one when some wider width w' is estimated to pay,
``(tau_known + est(w')) * RPS(B, w') > tau_known * RPS(B, w)``, where ``tau_known`` sums the
survivals the current width holds and ``est`` extrapolates each active row geometrically from
its first position d outside the width (``a_rd * c_rd ** (k - d)``); the first refusal stops.
Deciding whether position d is verified reads confidences at positions <= d only (each row's
own and other rows'), never the confidences that are functions of the draft being verified, so
the scheduler stays non-anticipating (lossless), as Algorithm 1's early stop does. (An earlier
rule walked Algorithm 1's descending-survival path and opened a width when a completion bound,
every not-yet-admitted slot of the width filled with the current candidate's survival, beat the
current throughput: the bound's room grows with the rows, so at 64 slots it opened the widest
width where width 2 paid best; benchmarks/results/engine_trained.) With a token table
(:class:`SPSTable`) the scheduler is the paper's Algorithm 1 over ``R + n`` tokens.

SPS tables (:class:`SPSTable`) are measured by ``dspark_jax.decode.profile`` and stored as
JSON. A raw table (``interp="sps"``) interpolates SPS linearly between measured batch sizes,
clamps below the smallest and beyond the largest assumes a constant token rate
(``SPS(B) = SPS(Bmax) * Bmax / B``).

Fitted tables (:func:`fit_sps`, :meth:`SPSTable.fitted`). A measured SPS curve is a latency
curve ``L(B) = 1 / SPS(B)``: physically non-decreasing in B and, for a roofline-limited
forward (flat while memory-bound, then linear in B), convex and piecewise linear. Timing
noise on a shared machine breaks both, and a single false cliff stops Algorithm 1 before it
admits anything. Fits (raw values always kept in ``meta["raw_sps"]``):

- ``none``: the measurements as they are;
- ``monotone``: isotonic (non-increasing) least-squares fit of SPS at the measured sizes;
- ``linear``: ``L(B) = alpha + beta * B`` (alpha, beta >= 0), relative least squares;
- ``convex`` (default of ``profile-sps``): the non-decreasing convex piecewise-linear ``L``
  with knots at the measured sizes closest in relative least squares (NNLS on a hinge basis).

``linear`` and ``convex`` tables interpolate *latency* linearly between sizes
(``interp="latency"``) and extrapolate past the largest with slope
``max(last segment slope, L(Bmax) / Bmax)``, so ``L`` is convex and non-decreasing for every
integer B. Then ``tau(n) / L(R + n)`` along the admission path (tau concave, L convex) is
quasi-concave, hence unimodal, and the early-stopping Algorithm 1 returns the global optimum
over all ``l in {0..G}^R`` (tested against brute force). Fitting never affects losslessness:
that comes from the early stop / the delayed capacity, for any curve.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.errors import ConfigError, InputError
from dspark_jax.fileio import atomic_open

SPS_FORMAT = "dspark-jax/sps-table/v1"
FITS = ("none", "monotone", "linear", "convex")
DEFAULT_FIT = "convex"
INTERPS = ("sps", "latency")


# ----------------------------------------------------------------------------- SPS table


@dataclasses.dataclass(frozen=True)
class SPSTable:
    """Target verification steps per second vs verification tokens per forward.

    ``batch_sizes``: strictly increasing positive ints; ``sps``: positive floats (same length).
    ``interp``: ``"sps"`` (interpolate SPS linearly; raw tables) or ``"latency"`` (interpolate
    1/SPS linearly, extrapolate with a non-decreasing slope; fitted tables, see module doc).
    ``meta`` (device, model, cache length, date, fit, raw_sps, ...) is carried along but not
    hashed/compared, so two tables with the same curve are the same static jit argument.
    """

    batch_sizes: tuple[int, ...]
    sps: tuple[float, ...]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    interp: str = "sps"

    def __post_init__(self):
        bs = tuple(int(b) for b in self.batch_sizes)
        sps = tuple(float(s) for s in self.sps)
        object.__setattr__(self, "batch_sizes", bs)
        object.__setattr__(self, "sps", sps)
        if not bs:
            raise ConfigError("SPSTable.batch_sizes is empty")
        if len(bs) != len(sps):
            raise ConfigError(f"SPSTable: {len(bs)} batch_sizes but {len(sps)} sps values")
        if bs[0] < 1 or any(b2 <= b1 for b1, b2 in zip(bs, bs[1:])):
            raise ConfigError(f"SPSTable.batch_sizes must be positive and strictly increasing, got {bs}")
        bad = [s for s in sps if not (np.isfinite(s) and s > 0)]
        if bad:
            raise ConfigError(f"SPSTable.sps values must be finite and > 0, got {bad[:3]}")
        if self.interp not in INTERPS:
            raise ConfigError(f"SPSTable.interp must be one of {INTERPS}, got {self.interp!r}")

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def __call__(self, b) -> np.ndarray:
        """SPS at token counts ``b`` (array-like of positive numbers), float64 numpy."""
        b = np.asarray(b, np.float64)
        xs = np.asarray(self.batch_sizes, np.float64)
        ys = np.asarray(self.sps, np.float64)
        if self.interp == "latency":
            lat = 1.0 / ys
            slope = lat[-1] / xs[-1]
            if len(xs) > 1:
                slope = max(slope, (lat[-1] - lat[-2]) / (xs[-1] - xs[-2]))
            lb = np.where(b > xs[-1], lat[-1] + slope * (b - xs[-1]), np.interp(b, xs, lat))
            return 1.0 / lb
        inside = np.interp(b, xs, ys)
        beyond = ys[-1] * xs[-1] / np.maximum(b, 1.0)
        return np.where(b > xs[-1], beyond, inside)

    def dense(self, max_tokens: int) -> np.ndarray:
        """``[max_tokens + 1]`` float32 lookup table indexed by token count (entry 0 = SPS(1))."""
        b = np.maximum(np.arange(max_tokens + 1), 1)
        return self(b).astype(np.float32)

    # --- JSON

    def latency(self, b) -> np.ndarray:
        """Seconds per verification forward at token counts ``b`` (``1 / SPS``)."""
        return 1.0 / self(b)

    def fitted(self, method: str = DEFAULT_FIT) -> "SPSTable":
        """This table refitted with ``method`` (one of :data:`FITS`) from its raw measurements
        (``meta["raw_sps"]`` when present, else its own values)."""
        raw = self.meta.get("raw_sps")
        raw = self.sps if raw is None or len(raw) != len(self.sps) else raw
        return fit_sps(self.batch_sizes, raw, method, meta=self.meta)

    def to_json(self) -> dict:
        return {"format": SPS_FORMAT, **dict(self.meta), "interp": self.interp,
                "batch_sizes": list(self.batch_sizes), "sps": list(self.sps)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "SPS table") -> "SPSTable":
        if not isinstance(obj, Mapping):
            raise InputError(f"{where}: expected a JSON object")
        for key in ("batch_sizes", "sps"):
            if key not in obj or not isinstance(obj[key], list):
                raise InputError(f"{where}: field {key!r} (a list) is missing")
        fmt = obj.get("format", SPS_FORMAT)
        if fmt != SPS_FORMAT:
            raise InputError(f"{where}: unknown format {fmt!r} (expected {SPS_FORMAT!r})")
        meta = {k: v for k, v in obj.items() if k not in ("batch_sizes", "sps", "format", "interp")}
        try:
            return cls(tuple(obj["batch_sizes"]), tuple(obj["sps"]), meta, obj.get("interp", "sps"))
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise InputError(f"{where}: {e}") from None
            raise InputError(f"{where}: bad values ({e})") from None

    @classmethod
    def load(cls, path, fit: str | None = None) -> "SPSTable":
        """Read a table; with ``fit`` (one of :data:`FITS`) refit it from its raw measurements."""
        if fit is not None and fit not in FITS:
            raise ConfigError(f"SPS fit must be one of {FITS}, got {fit!r}")
        table = cls._load(path)
        return table if fit is None else table.fitted(fit)

    @classmethod
    def _load(cls, path) -> "SPSTable":
        path = Path(path)
        if not path.is_file():
            raise InputError(f"SPS table {str(path)!r} does not exist (run `dspark-jax profile-sps`)")
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"SPS table {str(path)!r}: invalid JSON ({e})") from None
        return cls.from_json(obj, where=f"SPS table {str(path)!r}")

    def save(self, path, force: bool = False) -> None:
        """Atomic write (temp file next to ``path``, then rename); refuses to overwrite unless ``force``."""
        atomic_write_text(path, json.dumps(self.to_json(), indent=1) + "\n", force=force)


def isotonic_decreasing(y: Sequence[float], w: Sequence[float] | None = None) -> np.ndarray:
    """(Weighted) least-squares non-increasing fit of ``y`` [N] (pool-adjacent-violators)."""
    y = np.asarray(y, np.float64)
    w = np.ones_like(y) if w is None else np.asarray(w, np.float64)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, wi in zip(y, w):
        blocks.append([v, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([np.full(n, m) for m, _, n in blocks])


def _fit_latency(x: np.ndarray, lat: np.ndarray, method: str) -> np.ndarray:
    """Fitted latencies at ``x`` [N]: relative (1/lat weighted) NNLS on a hinge basis."""
    from scipy.optimize import nnls

    if method == "linear":
        basis = np.stack([np.ones_like(x), x - x[0]], axis=1)
    else:  # convex: alpha + sum_k d_k * max(0, x - x_k), every d_k >= 0 (slopes non-decreasing)
        basis = np.concatenate([np.ones_like(x)[:, None],
                                np.maximum(0.0, x[:, None] - x[None, :-1])], axis=1)
    w = 1.0 / lat
    coef, _ = nnls(basis * w[:, None], lat * w, maxiter=50 * basis.shape[1])
    fit = basis @ coef
    return np.maximum(fit, lat.min() * 1e-3)  # alpha = 0 with an all-zero-slope start: stay > 0


def fit_sps(batch_sizes: Sequence[int], sps: Sequence[float], method: str = DEFAULT_FIT,
            meta: Mapping[str, Any] | None = None) -> SPSTable:
    """An :class:`SPSTable` fitted to raw measurements ``sps`` [N] at ``batch_sizes`` [N].

    ``method``: ``none`` | ``monotone`` | ``linear`` | ``convex`` (module doc). The raw
    values and the method are recorded in ``meta["raw_sps"]`` / ``meta["fit"]``.
    """
    if method not in FITS:
        raise ConfigError(f"SPS fit must be one of {FITS}, got {method!r}")
    raw = SPSTable(tuple(batch_sizes), tuple(sps))  # validates sizes and values
    meta = {**dict(meta or {}), "fit": method, "raw_sps": [float(v) for v in raw.sps]}
    meta.pop("monotone", None)
    x = np.asarray(raw.batch_sizes, np.float64)
    y = np.asarray(raw.sps, np.float64)
    if method == "none":
        return SPSTable(raw.batch_sizes, raw.sps, meta)
    if method == "monotone":
        return SPSTable(raw.batch_sizes, tuple(isotonic_decreasing(y)), meta)
    lat = _fit_latency(x, 1.0 / y, method)
    return SPSTable(raw.batch_sizes, tuple(1.0 / lat), meta, interp="latency")


def atomic_write_text(path, text: str, force: bool = False) -> None:
    with atomic_open(path, force=force) as f:
        f.write(text)


ROUND_FORMAT = "dspark-jax/round-table/v1"


@dataclasses.dataclass(frozen=True)
class RoundTable:
    """Whole speculative rounds per second of the decode program at (B rows, verification width w).

    ``batch_sizes`` [NB] strictly increasing positive ints (slot counts); ``widths`` [NW] strictly
    increasing (the compiled widths); ``rps`` [NB][NW] positive floats. Latency (1/rps) is
    interpolated linearly in B between measured slot counts, clamped below the smallest and
    scaled in proportion to B beyond the largest. ``meta`` (device, model, cache length, raw
    measurements, ...) is not hashed: two tables with the same grid are the same static argument.
    """

    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]
    rps: tuple[tuple[float, ...], ...]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        bs = tuple(int(b) for b in self.batch_sizes)
        ws = tuple(int(w) for w in self.widths)
        try:
            rps = tuple(tuple(float(v) for v in row) for row in self.rps)
        except TypeError:
            raise ConfigError("RoundTable.rps must be a list of rows (one per batch size)") from None
        object.__setattr__(self, "batch_sizes", bs)
        object.__setattr__(self, "widths", ws)
        object.__setattr__(self, "rps", rps)
        for name, xs in (("batch_sizes", bs), ("widths", ws)):
            if not xs or xs[0] < 1 or any(b <= a for a, b in zip(xs, xs[1:])):
                raise ConfigError(f"RoundTable.{name} must be non-empty, positive and strictly "
                                  f"increasing, got {xs}")
        if len(rps) != len(bs) or any(len(row) != len(ws) for row in rps):
            raise ConfigError(f"RoundTable.rps must be {len(bs)} rows of {len(ws)} values")
        if not all(np.isfinite(v) and v > 0 for row in rps for v in row):
            raise ConfigError("RoundTable.rps values must be finite and > 0")

    def rates(self, batch: int) -> np.ndarray:
        """[NW] float64 rounds per second of a ``batch``-row round at each width."""
        xs = np.asarray(self.batch_sizes, np.float64)
        lat = 1.0 / np.asarray(self.rps, np.float64)                         # [NB, NW]
        b = float(batch)
        if b > xs[-1]:
            out = lat[-1] * b / xs[-1]
        else:
            out = np.array([np.interp(b, xs, lat[:, i]) for i in range(lat.shape[1])])
        return 1.0 / out

    def width_rates(self, batch: int, block_size: int) -> tuple[tuple[int, ...], np.ndarray]:
        """(widths W, rates [len(W)]) for a round of ``batch`` rows and block size G: the table's
        widths up to G+1, plus G+1 (at the rate of the next measured width, or the widest)."""
        rates = self.rates(batch)
        ws = [w for w in self.widths if w <= block_size + 1]
        rs = [float(r) for w, r in zip(self.widths, rates) if w <= block_size + 1]
        if not ws or ws[-1] != block_size + 1:
            nxt = [r for w, r in zip(self.widths, rates) if w > block_size + 1]
            ws.append(block_size + 1)
            rs.append(nxt[0] if nxt else float(rates[-1]))
        return tuple(ws), np.asarray(rs, np.float64)

    def to_json(self) -> dict:
        return {"format": ROUND_FORMAT, **dict(self.meta), "batch_sizes": list(self.batch_sizes),
                "widths": list(self.widths), "rps": [list(r) for r in self.rps]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "round table") -> "RoundTable":
        if not isinstance(obj, Mapping):
            raise InputError(f"{where}: expected a JSON object")
        for key in ("batch_sizes", "widths", "rps"):
            if key not in obj or not isinstance(obj[key], list):
                raise InputError(f"{where}: field {key!r} (a list) is missing")
        meta = {k: v for k, v in obj.items() if k not in ("batch_sizes", "widths", "rps", "format")}
        try:
            return cls(tuple(obj["batch_sizes"]), tuple(obj["widths"]), tuple(obj["rps"]), meta)
        except ConfigError as e:
            raise InputError(f"{where}: {e}") from None
        except (TypeError, ValueError) as e:
            raise InputError(f"{where}: bad values ({e})") from None

    def save(self, path, force: bool = False) -> None:
        """Atomic write; refuses to overwrite unless ``force``."""
        atomic_write_text(path, json.dumps(self.to_json(), indent=1) + "\n", force=force)


def load_table(path, fit: str | None = None):
    """An :class:`SPSTable` (token table) or :class:`RoundTable` from its JSON file (by its
    ``format``); ``fit`` refits a token table (round tables are stored as measured)."""
    p = Path(path)
    if p.is_file():
        try:
            obj = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"SPS table {str(p)!r}: invalid JSON ({e})") from None
        if isinstance(obj, Mapping) and obj.get("format") == ROUND_FORMAT:
            return RoundTable.from_json(obj, where=f"round table {str(p)!r}")
    return SPSTable.load(path, fit)


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
    a = survival(c)                                                        # [B, G]
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
