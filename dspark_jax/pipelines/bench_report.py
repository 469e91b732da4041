"""``bench``'s printed table, SLA and agreement reports, and the two figures in the paper's form
(Fig. 7: aggregate throughput vs per-user tokens/s per curve, points labelled by concurrency;
Fig. 8: verification budget and throughput vs concurrency)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

# (header, row key, width, format); text columns left-aligned.
COLUMNS = (("curve", "curve", 24, "s"), ("source", "source", 9, "s"), ("C", "concurrency", 4, "d"),
           ("tok/s", "throughput", 9, ".1f"),
           ("user tok/s", "per_user_tokens_per_second", 10, ".1f"),
           ("p50", "per_user_p50", 8, ".1f"), ("p90", "per_user_p90", 8, ".1f"),
           ("tau", "tau", 5, ".2f"), ("budget", "verification_budget", 6, ".2f"),
           ("TTFT s", "ttft_s", 7, ".3f"), ("compiles", "timed_compiles", 8, "d"))


def table(rows: Sequence[dict]) -> list[str]:
    """One line per row (curve, source, concurrency, throughput, per-user mean/p50/p90, tau,
    verification budget, TTFT, compiles after warm-up; '-' where a row has no value)."""
    def cell(text, width, kind):
        return f"{text:<{width}}" if kind == "s" else f"{text:>{width}}"

    lines = [" ".join(cell(h, w, k) for h, _, w, k in COLUMNS)]
    for r in rows:
        lines.append(" ".join(cell("-" if r.get(key) is None else format(r[key], k), w, k)
                              for _, key, w, k in COLUMNS))
    return lines


def source_lines(rows: Sequence[dict]) -> list[str]:
    """Where each curve's projected numbers come from: its cost and acceptance sources, once."""
    seen: dict[str, tuple] = {}
    for r in rows:
        if r["source"] == "projected":
            seen.setdefault(r["curve"], (r.get("cost_source"), r.get("acceptance_source")))
    return [f"projected {curve}: costs: {cost}; acceptance: {acc}"
            for curve, (cost, acc) in seen.items()]


def sla_lines(report: dict) -> list[str]:
    """The SLA report, one line per curve and SLA / matched throughput, gains vs the baseline."""
    def pct(g):
        return "n/a (outside the curve)" if g is None else f"{100 * g:+.0f}%"

    def num(x):
        return "-" if x is None else f"{x:.1f}"

    lines = [f"SLA report vs {report['baseline']} ({report['source']}; fitted frontier: Pareto "
             "points, log-log interpolation)"]
    for name, c in report["curves"].items():
        if name == report["baseline"]:
            continue
        for s in c["sla"]:
            lines.append(f"  {name}: at {s['per_user']:g} tok/s/user "
                         f"throughput {num(s['throughput'])} vs {num(s['baseline'])} tok/s "
                         f"({pct(s['gain'])})")
        for m in c["matched"]:
            lines.append(f"  {name}: at {m['throughput']:.1f} tok/s aggregate per-user "
                         f"{num(m['per_user'])} vs {num(m['baseline'])} tok/s ({pct(m['gain'])})")
    return lines


def agreement(rows: Sequence[dict]) -> list[dict]:
    """Projected vs measured throughput per (curve, concurrency) present in both sources."""
    measured = {(r["curve"], r["concurrency"]): r for r in rows if r["source"] == "measured"}
    return [dict(curve=r["curve"], concurrency=r["concurrency"], measured=m["throughput"],
                 projected=r["throughput"], diff=r["throughput"] / m["throughput"] - 1.0)
            for r in rows if r["source"] == "projected"
            for m in [measured.get((r["curve"], r["concurrency"]))] if m is not None]


def agreement_lines(pairs: Sequence[dict], tolerance: float) -> list[str]:
    lines = [f"{'curve':<24} {'C':>4} {'measured':>9} {'projected':>9} {'diff':>7}"]
    for a in pairs:
        flag = "" if abs(a["diff"]) <= tolerance else f"  outside {100 * tolerance:.0f}%"
        lines.append(f"{a['curve']:<24} {a['concurrency']:>4} {a['measured']:>9.1f} "
                     f"{a['projected']:>9.1f} {100 * a['diff']:>+6.1f}%{flag}")
    return lines


def _curves(rows):
    keys = []
    for r in rows:
        k = (r["curve"], r["source"])
        if k not in keys:
            keys.append(k)
    return [(k, sorted((r for r in rows if (r["curve"], r["source"]) == k),
                       key=lambda r: r["concurrency"])) for k in keys]


def _style(source: str) -> dict:
    measured = source == "measured"
    return dict(linestyle="-" if measured else "--", marker="o" if measured else "s")


def plot_frontier(rows: Sequence[dict], path: Path, title: str) -> Path | None:
    """Fig. 7: throughput vs per-user tok/s, one curve per (curve, source), points labelled by
    concurrency; the legend sits right of the axes, off the data."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(10, 6))
    for (name, source), sel in _curves(rows):
        x = [r["per_user_tokens_per_second"] for r in sel]
        y = [r["throughput"] for r in sel]
        line, = ax.plot(x, y, label=f"{name} ({source})", **_style(source))
        for r, xi, yi in zip(sel, x, y):
            ax.annotate(str(r["concurrency"]), (xi, yi), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-user generation speed (tokens/s per request)")
    ax.set_ylabel("aggregate throughput (tokens/s)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, title="curve (source)",
              title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_budget(rows: Sequence[dict], path: Path, title: str) -> Path | None:
    """Fig. 8: mean verification budget (tokens per request per verify step) and throughput vs
    concurrency, one line per (curve, source); the legend below the axes."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for (name, source), sel in _curves(rows):
        c = [r["concurrency"] for r in sel]
        label = f"{name} ({source})"
        axes[0].plot(c, [r["verification_budget"] for r in sel], label=label, **_style(source))
        axes[1].plot(c, [r["throughput"] for r in sel], label=label, **_style(source))
    for ax, t in zip(axes, ("verification budget (tokens / request / verify step)",
                            "aggregate throughput (tokens/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_title(t, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * ((len(labels) - 1) // 3), 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
