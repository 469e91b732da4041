"""Speed tables of the verification scheduler: token SPS tables, round tables, and their fits.

What the scheduler reads about the target's speed, measured by ``decode.profile`` and stored as
JSON.

SPS tables (:class:`SPSTable`): verification steps per second vs tokens per forward. A raw table
(``interp="sps"``) interpolates SPS linearly between measured batch sizes, clamps below the
smallest and beyond the largest assumes a constant token rate (``SPS(B) = SPS(Bmax) * Bmax / B``).

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

Round tables (:class:`RoundTable`, ``profile-sps --draft``): whole decode rounds per second at each
(slot count B, round width w), read by the width rule (``widths``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

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
