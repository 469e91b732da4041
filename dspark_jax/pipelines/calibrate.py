"""Sequential Temperature Scaling (STS: one temperature per block position, fitted left to right) and confidence-quality metrics.

Input: decode rounds, each with the raw confidence logits of the block ``[G]`` (before any
temperature), the number of accepted drafts and the proposal length (drafts sent to
verification). Position k (1-based) of a round is *verified* iff ``proposal >= k``; its
observed prefix acceptance is ``accepted >= k``. Positions that were not verified carry no
label and are ignored everywhere.

STS fits one temperature per position, left to right: ``t_k`` minimises the ECE of the
cumulative product ``prod_{i<=k} sigmoid(logit_i / t_i)`` against ``accepted >= k`` with
``t_1..t_{k-1}`` fixed, by grid search. Positive temperatures are order-preserving for each
``c_k``, so the conditional AUROC of c_k (rows whose prefix up to k-1 survived) is unchanged
exactly; the AUROC of the cumulative product can move slightly (different rows mix positions'
temperatures), and both are reported.

All functions are numpy (calibration is offline, small, and runs once).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from dspark_jax.errors import InputError
from dspark_jax.fileio import atomic_dir, dumps, iter_jsonl

DEFAULT_GRID = np.geomspace(0.05, 20.0, 481)
DEFAULT_BINS = 15

_LOGIT_KEYS = ("confidence_logits", "conf_logits")
_PROB_KEYS = ("confidences", "confidence")
_ACCEPT_KEYS = ("accepted", "num_accepted", "accepted_drafts")
_PROPOSAL_KEYS = ("proposal", "proposal_length", "num_proposed", "verify_length")


@dataclasses.dataclass(frozen=True)
class Rounds:
    """Decode rounds: logits [N, G] float64 (raw), accepted [N] int, proposal [N] int."""

    logits: np.ndarray
    accepted: np.ndarray
    proposal: np.ndarray

    def __post_init__(self):
        if self.logits.ndim != 2:
            raise InputError(f"confidence logits must be [N, G], got shape {self.logits.shape}")
        n, g = self.logits.shape
        if self.accepted.shape != (n,) or self.proposal.shape != (n,):
            raise InputError(f"accepted {self.accepted.shape} / proposal {self.proposal.shape} "
                             f"must be [{n}] like the logits rows")
        if np.any(self.proposal < 0) or np.any(self.proposal > g):
            raise InputError(f"proposal lengths must be in [0, {g}]")
        if np.any(self.accepted < 0) or np.any(self.accepted > self.proposal):
            raise InputError("accepted drafts must be in [0, proposal]")

    @property
    def num_rounds(self) -> int:
        return self.logits.shape[0]

    @property
    def block_size(self) -> int:
        return self.logits.shape[1]

    def take(self, idx) -> "Rounds":
        return Rounds(self.logits[idx], self.accepted[idx], self.proposal[idx])

    def verified(self) -> np.ndarray:
        """[N, G] bool: position k was sent to verification."""
        return np.arange(1, self.block_size + 1)[None, :] <= self.proposal[:, None]

    def survived(self) -> np.ndarray:
        """[N, G] bool: the prefix up to and including position k was accepted."""
        return np.arange(1, self.block_size + 1)[None, :] <= self.accepted[:, None]


def _first(rec: Mapping[str, Any], keys: Iterable[str]):
    for k in keys:
        if k in rec:
            return rec[k]
    return None


def rounds_from_records(records: Iterable[Mapping[str, Any]], where: str = "logs",
                        positions: Sequence[str] | None = None) -> Rounds:
    """Rounds from dicts with ``confidence_logits`` [G] (or ``confidences`` probabilities),
    ``accepted`` and ``proposal`` (aliases: num_accepted / proposal_length, num_proposed,
    verify_length). A record may instead hold ``rounds``: a list of such dicts, or be a
    ``generate`` result (per-round lists ``confidence_logits`` [R][G], ``accepted_drafts``
    (or ``acceptance_lengths`` = accepted + 1) and ``proposal_lengths``). Errors name
    ``positions[i]`` (e.g. "file:line") or "<where> record <i>" (1-based)."""
    logits, acc, prop = [], [], []

    def add(rec, line):
        if not isinstance(rec, Mapping):
            raise InputError(f"{line}: expected a JSON object")
        if "rounds" in rec:
            for sub in rec["rounds"]:
                add(sub, line)
            return
        z = rec.get("confidence_logits")
        if isinstance(z, list) and z and isinstance(z[0], list):  # a per-request record
            accs = rec.get("accepted_drafts")
            if accs is None and "acceptance_lengths" in rec:
                accs = [int(x) - 1 for x in rec["acceptance_lengths"]]
            props = rec.get("proposal_lengths")
            if accs is None or props is None or not len(accs) == len(props) == len(z):
                raise InputError(f"{line}: a request record needs per-round lists "
                                 "'confidence_logits', 'accepted_drafts' and 'proposal_lengths' "
                                 "of equal length")
            for zi, ai, pi in zip(z, accs, props):
                add({"confidence_logits": zi, "accepted": ai, "proposal": pi}, line)
            return
        z = _first(rec, _LOGIT_KEYS)
        if z is None:
            c = _first(rec, _PROB_KEYS)
            if c is None:
                raise InputError(f"{line}: no 'confidence_logits' (or 'confidences') field")
            c = np.clip(np.asarray(c, np.float64), 1e-7, 1 - 1e-7)
            z = np.log(c) - np.log1p(-c)
        a, p = _first(rec, _ACCEPT_KEYS), _first(rec, _PROPOSAL_KEYS)
        if a is None or p is None:
            raise InputError(f"{line}: needs 'accepted' and 'proposal' fields")
        try:
            z = np.asarray(z, np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise InputError(f"{line}: confidence logits must be a list of numbers") from None
        bad = np.flatnonzero(~np.isfinite(z))
        if bad.size:
            raise InputError(f"{line}: confidence logit {bad[0]} is {z[bad[0]]} (non-finite or null); "
                             "the drafter that wrote these logs is broken")
        if logits and z.shape != logits[0].shape:
            raise InputError(f"{line}: {z.size} confidence logits, earlier rounds had "
                             f"{logits[0].size}")
        try:
            a, p = int(a), int(p)
        except (TypeError, ValueError):
            raise InputError(f"{line}: 'accepted' and 'proposal' must be ints, got {a!r}, {p!r}") from None
        logits.append(z)
        acc.append(a)
        prop.append(p)

    for i, rec in enumerate(records, 1):
        add(rec, positions[i - 1] if positions is not None else f"{where} record {i}")
    if not logits:
        raise InputError(f"{where}: no decode rounds")
    try:
        return Rounds(np.stack(logits), np.asarray(acc), np.asarray(prop))
    except InputError as e:
        raise InputError(f"{where}: {e}") from None


def load_decode_logs(path) -> Rounds:
    """Rounds from a JSONL file (one round, or one record with ``rounds``, per line)."""
    pairs = list(iter_jsonl(path, "decode log"))
    return rounds_from_records([r for _, r in pairs], where=str(path), positions=[w for w, _ in pairs])


def split_rounds(rounds: Rounds, holdout_fraction: float, seed: int = 0) -> tuple[Rounds, Rounds]:
    """(fit, held-out) by a seeded random permutation of rounds."""
    if not 0.0 < holdout_fraction < 1.0:
        raise InputError(f"holdout fraction must be in (0, 1), got {holdout_fraction}")
    perm = np.random.default_rng(seed).permutation(rounds.num_rounds)
    n_held = max(1, int(round(holdout_fraction * rounds.num_rounds)))
    if n_held >= rounds.num_rounds:
        raise InputError(f"only {rounds.num_rounds} rounds: too few to split")
    return rounds.take(np.sort(perm[n_held:])), rounds.take(np.sort(perm[:n_held]))


# ----------------------------------------------------------------------------- metrics


def sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, np.float64)))


def cumulative_probs(logits: np.ndarray, temperatures=None) -> np.ndarray:
    """``prod_{i<=k} sigmoid(logit_i / t_i)``: [N, G] -> [N, G]."""
    t = np.ones(logits.shape[-1]) if temperatures is None else np.asarray(temperatures, np.float64)
    return np.cumprod(sigmoid(logits / t), axis=-1)


def ece(probs, labels, n_bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error, equal-width bins on [0, 1], weighted by bin counts."""
    probs = np.asarray(probs, np.float64)
    labels = np.asarray(labels, np.float64)
    if probs.size == 0:
        return float("nan")
    bins = np.minimum((probs * n_bins).astype(np.int64), n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    gap = np.abs(np.bincount(bins, probs, n_bins) - np.bincount(bins, labels, n_bins))
    return float(gap.sum() / count.sum())


def _ece_columns(probs: np.ndarray, labels: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of each column of probs [M, T] against labels [M] (vectorised grid search)."""
    m, t = probs.shape
    bins = np.minimum((probs * n_bins).astype(np.int64), n_bins - 1) + n_bins * np.arange(t)[None, :]
    size = n_bins * t
    sum_p = np.bincount(bins.ravel(), probs.ravel(), size).reshape(t, n_bins)
    sum_y = np.bincount(bins.ravel(), np.broadcast_to(labels[:, None], probs.shape).ravel(),
                        size).reshape(t, n_bins)
    return np.abs(sum_p - sum_y).sum(axis=1) / m


def auroc(scores, labels) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count 1/2); nan with a single class."""
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels, bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s))
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i:j + 1] = 0.5 * (i + j) + 1
        i = j + 1
    r = np.empty_like(ranks)
    r[order] = ranks
    return float((r[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier(probs, labels) -> float:
    probs = np.asarray(probs, np.float64)
    return float(np.mean((probs - np.asarray(labels, np.float64)) ** 2)) if probs.size else float("nan")


def position_metrics(rounds: Rounds, temperatures=None, n_bins: int = DEFAULT_BINS) -> list[dict]:
    """Per position k = 1..G over verified rounds: n, accept_rate, mean_conf, ece, brier,
    auroc (of the cumulative product vs prefix acceptance) and cond_auroc (of c_k alone on
    rounds whose prefix up to k-1 survived)."""
    cum = cumulative_probs(rounds.logits, temperatures)
    ver, surv = rounds.verified(), rounds.survived()
    out = []
    for k in range(rounds.block_size):
        m = ver[:, k]
        p, y = cum[m, k], surv[m, k]
        cond = m & (rounds.accepted >= k)
        out.append({
            "position": k + 1, "n": int(m.sum()),
            "accept_rate": float(y.mean()) if m.any() else float("nan"),
            "mean_conf": float(p.mean()) if m.any() else float("nan"),
            "ece": ece(p, y, n_bins), "brier": brier(p, y), "auroc": auroc(p, y),
            "cond_auroc": auroc(rounds.logits[cond, k], surv[cond, k]),
        })
    return out


def summary(per_position: list[dict]) -> dict:
    """Count-weighted means of ece / brier over positions that have data."""
    n = np.array([p["n"] for p in per_position], np.float64)
    out = {"n_positions": int(np.sum(n > 0))}
    for key in ("ece", "brier"):
        v = np.array([p[key] for p in per_position], np.float64)
        ok = n > 0
        out[key] = float(np.sum(v[ok] * n[ok]) / np.sum(n[ok])) if ok.any() else float("nan")
    return out


# ----------------------------------------------------------------------------- STS


def fit_sts(rounds: Rounds, grid=None, n_bins: int = DEFAULT_BINS, min_count: int = 20) -> np.ndarray:
    """Per-position temperatures [G] (float64), left to right: position k on rounds that verified it.

    Positions with fewer than ``min_count`` verified rounds keep the previous position's
    temperature (1.0 at the first).
    """
    grid = DEFAULT_GRID if grid is None else np.asarray(grid, np.float64)
    if np.any(grid <= 0):
        raise InputError("STS temperature grid must be positive (order-preserving)")
    g = rounds.block_size
    temps = np.ones(g)
    ver, surv = rounds.verified(), rounds.survived()
    prefix = np.ones(rounds.num_rounds)  # prod_{i<k} calibrated c_i
    for k in range(g):
        m = ver[:, k]
        if m.sum() >= min_count:
            cand = prefix[m, None] * sigmoid(rounds.logits[m, k][:, None] / grid[None, :])
            errs = _ece_columns(cand, surv[m, k].astype(np.float64), n_bins)
            temps[k] = grid[int(np.argmin(errs))]
        elif k > 0:
            temps[k] = temps[k - 1]
        prefix = prefix * sigmoid(rounds.logits[:, k] / temps[k])
    return temps


# ----------------------------------------------------------------------------- plot


MIN_BIN_ROUNDS = 10  # a reliability bin with fewer rounds is drawn hollow, off the curve


def reliability_diagram(rounds: Rounds, temperatures, path, n_bins: int = DEFAULT_BINS,
                        title: str = "", sts_label: str = "STS") -> dict:
    """PNG: one panel per position, observed prefix acceptance vs cumulative confidence,
    before (raw) and after STS, with the rounds per confidence bin behind (right axis: raw as
    grey bars, STS as a blue outline). A bin with fewer than ``MIN_BIN_ROUNDS`` rounds is a
    hollow marker off the line (a handful of rounds says little), the others are joined;
    ECE weighs the bins by their rounds. ``sts_label`` names the STS curve, saying whether its
    temperatures were fitted on these rounds ("in-sample") or on others ("held out"); the
    legend sits below each panel so it hides no curve. Returns ``{"title", "legend": [labels
    of panel 1], "histogram": right-axis label}``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    g = rounds.block_size
    cols = min(g, 4)
    rows = -(-g // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 4.6 * rows), squeeze=False)
    ver, surv = rounds.verified(), rounds.survived()
    edges = np.linspace(0, 1, n_bins + 1)
    centers = 0.5 * (edges[1:] + edges[:-1])
    for k in range(rows * cols):
        ax = axes[k // cols][k % cols]
        if k >= g:
            ax.axis("off")
            continue
        m = ver[:, k]
        handles = []
        for temps, label, color in ((None, "raw", "tab:red"), (temperatures, sts_label, "tab:blue")):
            p = cumulative_probs(rounds.logits, temps)[m, k]
            y = surv[m, k]
            b = np.minimum((p * n_bins).astype(int), n_bins - 1)
            cnt = np.bincount(b, minlength=n_bins)
            acc = np.bincount(b, y.astype(float), n_bins) / np.maximum(cnt, 1)
            full, few = cnt >= MIN_BIN_ROUNDS, (cnt > 0) & (cnt < MIN_BIN_ROUNDS)
            if temps is None:
                ax2 = ax.twinx()
                ax2.bar(centers, cnt, width=1 / n_bins, color="0.85", zorder=0)
                ax2.set_ylabel("rounds per bin", fontsize=7, color="0.45")
                ax2.tick_params(axis="y", labelsize=6, colors="0.45")
                ax.set_zorder(ax2.get_zorder() + 1)
                ax.patch.set_visible(False)
                handles.append(Patch(color="0.85", label="rounds per bin (raw, right axis)"))
            else:
                ax2.stairs(cnt, edges, color=color, lw=0.8, alpha=0.6)
                handles += ax2.plot([], [], color=color, lw=0.8, alpha=0.6,
                                    label="rounds per bin (STS, right axis)")
            handles += ax.plot(centers[full], acc[full], marker="o", ms=3, color=color,
                               label=f"{label} ECE {100 * ece(p, y, n_bins):.1f}%")
            ax.plot(centers[few], acc[few], ls="none", marker="o", ms=3, mfc="none", color=color)
        handles += ax.plot([], [], ls="none", marker="o", ms=3, mfc="none", color="0.3",
                           label=f"hollow: bin of < {MIN_BIN_ROUNDS} rounds (not joined)")
        handles += ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfect calibration")
        ax.set_title(f"position {k + 1} (n={int(m.sum())})", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("cumulative confidence", fontsize=8)
        ax.set_ylabel("prefix acceptance", fontsize=8)
        ax.legend(handles=handles, fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.2),
                  ncol=1, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    ax0 = axes[0][0]
    info = {"title": title, "legend": [t.get_text() for t in ax0.get_legend().get_texts()],
            "histogram": "rounds per bin (raw)"}
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return info


def reliability_plot(rounds: Rounds, path, title: str = "", holdout: float = 0.5, seed: int = 0,
                     n_bins: int = DEFAULT_BINS, min_rounds: int = 40) -> dict:
    """Reliability diagram with STS held out: temperatures fitted on a seeded ``1 - holdout``
    share of ``rounds``, curves drawn on the other share; with fewer than ``min_rounds``
    rounds, fitted and drawn on all of them and labelled in-sample. Returns
    ``reliability_diagram``'s info plus ``"sts": "held out" | "in-sample"``."""
    if rounds.num_rounds >= min_rounds:
        fit, held = split_rounds(rounds, holdout, seed)
        label, head, how = (f"STS held out (fit on {fit.num_rounds} other rounds)",
                            f"{held.num_rounds} held-out rounds", "held out")
    else:
        fit = held = rounds
        label, head, how = ("STS in-sample (fit on these rounds)", f"{rounds.num_rounds} rounds", "in-sample")
    info = reliability_diagram(held, fit_sts(fit, n_bins=n_bins), path, n_bins,
                               title=f"{title}: {head}" if title else head, sts_label=label)
    return dict(info, sts=how)


# --------------------------------------------------------------------------- the calibrate run


def run_sts(logs, out, *, draft=None, holdout: float = 0.3, seed: int = 0, bins: int = DEFAULT_BINS,
            refit_all: bool = False, write_draft: bool = False, force: bool = False) -> dict:
    """Fit STS on decode ``logs`` and write ``out/`` (sts.json, reliability.png and, with
    ``write_draft``, ``out/draft``: the drafter of ``draft`` with the temperatures in its
    extras), atomically. Returns the sts.json report."""
    import datetime

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    rounds = load_decode_logs(logs)
    fit, held = split_rounds(rounds, holdout, seed)
    temps = fit_sts(fit, n_bins=bins)

    def block(r, t):
        per = position_metrics(r, t, bins)
        return {"summary": summary(per), "positions": per}

    report = {
        "format": "dspark-jax/sts/v1",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "logs": str(logs),
        "draft": draft,
        "rounds": rounds.num_rounds, "fit_rounds": fit.num_rounds, "heldout_rounds": held.num_rounds,
        "block_size": rounds.block_size, "bins": bins, "seed": seed,
        "heldout": {"before": block(held, None), "after": block(held, temps)},
        "fit": {"before": block(fit, None), "after": block(fit, temps)},
        "fit_temperatures": [float(t) for t in temps],
    }
    if refit_all:
        temps = fit_sts(rounds, n_bins=bins)
    report["temperatures"] = [float(t) for t in temps]
    at_bound = [k for k, t in enumerate(temps) if t in (DEFAULT_GRID[0], DEFAULT_GRID[-1])]
    if at_bound:
        from dspark_jax.errors import warn
        warn(f"STS temperature of position(s) {at_bound} sits at the search bound "
             f"[{DEFAULT_GRID[0]:g}, {DEFAULT_GRID[-1]:g}]: the confidence logits rank acceptance "
             "poorly there (or too few rounds); the fit is unreliable")

    with atomic_dir(out, force=force) as tmp:
        how = ("STS refit on all rounds (in-sample)" if refit_all else
               f"STS held out (fit on {fit.num_rounds} other rounds)")
        report["reliability_plot"] = dict(
            reliability_diagram(held, temps, tmp / "reliability.png", bins,
                                title=f"{held.num_rounds} held-out rounds: raw vs STS", sts_label=how),
            sts="in-sample" if refit_all else "held out")
        (tmp / "sts.json").write_text(dumps(report, indent=1) + "\n")
        if write_draft:
            _save_draft_with_sts(draft, tmp / "draft", report["temperatures"])
    return report


def _save_draft_with_sts(draft, dst: Path, temperatures: list[float]) -> None:
    """Copy the drafter ``draft`` (same format, sidecar files kept) to ``dst`` with
    ``extras["sts_temperatures"]`` set; InputError when the block sizes differ."""
    import shutil

    from dspark_jax.convert import checkpoint, formats

    cfg, params = checkpoint.load_draft(draft)
    if len(temperatures) != cfg.block_size:
        raise InputError(f"logs have {len(temperatures)} confidence positions but --draft has "
                         f"block_size {cfg.block_size}")
    extras = {**formats.read_extras(draft), "sts_temperatures": list(temperatures)}
    checkpoint.save_draft(dst, cfg, params, format=formats.detect_format(draft), extras=extras)
    for name in formats.SIDECAR_FILES:
        src = Path(draft) / name
        if src.is_file():
            shutil.copy2(src, dst / name)
