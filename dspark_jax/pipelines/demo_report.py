"""The demo report's pieces: decode results turned into tables, marked sample continuations and the
verdict line (``demo.stage_report`` assembles them into report.json and table.txt)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping, Sequence

SPAN_OPEN, SPAN_CLOSE = "\u27e6", "\u27e7"   # ⟦draft tokens the target accepted in one round⟧


def round_spans(result, detok: Callable[[Sequence[int]], str]) -> dict:
    """What each round of a speculative ``Result`` committed: ``{"first": text of the prefill
    token, "rounds": [{"accepted": draft text the target accepted, "bonus": the target's own
    token}]}`` (cut at ``len(output_ids)``, like the output) and ``"marked"``: the continuation
    with each round's accepted draft span (when not empty) as ``⟦accepted⟧`` followed by its bonus
    token unmarked, so every unmarked token is the target's own (prefill, then one per round)."""
    ids = list(result.output_ids)
    drafts = list(result.accepted_drafts) or [a - 1 for a in result.acceptance_lengths]
    pos = min(1, len(ids))
    first = detok(ids[:pos])
    rounds = []
    for a, d in zip(result.acceptance_lengths, drafts):
        if pos >= len(ids):
            break
        acc, bonus = ids[pos:pos + d], ids[pos + d:pos + a]
        rounds.append({"accepted": detok(acc), "bonus": detok(bonus)})
        pos += a
    marked = first + "".join((f"{SPAN_OPEN}{r['accepted']}{SPAN_CLOSE}" if r["accepted"] else "") + r["bonus"]
                             for r in rounds)
    return {"first": first, "rounds": rounds, "marked": marked}


def sample_continuations(num_samples: int, results, records, detok, mode: str = "dspark") -> list[dict]:
    """The first ``num_samples`` held-out prompts and ``mode``'s continuations, rounds marked."""
    out = []
    for rec, res in list(zip(records, results))[:num_samples]:
        spans = round_spans(res, detok)
        out.append({"dataset": rec.dataset, "index": rec.index, "prompt": rec.text, "mode": mode,
                    "text": detok(res.output_ids), "marked": spans["marked"],
                    "acceptance_lengths": list(res.acceptance_lengths), "rounds": spans["rounds"]})
    return out


def format_samples(samples: Sequence[Mapping], temperature: float) -> str:
    """The sample continuations as text: prompt, then the marked continuation."""
    if not samples:
        return ""
    lines = [f"sample continuations ({samples[0]['mode']}, temperature {temperature:g}): "
             f"{SPAN_OPEN}...{SPAN_CLOSE} = draft tokens the target accepted in one round; every other token "
             "is the target's own (the prefill token, then one bonus token per round)"]
    for i, smp in enumerate(samples, 1):
        taus = smp["acceptance_lengths"]
        lines.append(f"--- {i}. {smp['dataset']} #{smp['index']} ({len(taus)} rounds, "
                     f"mean acceptance {sum(taus) / max(len(taus), 1):.2f})")
        lines.append("prompt:")
        lines.append(smp["prompt"].rstrip("\n"))
        lines.append("\u2192 continuation:")
        lines.append(smp["marked"])
    return "\n".join(lines)


def summary_rows(results: Mapping[str, Sequence], block: Mapping[str, int], tokenizer=None) -> dict:
    """{mode: decode_summary + speedup over autoregressive + degeneracy} of one table (``results``:
    {mode: decode results}, "autoregressive" among the modes)."""
    from dspark_jax.pipelines.evaluate import decode_summary

    rows = {m: decode_summary(results[m], block.get(m), tokenizer=tokenizer) for m in results}
    base_tps = rows["autoregressive"]["tokens_per_second"]
    for m in rows:
        rows[m]["speedup"] = rows[m]["tokens_per_second"] / base_tps if base_tps else None
    return rows


TABLE_KEYS = ("tau", "mean_proposal", "verify_rate", "accept_rate", "conditional_accept", "tokens_per_second",
              "speedup", "degenerate_fraction", "whitespace_fraction", "num_degenerate", "rounds",
              "output_tokens", "requests")


def table_json(rows: Mapping[str, Mapping]) -> dict:
    out = {}
    for m, r in rows.items():
        flat = dict(r, **{k: r["degeneracy"][k] for k in ("degenerate_fraction", "whitespace_fraction",
                                                           "num_degenerate")})
        out[m] = {k: flat[k] for k in TABLE_KEYS}
    return out


def train_info(summary_files: Mapping[str, Path]) -> dict:
    """{drafter: steps, wall time, final loss and expected acceptance length} from each train run's
    summary.json (drafters without one are left out)."""
    from dspark_jax.train.loss import EXPECTED_ACCEPT_LENGTH_NOTE

    out = {}
    for m, sf in summary_files.items():
        if sf.is_file():
            s = json.loads(sf.read_text())
            fin = s.get("final") or {}
            out[m] = {"steps": s.get("steps"), "wall_s": s.get("wall_s"), "final_loss": fin.get("loss"),
                      "final_expected_accept_length": fin.get("expected_accept_length"),
                      "note": EXPECTED_ACCEPT_LENGTH_NOTE}
    return out


def summary_line(ratio: float | None, difference: float, agree: Mapping[str, float], temperature: float,
                 greedy: bool) -> str:
    """The report's one-line verdict: DSpark tau / DFlash tau and how often each drafter's outputs
    equal the autoregressive ones (``greedy``: they must, all of them)."""
    if ratio is None:
        return ""
    return (f"DSpark tau / DFlash tau = {ratio:.3f} at temperature {temperature:g} "
            f"(difference {difference:+.3f}); outputs equal to autoregressive "
            f"({'temperature 0' if greedy else 'sampling'}): "
            f"dflash {agree['dflash']:.0%}, dspark {agree['dspark']:.0%}"
            + (" (greedy: must be 100%)" if greedy else " (sampling: may differ)"))
