"""Decode metrics: paper section 5's acceptance statistics over a list of Results."""

from __future__ import annotations

from typing import Sequence

from dspark_jax.decode.requests import Result


def summarize(results: Sequence[Result], block_size: int | None = None) -> dict:
    """Aggregate metrics of decode results (paper section 5's tau and acceptance rates).

    tau: mean acceptance length per round (bonus included); mean_proposal;
    verify_rate = sum(acceptance) / sum(proposal + 1); accept_rate@k = rounds with
    > k accepted drafts / rounds that proposed > k; conditional_accept@k = rounds
    with > k accepted / rounds with >= k accepted that proposed > k; tokens/s =
    output tokens / summed batch wall time.
    """
    acc = [a for r in results for a in r.acceptance_lengths]
    prop = [p for r in results for p in r.proposal_lengths]
    drafts = [d for r in results for d in r.accepted_drafts]
    g = block_size or max(prop + [0])
    rounds = len(acc)
    out_tokens = sum(len(r.output_ids) for r in results)
    seconds = sum({(r.batch_index): r.batch_seconds for r in results}.values())
    accept_rate, conditional = [], []
    for k in range(g):
        proposed = sum(1 for p in prop if p > k)
        reached = sum(1 for p, d in zip(prop, drafts) if p > k and d >= k)
        passed = sum(1 for d in drafts if d > k)
        accept_rate.append(passed / proposed if proposed else None)
        conditional.append(passed / reached if reached else None)
    return {
        "requests": len(results),
        "rounds": rounds,
        "output_tokens": out_tokens,
        "tau": sum(acc) / rounds if rounds else 0.0,
        "mean_proposal": sum(prop) / rounds if rounds else 0.0,
        "verify_rate": sum(acc) / (sum(prop) + rounds) if rounds else 0.0,
        "accept_rate": accept_rate,
        "conditional_accept": conditional,
        "seconds": seconds,
        "tokens_per_second": out_tokens / seconds if seconds > 0 else 0.0,
    }
