"""Generation of a JSONL prompt file: encode, decode (speculative or autoregressive), write.

The ``generate`` command parses flags and prints; ``generate`` here does the work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dspark_jax.decode.settings import DecodeOptions, advisories, check_verify_block, resolve
from dspark_jax.errors import warn
from dspark_jax.fileio import atomic_open, check_output, dumps


def generate(target, prompts_file, out, *, draft=None, options: DecodeOptions = DecodeOptions(),
             dtype: str | None = None, max_cache_len: int | None = None, force: bool = False,
             progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Decode every prompt of ``prompts_file`` and write one JSON line per prompt to ``out``.

    Lines are the input record plus output_ids, acceptance_lengths, proposal_lengths,
    accepted_drafts, confidence_logits, (with a tokenizer) output_text and, with continuous
    batching (``options.batching``, the default), ttft_s / latency_s / tokens_per_second;
    ``options.mesh`` ("data=2,tensor=2") shards the decode. Returns the
    ``decode.summarize`` summary with "mode" and "verify".
    """
    from tqdm import tqdm

    from dspark_jax.convert.checkpoint import load_draft, load_target
    from dspark_jax.data.prompts import read_prompts
    from dspark_jax.decode import autoregressive_generate, speculative_generate, summarize
    from dspark_jax.decode.sharded import make_decode_mesh
    from dspark_jax.tokenizer import encode_prompt, load_tokenizer

    out = check_output(out, force=force, inputs={"--target": target, "--draft": draft,
                                                 "--prompts": prompts_file, "--sps": options.sps_table})
    if draft:
        from dspark_jax.pairing import check_pair_paths
        check_pair_paths(target, draft)
    target_dir = Path(target)
    tokenizer = load_tokenizer(target_dir) if target_dir.is_dir() else None
    encode = None
    if tokenizer is not None:
        encode = lambda t: encode_prompt(tokenizer, t, raw=options.raw_prompt, thinking=options.thinking)
    records = read_prompts(prompts_file, encode, tokenizer_hint=f" (none found in {str(target_dir)!r})")
    prompts = [ids for _, ids in records]
    settings = resolve(options, target_dir, draft, tokenizer)
    if draft:
        from dspark_jax.pairing import stored_config
        check_verify_block(options, settings.policy, stored_config(draft, "draft").block_size)

    mesh = make_decode_mesh(options.mesh)  # ConfigError before loading or compiling
    tcfg, tparams = load_target(target_dir, dtype)
    bars = []  # the bar appears at the decoder's first report (progress(0): shapes and memory checked)

    def report(n: int) -> None:
        if not bars:
            bars.append(tqdm(total=len(prompts), desc="generate", unit="prompt", disable=not progress))
        bars[0].update(n)

    common = dict(max_cache_len=max_cache_len, progress=report, mesh=mesh,
                  batching=options.batching)
    block = None
    try:
        if draft:
            dcfg, dparams = load_draft(draft, dtype, target_params=tparams, steps=options.draft_steps)
            block = dcfg.block_size
            for message in advisories(options, settings.policy, block):
                warn(message)
            if settings.sts_from_drafter:
                log(f"generate: STS temperatures from the drafter's extras: {settings.confidence_temperatures}")
            results = speculative_generate(tcfg, tparams, dcfg, dparams, prompts,
                                           **settings.decode_kwargs(options), **common)
        else:
            results = autoregressive_generate(tcfg, tparams, prompts,
                                              **settings.decode_kwargs(options, speculative=False), **common)
    finally:  # an error's line comes after the bar, not inside it
        for bar in bars:
            bar.close()

    lines = []
    for (rec, _), res in zip(records, results):
        line = dict(rec)
        line.update(output_ids=res.output_ids, acceptance_lengths=res.acceptance_lengths,
                    proposal_lengths=res.proposal_lengths, accepted_drafts=res.accepted_drafts,
                    confidence_logits=res.confidence_logits)
        if tokenizer is not None:
            line["output_text"] = tokenizer.decode(res.output_ids)
        for k in ("ttft_s", "latency_s", "tokens_per_second"):
            if hasattr(res, k):
                line[k] = getattr(res, k)
        lines.append(dumps(line) + "\n")
    import jax
    if jax.process_index() == 0:  # multi-process (launch/): every process decodes, process 0 writes
        with atomic_open(out) as f:
            f.writelines(lines)
    summary = summarize(results, block)
    summary["mode"] = "speculative" if draft else "autoregressive"
    summary["verify"] = options.verify if draft else None
    summary["batching"] = options.batching
    summary["mesh"] = options.mesh
    return summary
