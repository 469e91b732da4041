"""Projected serving: the continuous engine replayed on a clock from a round table and logged
rounds.

Cost source (``Costs``): a round table (``tables.RoundTable``: whole rounds/s of the decode
program at slot count B and verification width w; ``profile-sps --draft``, ``plan --hardware``
or ``bench``'s own profile) plus, where the table carries them in its meta, ``ar_rps`` [NB] (AR
steps/s of the AR program at each B) and ``request_seconds`` [NB] (per-request host work at each
B: the slot's prefill plus the harvest of the finished row). Absent extras cost nothing and the
report says so.

Acceptance source (``Logs``): per request, the rounds of real decoding under full verification
(``bench``'s ``rounds.jsonl``, or ``generate`` / ``eval`` result lines): for each round the raw
confidence logits [G] and the accepted drafts. A replayed request at output position ``e`` reads
the logged round that started at or before ``e`` (the latest one); a proposal of ``l`` drafts
accepts ``min(accepted, l)`` of them (exact at temperature 0 for rounds that start where a
logged round started; an approximation for rounds that start between two logged ones).

The replay (``project``) is the engine's slot loop (``decode.engine``): C slots, all requests
queued at t = 0; a free slot takes the next request and pays ``request_seconds``; every round
costs ``1 / rps(C, w)`` (all C rows run, finished ones masked), w = the smallest compiled width
(``shapes.round_widths``) >= the longest active proposal + 1; the policy (the real one, jitted)
picks lengths from the logged confidences (STS temperatures applied). Per request: tokens /
(finish - slot start), TTFT = slot start + prefill.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Sequence

import numpy as np

from dspark_jax.decode import shapes
from dspark_jax.decode.tables import RoundTable
from dspark_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds per round / AR step / request at a slot count, from one round table.

    ``table``: the speculative round table (None: AR only); ``ar``: AR steps/s as a one-width
    round table (None: no AR cost); ``request`` (batch_sizes, seconds) or None; ``source``: what
    the numbers are (a file and its device), printed beside every projected number."""

    table: RoundTable | None
    ar: RoundTable | None
    request: tuple[tuple[int, ...], tuple[float, ...]] | None
    source: str
    ar_request: tuple[tuple[int, ...], tuple[float, ...]] | None = None

    def round_s(self, slots: int, width: int, block_size: int) -> float:
        """Seconds of a ``slots``-row round at the smallest table width >= ``width``."""
        ws, rates = self.table.width_rates(slots, block_size)
        i = next((k for k, w in enumerate(ws) if w >= width), len(ws) - 1)
        return 1.0 / float(rates[i])

    def ar_s(self, slots: int) -> float:
        return 1.0 / float(self.ar.rates(slots)[0])

    def request_s(self, slots: int, speculative: bool = True) -> float:
        """Host seconds per request (prefill + harvest) at ``slots``; 0 when not recorded."""
        curve = self.request if speculative else self.ar_request
        if curve is None:
            return 0.0
        xs, ys = curve
        return float(np.interp(slots, xs, ys))

    def describe(self) -> str:
        extras = [k for k, v in (("AR steps", self.ar), ("per-request host cost", self.request))
                  if v is not None]
        return self.source + (f" (+ {', '.join(extras)})" if extras else "")


def capped(seconds: Sequence[float]) -> list[float]:
    """Seconds per slot count [NB], each capped by every larger slot count's (reverse cumulative
    min): more rows never cost less, and another process only ever slows a timing down, so a
    time above a taller one's is noise (``decode.profile`` caps its round tables the same way)."""
    return np.minimum.accumulate(np.asarray(seconds, np.float64)[::-1])[::-1].tolist()


def costs_from_json(obj: dict, source: str) -> Costs:
    """``Costs`` of a round table's JSON (its meta may add ``ar_rps``, ``request_seconds`` and
    ``ar_request_seconds``, each ``capped``: non-decreasing in the slot count)."""
    table = RoundTable.from_json(obj, where=source)
    bs = list(table.batch_sizes)
    ar = req = ar_req = None
    meta = dict(table.meta)
    if meta.get("ar_rps") is not None:
        ar_rps = _row(meta["ar_rps"], len(bs), f"{source}: ar_rps")
        ar = RoundTable(tuple(bs), (1,),
                        tuple((1.0 / v,) for v in capped([1.0 / r for r in ar_rps])))
    if meta.get("request_seconds") is not None:
        req = (tuple(bs), tuple(capped(_row(meta["request_seconds"], len(bs),
                                            f"{source}: request_seconds", positive=False))))
    if meta.get("ar_request_seconds") is not None:
        ar_req = (tuple(bs), tuple(capped(_row(meta["ar_request_seconds"], len(bs),
                                               f"{source}: ar_request_seconds", positive=False))))
    device = meta.get("device")
    return Costs(table, ar, req, source + (f" [{device}]" if device else ""), ar_req)


def _row(values, n: int, where: str, positive: bool = True) -> list[float]:
    if not isinstance(values, list) or len(values) != n:
        raise InputError(f"{where}: expected a list of {n} numbers (one per batch size)")
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise InputError(f"{where}: expected numbers") from None
    if not all(np.isfinite(v) and (v > 0 if positive else v >= 0) for v in out):
        raise InputError(f"{where}: values must be finite and {'> 0' if positive else '>= 0'}")
    return out


NO_HEAD_LOGIT = 30.0


@dataclasses.dataclass(frozen=True)
class RequestLog:
    """One prompt's logged rounds: ``starts`` [R] output tokens emitted before each round,
    ``logits`` [R, G] raw confidence logits, ``accepted`` [R] drafts accepted (under a proposal
    of G), ``length``: the logged output length (the request ends there: stop token or budget)."""

    starts: np.ndarray
    logits: np.ndarray
    accepted: np.ndarray
    length: int

    def at(self, emitted: int) -> int:
        """Index of the logged round that started at or before output position ``emitted``."""
        return max(int(np.searchsorted(self.starts, emitted, side="right")) - 1, 0)


def request_log(rec: dict, block_size: int, where: str) -> RequestLog:
    """A ``RequestLog`` from a result line (output_ids, confidence_logits [R][G],
    accepted_drafts [R], proposal_lengths [R]); InputError naming ``where`` on a bad one."""
    try:
        acc = np.asarray(rec["accepted_drafts"], np.int64)
        z = rec.get("confidence_logits")
        # No confidence head: the engine's confidences are all ones (logit +inf, clipped here).
        z = (np.full((len(acc), block_size), NO_HEAD_LOGIT) if z is None
             else np.asarray(z, np.float64))
        prop = np.asarray(rec["proposal_lengths"], np.int64)
        n_out = len(rec["output_ids"])
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{where}: a log line needs output_ids and per-round confidence_logits, "
                         "accepted_drafts and proposal_lengths") from None
    if z.ndim != 2 or z.shape[0] != len(acc) or len(prop) != len(acc):
        raise InputError(f"{where}: per-round lists of unequal length (or no confidence head)")
    if z.shape[1] != block_size:
        raise InputError(f"{where}: rounds of {z.shape[1]} drafts; this drafter proposes "
                         f"{block_size} (logs of another drafter)")
    if np.any(prop < block_size):
        raise InputError(f"{where}: rounds verified fewer than all {block_size} drafts; replay "
                         "needs logs decoded with --verify full")
    starts = 1 + np.concatenate([[0], np.cumsum(acc + 1)[:-1]]).astype(np.int64)
    return RequestLog(starts, z, acc, n_out)


@dataclasses.dataclass
class Served:
    """Per-request outcome of one replayed stream and its totals."""

    tokens: np.ndarray          # [N] output tokens
    per_user: np.ndarray        # [N] tokens / (finish - slot start)
    ttft: np.ndarray            # [N]
    seconds: float
    round_tokens: list = dataclasses.field(default_factory=list)    # 1 + accepted, per row-round
    round_budget: list = dataclasses.field(default_factory=list)    # 1 + proposal, per row-round


def _confidences(logits: np.ndarray, temps) -> np.ndarray:
    t = np.ones(logits.shape[-1]) if temps is None else np.asarray(temps, np.float64)
    return 1.0 / (1.0 + np.exp(-logits / t))


def compiled_widths(policy, block_size: int) -> tuple[int, ...]:
    """The widths the engine's round compiles for ``policy`` (``shapes.round_widths``)."""
    static = types.SimpleNamespace(draft=types.SimpleNamespace(block_size=block_size), widths=None,
                                   policy=policy)
    return shapes.round_widths(static)


def policy_for(spec: str, table_obj: dict | None, token_table=None):
    """The policy ``spec`` as the engine runs it: ``scheduler`` plans with the round table
    (``table_obj``), ``scheduler-async`` with a token table."""
    from dspark_jax.decode.policies import parse_policy
    from dspark_jax.decode.tables import RoundTable

    name = spec.partition(":")[0]
    if name == "scheduler":
        return parse_policy(spec, sps_table=RoundTable.from_json(table_obj))
    if name == "scheduler-async":
        return parse_policy(spec, sps_table=token_table)
    return parse_policy(spec)


class _Lengths:
    """The policy's lengths for a [C, G] confidence block, jitted once per C."""

    def __init__(self, policy, slots: int, block_size: int):
        import jax

        self.fn = jax.jit(lambda s, c, a: policy(s, c, a))
        self.state = policy.init_state(slots, block_size)

    def __call__(self, conf: np.ndarray, active: np.ndarray) -> np.ndarray:
        lengths, self.state = self.fn(self.state, conf.astype(np.float32), active)
        return np.asarray(lengths)


def project(requests: Sequence[RequestLog | int], slots: int, costs: Costs, *, policy=None,
            block_size: int = 1, temps=None) -> Served:
    """Replay ``requests`` (RequestLogs, or output lengths for AR: ``policy`` None) through
    ``slots`` slots on the clock of ``costs``."""
    n = len(requests)
    speculative = policy is not None
    length = np.array([r.length if speculative else int(r) for r in requests])
    widths = compiled_widths(policy, block_size) if speculative else (1,)
    lengths_of = _Lengths(policy, slots, block_size) if speculative else None
    out = Served(np.zeros(n, np.int64), np.zeros(n), np.zeros(n), 0.0)
    start = np.zeros(n)
    slot_req = [-1] * slots
    emitted = np.zeros(slots, np.int64)
    pending = list(range(n))[::-1]
    t = 0.0
    while pending or any(r >= 0 for r in slot_req):
        for s in range(slots):  # refill (the engine's _fill): prefill pays per request
            if slot_req[s] < 0 and pending:
                i = pending.pop()
                start[i] = t
                t += costs.request_s(slots, speculative)
                out.ttft[i] = t
                slot_req[s], emitted[s] = i, 1
        active = np.array([r >= 0 for r in slot_req])
        if speculative:
            conf = np.zeros((slots, block_size))
            acc = np.zeros(slots, np.int64)
            for s in np.flatnonzero(active):
                log = requests[slot_req[s]]
                k = log.at(int(emitted[s]))
                conf[s], acc[s] = _confidences(log.logits[k], temps), log.accepted[k]
            lens = np.where(active, lengths_of(conf, active), 0)
            need = int(lens[active].max()) + 1
            w = next((x for x in widths if x >= need), widths[-1])
            t += costs.round_s(slots, w, block_size)
            gain = 1 + np.minimum(acc, lens)
            out.round_budget += (1 + lens[active]).tolist()
        else:
            t += costs.ar_s(slots)
            gain = np.ones(slots, np.int64)
        for s in np.flatnonzero(active):
            i = slot_req[s]
            step = int(min(gain[s], length[i] - emitted[s]))
            emitted[s] += step
            if speculative:
                out.round_tokens.append(int(gain[s]))
            if emitted[s] >= length[i]:
                out.tokens[i] = emitted[s]
                out.per_user[i] = emitted[s] / max(t - start[i], 1e-12)
                slot_req[s] = -1
    out.seconds = t
    return out


def served_row(served: Served, speculative: bool) -> dict:
    """The bench row fields of a stream (measured rows carry the same ones)."""
    pu = served.per_user
    return dict(throughput=float(served.tokens.sum() / served.seconds),
                per_user_tokens_per_second=float(pu.mean()),
                per_user_p50=float(np.percentile(pu, 50)),
                per_user_p90=float(np.percentile(pu, 90)),
                tau=float(np.mean(served.round_tokens)) if speculative else 1.0,
                verification_budget=float(np.mean(served.round_budget)) if speculative else 1.0,
                ttft_s=float(served.ttft.mean()), output_tokens=int(served.tokens.sum()),
                seconds=float(served.seconds))


# ----------------------------------------------------------------------------- frontier and SLA


def frontier(points: Sequence[tuple[float, float]]) -> np.ndarray:
    """The fitted frontier of (per-user tok/s, throughput) points: the Pareto-efficient points
    (no other point is at least as fast per user and as high in throughput), sorted by per-user
    speed, [K, 2]. Read between them linearly in log-log space (``at_speed``, ``at_throughput``)."""
    pts = np.asarray([p for p in points if p[0] > 0 and p[1] > 0], np.float64).reshape(-1, 2)
    keep = [i for i, (x, y) in enumerate(pts)
            if not any((x2 >= x and y2 >= y and (x2 > x or y2 > y)) for x2, y2 in pts)]
    out = pts[keep]
    return out[np.argsort(out[:, 0])]


def at_speed(front: np.ndarray, speed: float) -> float | None:
    """Throughput of the frontier at per-user ``speed`` (None outside its range)."""
    if len(front) == 0 or not front[0, 0] <= speed <= front[-1, 0]:
        return None
    return float(np.exp(np.interp(np.log(speed), np.log(front[:, 0]), np.log(front[:, 1]))))


def at_throughput(front: np.ndarray, throughput: float) -> float | None:
    """Per-user speed of the frontier at aggregate ``throughput`` (None outside its range)."""
    if len(front) == 0:
        return None
    by_y = front[np.argsort(front[:, 1])]
    if not by_y[0, 1] <= throughput <= by_y[-1, 1]:
        return None
    return float(np.exp(np.interp(np.log(throughput), np.log(by_y[:, 1]), np.log(by_y[:, 0]))))


def sla_report(curves: dict[str, list[dict]], baseline: str, slas: Sequence[float]) -> dict:
    """Per curve: throughput at each SLA (per-user tok/s) and per-user speed at the baseline's
    throughputs, each with its ratio to the baseline, read off the fitted frontiers."""
    fronts = {name: frontier([(r["per_user_tokens_per_second"], r["throughput"]) for r in rows])
              for name, rows in curves.items()}
    base = fronts[baseline]
    report: dict[str, Any] = {"baseline": baseline, "curves": {}}
    for name, front in fronts.items():
        sla = []
        for s in slas:
            y, y0 = at_speed(front, s), at_speed(base, s)
            sla.append(dict(per_user=s, throughput=y, baseline=y0,
                            gain=(y / y0 - 1.0) if y is not None and y0 else None))
        matched = []
        for _, y in base:
            x, x0 = at_throughput(front, y), at_throughput(base, y)
            matched.append(dict(throughput=float(y), per_user=x, baseline=x0,
                                gain=(x / x0 - 1.0) if x is not None and x0 else None))
        report["curves"][name] = {"frontier": front.tolist(), "sla": sla, "matched": matched}
    return report
