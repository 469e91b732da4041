"""On-policy vs off-policy training data for the drafter: tau on held-out and in-sample prompts.

    PYTHONPATH=$PWD nice -n 15 python benchmarks/data_policy.py --out DIR [--seeds 0,1] [--steps 200]
    PYTHONPATH=$PWD python benchmarks/data_policy.py --smoke --out DIR     # < 1 min, numbers meaningless

The demo's setting (``dspark_jax.pipelines.demo``) on the embedded default target (a byte-level
LM pretrained on the Python standard library): the same training prompts (the demo's
``train_prompt_texts``, cut from the standard library's TRAIN files; only prompts whose file
goes on for at least ``continuation_tokens`` more bytes are kept, so both datasets use the same
prompts), two training sets with the same number of trained (loss_mask 1) tokens per row:

- ``on_policy``: the target's own continuation, sampled at ``sample_temperature`` (1.0) with the
  decode engine, as ``demo.stage_sample`` does (``on_policy_rows``: the one place that makes
  on-policy data; swap in another regenerator there);
- ``off_policy``: the real text that follows the prompt in its source file (the raw stdlib
  source the target was pretrained on), byte-tokenised like the prompt and cut to the same
  token count (``off_policy_rows``).

For each seed, one DSpark drafter per dataset is trained with the demo's config
(``demo.train_config``: same steps, batch, learning rate, drafter shape and seed), then decoded
with the demo's decode settings on the packaged ``stdlib-heldout`` prompts (held-out files) and
on the first ``num_eval_prompts`` training prompts (in-sample), at ``temperature`` (1.0, the
demo's headline) and 0 (greedy). The target alone (autoregressive) is decoded too, for the
degeneracy of its own outputs. Reported per (prompts, temperature, data): tau (mean acceptance
length, bonus included) per seed and its mean, accept@k, and degeneracy (outputs with a
distinct-4-gram ratio < 0.3, whitespace share of generated tokens; ``dspark_jax.degeneracy``),
plus the degeneracy of the training continuations themselves. Compile counts are reported per
decode call (warm-up included) and in total.

Writes DIR/data_policy.json, DIR/data_policy.txt (the table), DIR/data_policy.png (when
matplotlib is present); the datasets, training runs and exported drafters under DIR/work/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_jax.costs.compiles import COMPILES  # noqa: E402
from dspark_jax.data.sources import reply_record  # noqa: E402
from dspark_jax.fileio import write_json, write_jsonl, write_text  # noqa: E402
from dspark_jax.pipelines import demo  # noqa: E402

DATASETS = ("on_policy", "off_policy")
PROMPT_SETS = ("heldout", "insample")
DRAFTER = "dspark"


# --------------------------------------------------------------------------- data


def following_text(root: Path, record: dict) -> str:
    """The text of ``record``'s file after its prompt (``record["source"]`` = "rel.py:LINE",
    ``record["text"]`` = whole lines from LINE on), read the way ``train_prompt_texts`` reads it."""
    rel, line = record["source"].rsplit(":", 1)
    lines = (root / rel).read_text(encoding="utf-8").splitlines(keepends=True)
    start, n = int(line) - 1, len(record["text"].splitlines(keepends=True))
    assert "".join(lines[start:start + n]) == record["text"], record["source"]
    return "".join(lines[start + n:])


def policy_prompts(cfg: demo.DemoConfig, tok, root: Path | None = None) -> list[dict]:
    """``cfg.num_train_prompts`` demo training prompts whose file continues for at least
    ``cfg.continuation_tokens`` tokens: ``[{"text", "source", "following_ids"}]``."""
    from dspark_jax.embedded import corpus

    root = Path(root) if root is not None else corpus.stdlib_dir()
    need = cfg.num_train_prompts
    for factor in (2, 4, 8):
        recs = demo.train_prompt_texts(factor * need, min_bytes=cfg.prompt_min_bytes,
                                       max_bytes=cfg.prompt_max_bytes, seed=cfg.seed, root=root)
        out = []
        for r in recs:
            ids = tok.encode(following_text(root, r))[:cfg.continuation_tokens]
            if len(ids) == cfg.continuation_tokens:
                out.append(dict(r, following_ids=ids))
            if len(out) == need:
                return out
    raise SystemExit(f"only {len(out)} of {need} training prompts have {cfg.continuation_tokens} "
                     "tokens of text after them")


def on_policy_rows(target_dir: Path, prompts: list[list[int]], *, tokens: int, temperature: float,
                   batch_size: int, seed: int) -> list[dict]:
    """The target's own continuations of ``prompts`` (token-id lists) as training rows
    ``{"input_ids": prompt + continuation, "loss_mask": 0 on the prompt, 1 on the continuation}``,
    exactly ``tokens`` sampled tokens each (no stop tokens), as ``demo.stage_sample`` makes them.
    The one place this benchmark makes on-policy data."""
    from dspark_jax.convert.checkpoint import load_target
    from dspark_jax.pipelines.evaluate import timed_decode

    tcfg, tparams = load_target(target_dir)
    results = timed_decode(tcfg, tparams, prompts, max_new_tokens=tokens, temperature=temperature,
                           batch_size=batch_size, seed=seed, warmup=False)
    assert all(len(r.output_ids) == tokens for r in results), tokens
    return [reply_record(p, r.output_ids) for p, r in zip(prompts, results)]


def off_policy_rows(prompts: list[list[int]], records: list[dict]) -> list[dict]:
    """Rows of the real text after each prompt (``records[i]["following_ids"]``), same layout."""
    return [reply_record(p, r["following_ids"]) for p, r in zip(prompts, records)]


def rows_stats(rows: list[dict], tok) -> dict:
    """Trained-token count and the degeneracy of the trained continuations of ``rows``."""
    from dspark_jax import degeneracy

    conts = [[t for t, m in zip(r["input_ids"], r["loss_mask"]) if m] for r in rows]
    return {"rows": len(rows), "trained_tokens": sum(map(len, conts)),
            "tokens": sum(len(r["input_ids"]) for r in rows),
            "degeneracy": degeneracy.summarize(conts, tokenizer=tok)}


def target_fit(tcfg, tparams, rows: list[dict], *, length: int, batch: int = 64) -> dict:
    """How the target itself scores the trained tokens of ``rows``: mean cross-entropy in bits
    per token (``bits_per_token``; on-policy data at T=1 sits near the target's entropy) and the
    share of trained tokens equal to the target's argmax given the true prefix
    (``target_argmax_agreement``, what a drafter for greedy decoding has to predict). One jitted
    forward over [batch, length] padded windows."""
    import jax.numpy as jnp

    from dspark_jax.target import qwen3

    @jax.jit
    def score(params, ids):
        hidden, _, _ = qwen3.forward(params, tcfg, ids)
        logp = jax.nn.log_softmax(qwen3.compute_logits(params, hidden)[:, :-1].astype(jnp.float32), -1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
        return nll, jnp.argmax(logp, -1) == ids[:, 1:]

    nll_sum, agree, count = 0.0, 0, 0
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        ids = np.zeros((batch, length), np.int32)
        mask = np.zeros((batch, length), np.float32)
        for j, r in enumerate(chunk):
            ids[j, :len(r["input_ids"])] = r["input_ids"]
            mask[j, :len(r["loss_mask"])] = r["loss_mask"]
        nll, hit = map(np.asarray, score(tparams, jnp.asarray(ids)))
        m = mask[:, 1:]
        nll_sum += float((nll * m).sum())
        agree += int((hit * m).sum())
        count += int(m.sum())
    return {"bits_per_token": nll_sum / max(count, 1) / np.log(2.0),
            "target_argmax_agreement": agree / max(count, 1), "tokens": count}


# --------------------------------------------------------------------------- train / decode


def train_drafter(cfg: demo.DemoConfig, data: Path, log=print) -> tuple[Path, dict]:
    """Train the demo's DSpark drafter on ``data`` into ``cfg.out``/train/dspark -> (export dir, info)."""
    from dspark_jax.train.loop import train

    tc = demo.train_config(cfg, DRAFTER, progress=False).replace(data=str(data.absolute()))
    before = COMPILES[0]
    s = train(tc, fast_compile=cfg.fast_compile)  # a finished run: its summary.json, nothing retrained
    fin = s.get("final") or {}
    info = {"steps": s["steps"], "wall_s": s["wall_s"], "final_loss": fin.get("loss"),
            "final_expected_accept_length": fin.get("expected_accept_length"),
            "tokens_per_s": s.get("tokens_per_s"), "compiles": COMPILES[0] - before}
    log(f"  train {cfg.out}: loss {info['final_loss']:.4f}, {info['wall_s']:.0f}s")
    return Path(s["export"] or demo.paths(cfg)["export_dspark"]), info


def decode_row(tcfg, tparams, tdir, tok, prompts, *, draft=None, temperature: float,
               cfg: demo.DemoConfig, seed: int) -> dict:
    """The demo's decode settings on ``prompts``; ``decode_summary`` (+ degeneracy, compiles, s)."""
    from dspark_jax.decode.settings import DecodeOptions, resolve
    from dspark_jax.pipelines.evaluate import decode_summary, timed_decode

    options = DecodeOptions(max_new_tokens=cfg.max_new_tokens, temperature=temperature,
                            batch_size=cfg.decode_batch_size, seed=seed, raw_prompt=True)
    settings = resolve(options, tdir, tokenizer=tok)
    dcfg, dparams = draft if draft is not None else (None, None)
    before, t0 = COMPILES[0], time.time()
    res = timed_decode(tcfg, tparams, prompts, draft_cfg=dcfg, draft_params=dparams,
                       **settings.decode_kwargs(options, speculative=False))
    s = decode_summary(res, dcfg.block_size if dcfg else None, calibration=False, tokenizer=tok)
    s["compiles"] = COMPILES[0] - before
    s["seconds"] = time.time() - t0
    return s


ROW_KEYS = ("tau", "accept_rate", "mean_proposal", "tokens_per_second", "requests", "output_tokens",
            "compiles", "seconds")


def flat(s: dict) -> dict:
    d = s["degeneracy"]
    return dict({k: s.get(k) for k in ROW_KEYS}, num_degenerate=d["num_degenerate"],
                num_outputs=d["num_outputs"], degenerate_fraction=d["degenerate_fraction"],
                whitespace_fraction=d["whitespace_fraction"],
                mean_distinct_ngram_ratio=d["mean_distinct_ngram_ratio"])


# --------------------------------------------------------------------------- report


def summarize(rows: list[dict]) -> dict:
    """{prompts/T: {data: {tau_mean, tau_per_seed, degen, ws}}, ratio on/off}."""
    out = {}
    for ps in PROMPT_SETS:
        for temp in sorted({r["temperature"] for r in rows}, reverse=True):
            key = f"{ps}/T={temp:g}"
            ent = {}
            for data in DATASETS + ("autoregressive",):
                sel = [r for r in rows if r["prompts"] == ps and r["temperature"] == temp and r["data"] == data]
                if not sel:
                    continue
                taus = [r["tau"] for r in sel]
                ent[data] = {"tau_mean": float(np.mean(taus)), "tau_per_seed": taus,
                             "seeds": [r["seed"] for r in sel],
                             "num_degenerate": sum(r["num_degenerate"] for r in sel),
                             "num_outputs": sum(r["num_outputs"] for r in sel),
                             "whitespace_fraction": float(np.mean([r["whitespace_fraction"] for r in sel]))}
            if "on_policy" in ent and "off_policy" in ent:
                on, off = (dict(zip(ent[d]["seeds"], ent[d]["tau_per_seed"])) for d in DATASETS)
                diff = [on[sd] - off[sd] for sd in sorted(on) if sd in off]  # paired by seed
                ent["on_over_off"] = ent["on_policy"]["tau_mean"] / ent["off_policy"]["tau_mean"]
                ent["on_minus_off"] = ent["on_policy"]["tau_mean"] - ent["off_policy"]["tau_mean"]
                ent["on_minus_off_per_seed"] = diff
                ent["on_minus_off_sem"] = (float(np.std(diff, ddof=1) / np.sqrt(len(diff)))
                                           if len(diff) > 1 else None)
            out[key] = ent
    return out


def format_table(summary: dict) -> str:
    head = ["prompts", "T", "data", "tau (mean)", "tau per seed", "degen", "ws", "on/off", "on-off (sem)"]
    lines = []
    for key, ent in summary.items():
        ps, t = key.split("/T=")
        for data in DATASETS + ("autoregressive",):
            if data not in ent:
                continue
            e = ent[data]
            ratio, diff = "", ""
            if data == "on_policy" and "on_over_off" in ent:
                ratio = f"{ent['on_over_off']:.3f}"
                sem = ent["on_minus_off_sem"]
                diff = f"{ent['on_minus_off']:+.3f}" + (f" ({sem:.3f})" if sem is not None else "")
            lines.append([ps, t, data, f"{e['tau_mean']:.3f}", " ".join(f"{x:.3f}" for x in e["tau_per_seed"]),
                          f"{e['num_degenerate']}/{e['num_outputs']}", f"{100 * e['whitespace_fraction']:.0f}%",
                          ratio, diff])
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([fmt(head)] + [fmt(c) for c in lines])


def plot(summary: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = list(summary)
    x = np.arange(len(keys))
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, data in enumerate(DATASETS):
        means = [summary[k].get(data, {}).get("tau_mean", np.nan) for k in keys]
        ax.bar(x + (i - 0.5) * 0.38, means, 0.38, label=data.replace("_", "-"))
        for j, k in enumerate(keys):
            per = summary[k].get(data, {}).get("tau_per_seed", [])
            ax.scatter([x[j] + (i - 0.5) * 0.38] * len(per), per, color="k", s=8, zorder=3)
    ax.set_xticks(x, keys)
    ax.set_ylabel("tau (mean acceptance length)")
    ax.set_ylim(1.0, None)
    ax.legend()
    ax.set_title("DSpark drafter: on-policy vs off-policy training data")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main


def previous_report(out: Path, cfg: demo.DemoConfig) -> dict | None:
    """``out``/data_policy.json of an earlier run with the same config (its seeds are kept), else None."""
    path = out / "data_policy.json"
    if not path.is_file():
        return None
    prev = json.loads(path.read_text())
    return prev if prev.get("config") == cfg.to_dict() else None


def build_config(args) -> demo.DemoConfig:
    base = demo.quick_config(out="", greedy_table=False) if args.smoke else demo.DemoConfig()
    changes = {k: v for k, v in dict(
        num_train_prompts=args.num_train_prompts, continuation_tokens=args.continuation_tokens,
        steps=args.steps, batch_size=args.batch_size, num_eval_prompts=args.num_eval_prompts,
        max_new_tokens=args.max_new_tokens).items() if v is not None}
    return base.replace(**changes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/data_policy", metavar="DIR")
    ap.add_argument("--seeds", default="0", help="drafter seeds (training and decoding), e.g. 0,1,2")
    ap.add_argument("--num-train-prompts", type=int)
    ap.add_argument("--continuation-tokens", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--num-eval-prompts", type=int)
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--smoke", action="store_true", help="the demo's --quick sizes (numbers meaningless)")
    args = ap.parse_args(argv)
    from dspark_jax.convert.checkpoint import load_draft, load_target
    from dspark_jax.tokenizer import encode_prompt, load_tokenizer

    t_all = time.time()
    cfg = build_config(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    work = out / "work"
    tdir = demo.target_dir(cfg)
    tok = load_tokenizer(tdir, required=True)
    tcfg, tparams = load_target(tdir)
    log = lambda m: print(m, file=sys.stderr, flush=True)

    # data: same prompts, same trained-token count per row
    t0 = time.time()
    records = policy_prompts(cfg, tok)
    prompts = [encode_prompt(tok, r["text"], raw=True) for r in records]
    prev = previous_report(out, cfg)
    data_files = {name: work / name / "data" / "train.jsonl" for name in DATASETS}
    if prev is not None and all(f.is_file() for f in data_files.values()):
        log(f"resuming {out / 'data_policy.json'}: datasets from {work}, seeds "
            f"{sorted({r['seed'] for r in prev['rows']})} done already")
        rows = {name: [json.loads(line) for line in f.read_text().splitlines()] for name, f in data_files.items()}
        data_info = prev["data"]
    else:
        if prev is None and list(work.glob("*/seed*")):
            raise SystemExit(f"{work} holds training runs of another configuration; choose another --out")
        prev = None
        before = COMPILES[0]
        rows = {"on_policy": on_policy_rows(tdir, prompts, tokens=cfg.continuation_tokens,
                                            temperature=cfg.sample_temperature,
                                            batch_size=cfg.sample_batch_size, seed=cfg.seed + 1),
                "off_policy": off_policy_rows(prompts, records)}
        data_info = {"sample_seconds": time.time() - t0, "sample_compiles": COMPILES[0] - before,
                     "prompts": len(records), "prompt_tokens": sum(map(len, prompts))}
    for name, rs in rows.items():
        assert [r["input_ids"][:len(p)] for r, p in zip(rs, prompts)] == prompts, name
        if prev is None:
            write_jsonl(data_files[name], rs)
            data_info[name] = rows_stats(rs, tok)
        d = data_info[name]
        if "target_fit" not in d:
            d["target_fit"] = target_fit(tcfg, tparams, rs, length=cfg.max_length)
        log(f"data {name}: {d['rows']} rows, {d['trained_tokens']} trained tokens, "
            f"degenerate {d['degeneracy']['num_degenerate']}/{d['rows']}, "
            f"whitespace {100 * d['degeneracy']['whitespace_fraction']:.0f}%, target "
            f"{d['target_fit']['bits_per_token']:.3f} bits/token, target argmax = token "
            f"{100 * d['target_fit']['target_argmax_agreement']:.1f}%")
    assert data_info["on_policy"]["trained_tokens"] == data_info["off_policy"]["trained_tokens"]

    eval_sets = {"heldout": [encode_prompt(tok, r.text, raw=True) for r in demo.eval_prompts(cfg)],
                 "insample": prompts[:cfg.num_eval_prompts]}
    temps = [temp for _, temp in demo.decode_settings(cfg).values()]  # the demo's: headline (+ greedy)
    results, train_info = [], {}
    per_seed = len(eval_sets) * len(temps) * (len(DATASETS) + 1)
    if prev is not None:  # keep the seeds the previous run finished
        done = {sd for sd in seeds if sum(r["seed"] == sd for r in prev["rows"]) == per_seed}
        results = [r for r in prev["rows"] if r["seed"] in done]
        train_info = {k: v for k, v in prev["train"].items() if int(k.rsplit("seed", 1)[1]) in done}

    def add(seed, data, ps, temp, s):
        r = dict(seed=seed, data=data, prompts=ps, temperature=temp, **flat(s))
        results.append(r)
        log(f"  decode {data} {ps} T={temp:g} seed {seed}: tau {r['tau']:.3f}, degenerate "
            f"{r['num_degenerate']}/{r['num_outputs']}, {r['compiles']} compiles, {r['seconds']:.0f}s")

    def write_report(partial: bool) -> None:
        summary = summarize(results)
        table = format_table(summary)
        steps_tokens = cfg.steps * cfg.batch_size * cfg.continuation_tokens
        head = (f"DSpark drafter, on-policy vs off-policy data: {len(records)} train prompts x "
                f"{cfg.continuation_tokens} trained tokens per row ({data_info['on_policy']['trained_tokens']} per "
                f"dataset), {cfg.steps} steps x batch {cfg.batch_size} (~{steps_tokens} trained tokens seen), seeds "
                f"{sorted({r['seed'] for r in results})}; eval: {len(eval_sets['heldout'])} held-out "
                f"({cfg.eval_dataset}) and {len(eval_sets['insample'])} in-sample prompts, "
                f"{cfg.max_new_tokens} new tokens")
        note = ("degen = outputs with distinct-4-gram ratio < 0.3 (summed over seeds); ws = whitespace share of "
                "generated tokens; on/off = tau(on-policy) / tau(off-policy); "
                "on-off = mean over seeds of the paired difference, (standard error)")
        fit = "; ".join(f"{n}: target {data_info[n]['target_fit']['bits_per_token']:.3f} bits/token, "
                        f"argmax agreement {100 * data_info[n]['target_fit']['target_argmax_agreement']:.1f}%, "
                        f"degenerate {data_info[n]['degeneracy']['num_degenerate']}/{data_info[n]['rows']}"
                        for n in DATASETS)
        text = "\n".join([head, table, note, "training continuations: " + fit])
        print(text, flush=True)
        report = {"partial": partial, "config": cfg.to_dict(), "seeds": sorted({r["seed"] for r in results}), "target": str(tdir),
                  "data": data_info, "train": train_info, "rows": results, "summary": summary, "table": text,
                  "total_compiles": COMPILES[0], "wall_s": time.time() - t_all,
                  "wall_s_all_runs": (prev or {}).get("wall_s_all_runs", (prev or {}).get("wall_s", 0.0))
                  + time.time() - t_all, "devices": str(jax.devices()[0]),
                  "command": "PYTHONPATH=$PWD nice -n 15 python benchmarks/data_policy.py " + " ".join(
                      sys.argv[1:] if argv is None else argv)}
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "data_policy.json", report, indent=1)
        write_text(out / "data_policy.txt", text + "\n")
        png = plot(summary, out / "data_policy.png")
        print(f"wrote {out / 'data_policy.json'}" + (f" and {png}" if png else "")
              + (" (partial)" if partial else ""), flush=True)

    missing = [sd for sd in seeds if not any(r["seed"] == sd for r in results)]
    for seed in missing:
        for ps, pr in eval_sets.items():
            for temp in temps:
                add(seed, "autoregressive", ps, temp,
                    decode_row(tcfg, tparams, tdir, tok, pr, temperature=temp, cfg=cfg, seed=seed))
        for data in DATASETS:
            rcfg = cfg.replace(out=str(work / data / f"seed{seed}"), seed=seed)
            export, info = train_drafter(rcfg, data_files[data], log=log)
            train_info[f"{data}/seed{seed}"] = info
            draft = load_draft(export)
            for ps, pr in eval_sets.items():
                for temp in temps:
                    add(seed, data, ps, temp,
                        decode_row(tcfg, tparams, tdir, tok, pr, draft=draft, temperature=temp, cfg=cfg, seed=seed))
        if seed != missing[-1]:
            write_report(partial=True)
    write_report(partial=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
