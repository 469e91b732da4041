"""The demo pipeline on the embedded default target, one library function per stage.

Stages (each reads the previous stage's files under ``out`` and writes its own atomically,
so any stage can be re-run or resumed on its own, e.g. ``dspark-jax demo --stage train``)::

    sample   data/prompts.jsonl, data/train.jsonl
             prompts cut from the standard library's TRAIN files (never the held-out
             ones), continued by the target itself; loss_mask 1 on the continuation only
    train    train/<name>/ (a ``dspark_jax.train`` run: export/ is the PyTorch-format drafter)
             for name in (dspark, dflash): same data, steps, batch, learning rate and seed;
             dflash has markov_rank 0 (no Markov head), dspark a vanilla Markov head;
             both have a confidence head (dspark's reads the previous token)
    decode   decode/<mode>.jsonl for mode in (autoregressive, dflash, dspark): the packaged
             ``stdlib-heldout`` prompts (held-out standard-library files), same prompts,
             max_new_tokens and temperature (1.0, the paper's setting: the headline); with
             ``greedy_table`` also decode/greedy/<mode>.jsonl at temperature 0 (both lossless);
             timed after a warm-up (no compilation)
    report   report.json, table.txt, acceptance.png, reliability_<name>.png, tb/: per mode
             tau, accept@k, verify rate, speedup and degeneracy (outputs with distinct-4-gram
             ratio < 0.3, whitespace share of generated tokens; ``dspark_jax.degeneracy``),
             plus ``num_samples`` continuations with each round's accepted draft span marked

``run_demo(cfg)`` runs the stages that are not done yet. A finished demo (report.json
present) is refused unless ``force``; a different config in an existing ``demo.json`` too.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dspark_jax.errors import ConfigError, InputError, require_positive_int
from dspark_jax.fileio import write_jsonl, write_text
from dspark_jax.pipelines import demo_report

STAGES = ("sample", "train", "decode", "report")
DRAFTERS = ("dspark", "dflash")
MODES = ("autoregressive", "dflash", "dspark")
CONFIG_FILE = "demo.json"
REPORT_FILE = "report.json"


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Every knob of the demo. Sizes: prompts are ``prompt_min_bytes..prompt_max_bytes`` UTF-8
    bytes of whole lines; training rows are prompt + ``continuation_tokens`` (<= max_length)."""

    out: str = "runs/demo"
    target: str = ""                 # "" = the embedded default target
    # sample
    num_train_prompts: int = 512
    prompt_min_bytes: int = 32
    prompt_max_bytes: int = 95
    continuation_tokens: int = 96
    sample_temperature: float = 1.0
    sample_batch_size: int = 64
    # train (identical for both drafters)
    steps: int = 200
    batch_size: int = 8
    learning_rate: float = 6e-3
    warmup_ratio: float = 0.04
    max_length: int = 192
    num_draft_layers: int = 1
    block_size: int = 7
    num_anchors: int = 24
    markov_rank: int = 256           # rank 128: DSpark/DFlash tau 1.14 / 1.12 at T=1 (seeds 0 / 1); 256: 1.15 / 1.22
    markov_head_type: str = "vanilla"
    fast_compile: bool = False
    # decode
    eval_dataset: str = "stdlib-heldout"
    num_eval_prompts: int = 50
    max_new_tokens: int = 96
    temperature: float = 1.0         # the headline table (the reference's evaluation default)
    greedy_table: bool = True        # a second table at temperature 0 (skipped when temperature is 0)
    num_samples: int = 3             # continuations shown in the report, round spans marked
    decode_batch_size: int = 1
    seed: int = 0

    def __post_init__(self):
        def req(cond, msg):
            if not cond:
                raise ConfigError(f"DemoConfig.{msg}")
        for name in ("num_train_prompts", "prompt_min_bytes", "prompt_max_bytes", "continuation_tokens",
                     "sample_batch_size", "steps", "batch_size", "max_length", "num_draft_layers",
                     "block_size", "num_anchors", "num_eval_prompts", "max_new_tokens",
                     "decode_batch_size"):
            require_positive_int(getattr(self, name), f"DemoConfig.{name}", ConfigError)
        req(isinstance(self.num_samples, int) and self.num_samples >= 0,
            f"num_samples must be an int >= 0, got {self.num_samples!r}")
        req(isinstance(self.markov_rank, int) and self.markov_rank > 0,
            f"markov_rank must be > 0 (the DSpark drafter has a Markov head), got {self.markov_rank!r}")
        req(self.prompt_min_bytes <= self.prompt_max_bytes,
            f"prompt_min_bytes={self.prompt_min_bytes} exceeds prompt_max_bytes={self.prompt_max_bytes}")
        req(self.prompt_max_bytes + 1 + self.continuation_tokens <= self.max_length,
            f"max_length={self.max_length} is shorter than <|bos|> + prompt_max_bytes "
            f"({self.prompt_max_bytes}) + continuation_tokens ({self.continuation_tokens})")
        req(self.num_train_prompts >= self.batch_size,
            f"num_train_prompts={self.num_train_prompts} is fewer than one batch ({self.batch_size})")
        for name in ("sample_temperature", "temperature"):
            v = getattr(self, name)
            req(isinstance(v, (int, float)) and 0 <= v < float("inf"), f"{name} must be a number >= 0, got {v!r}")
        req(0 <= self.warmup_ratio < 1, f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        req(self.learning_rate > 0, f"learning_rate={self.learning_rate} must be > 0")

    def replace(self, **changes) -> "DemoConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def recipe(self) -> dict:
        """The fields that determine the results (everything but ``out``)."""
        d = self.to_dict()
        d.pop("out")
        return d


def quick_config(out: str = "runs/demo-quick", **changes) -> DemoConfig:
    """An end-to-end run at tiny sizes for tests and smoke checks (numbers are meaningless; about
    77 s of CPU time, mostly compilation)."""
    base = dict(out=out, num_train_prompts=16, prompt_min_bytes=16, prompt_max_bytes=48,
                continuation_tokens=16, sample_batch_size=16, steps=3, batch_size=8, max_length=80,
                num_draft_layers=1, block_size=4, num_anchors=4, markov_rank=16, fast_compile=True,
                num_eval_prompts=3, max_new_tokens=12)
    base.update(changes)
    return DemoConfig(**base)


# --------------------------------------------------------------------------- paths / status


def paths(cfg: DemoConfig) -> dict[str, Path]:
    out = Path(cfg.out)
    p = {"out": out, "config": out / CONFIG_FILE, "prompts": out / "data" / "prompts.jsonl",
         "train_data": out / "data" / "train.jsonl", "report": out / REPORT_FILE,
         "table": out / "table.txt", "acceptance_png": out / "acceptance.png", "tb": out / "tb"}
    for name in DRAFTERS:
        p[f"run_{name}"] = out / "train" / name
        p[f"export_{name}"] = out / "train" / name / "export"
        p[f"train_config_{name}"] = out / "train" / f"{name}_config.py"
    for mode in MODES:
        p[f"decode_{mode}"] = out / "decode" / f"{mode}.jsonl"
        p[f"decode_greedy_{mode}"] = out / "decode" / "greedy" / f"{mode}.jsonl"
    return p


def decode_settings(cfg: DemoConfig) -> dict[str, tuple[str, float]]:
    """{table name: (paths() key prefix, temperature)}: "headline" at ``cfg.temperature``,
    "greedy" at 0 when ``cfg.greedy_table`` and the headline is not greedy already."""
    out = {"headline": ("decode_", float(cfg.temperature))}
    if cfg.greedy_table and cfg.temperature != 0:
        out["greedy"] = ("decode_greedy_", 0.0)
    return out


def stage_done(cfg: DemoConfig, stage: str) -> bool:
    p = paths(cfg)
    if stage == "sample":
        return p["train_data"].is_file() and p["prompts"].is_file()
    if stage == "train":
        return all((p[f"export_{n}"] / "config.json").is_file() and (p[f"run_{n}"] / "summary.json").is_file()
                   for n in DRAFTERS)
    if stage == "decode":
        return all(p[f"{pre}{m}"].is_file() for pre, _ in decode_settings(cfg).values() for m in MODES)
    if stage == "report":
        return p["report"].is_file()
    raise InputError(f"unknown demo stage {stage!r}; expected one of {STAGES}")


def target_dir(cfg: DemoConfig) -> Path:
    """The target checkpoint of the demo (the embedded default unless ``cfg.target``)."""
    if cfg.target:
        d = Path(cfg.target)
        if not d.is_dir():
            raise InputError(f"target {str(d)!r} is not a directory")
        return d
    from dspark_jax.embedded.default import default_target_dir
    return default_target_dir()


def prepare_out(cfg: DemoConfig, *, force: bool = False, stage: str = "all") -> Path:
    """Create ``cfg.out`` and its ``demo.json``; refuse a finished demo (``stage='all'``) or a
    different recipe unless ``force``, which (for ``stage='all'``) clears the old demo first."""
    p = paths(cfg)
    out = p["out"]
    from dspark_jax.convert.checkpoint import load_target
    from dspark_jax.convert.identity import target_identity
    identity = target_identity(*load_target(target_dir(cfg)))
    if p["config"].is_file():
        old = json.loads(p["config"].read_text())
        same = old.get("recipe") == cfg.recipe()
        if stage == "all" and force:
            shutil.rmtree(out)
        elif not any(stage_done(cfg, s) for s in STAGES):
            shutil.rmtree(out)  # an attempt that finished no stage (e.g. a bad --target): start over
        elif not same:
            raise InputError(f"{out} holds a demo with a different configuration ({p['config']}); "
                             "pass --force to replace it or choose another --out")
        elif old.get("target_sha256") != identity:
            raise InputError(f"{out} was made with different target weights (model.safetensors changed "
                             "since); pass --force to start over or choose another --out")
        elif stage == "all" and stage_done(cfg, "report"):
            raise InputError(f"{out} holds a finished demo ({p['report']}); pass --force to run it "
                             "again or choose another --out")
    elif out.exists() and any(out.iterdir()):
        raise InputError(f"--out {str(out)!r} exists and is not a demo directory (no {CONFIG_FILE}); "
                         "choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    if not p["config"].is_file():
        from dspark_jax.pipelines.evaluate import write_json_atomic
        write_json_atomic(p["config"], {"recipe": cfg.recipe(), "out": str(out), "target_sha256": identity})
    return out


def _require(cfg: DemoConfig, stage: str, needs: str) -> None:
    if not stage_done(cfg, needs):
        raise InputError(f"demo stage {stage!r} needs the {needs!r} stage's outputs in {cfg.out}; "
                         f"run `dspark-jax demo --out {cfg.out} --stage {needs}` first")


# --------------------------------------------------------------------------- sample


def train_prompt_texts(count: int, *, min_bytes: int, max_bytes: int, seed: int = 0,
                       root: Path | None = None) -> list[dict]:
    """``count`` prompts of whole consecutive lines cut from the standard library's TRAIN
    files (the held-out split of the default target's pretraining is excluded):
    ``[{"text": str, "source": "rel/path.py:LINE"}]``. Deterministic for a seed."""
    from dspark_jax.embedded import corpus, pretrain

    root = Path(root) if root is not None else corpus.stdlib_dir()
    heldout_fraction = pretrain.PretrainConfig().heldout_fraction
    try:
        from dspark_jax.embedded.default import default_metadata
        heldout_fraction = default_metadata().get("pretrain_config", {}).get("heldout_fraction", heldout_fraction)
    except Exception:  # metadata is optional; the default fraction is the recipe's
        pass
    train_files, heldout = corpus.split_files(corpus.stdlib_files(root), heldout_fraction)
    assert not set(train_files) & set(heldout)
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    cache: dict[str, list[str]] = {}
    for _ in range(100 * count):
        if len(out) >= count:
            break
        rel = train_files[int(rng.integers(len(train_files)))]
        if rel not in cache:
            try:
                cache[rel] = (root / rel).read_text(encoding="utf-8").splitlines(keepends=True)
            except (OSError, UnicodeDecodeError):
                cache[rel] = []
        cut = corpus.cut_lines(cache[rel], rng, min_bytes, max_bytes)
        if cut is not None:
            out.append({"text": cut[0], "source": f"{rel}:{cut[1] + 1}"})
    if len(out) < count:
        raise InputError(f"could only cut {len(out)} of {count} training prompts of {min_bytes}..{max_bytes} "
                         f"bytes from {root}")
    return out


def stage_sample(cfg: DemoConfig, *, progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Sample the target's continuations of train-split prompts -> ``data/train.jsonl``
    (``{"input_ids", "loss_mask"}``, loss_mask 1 on the sampled continuation only)."""
    from tqdm import tqdm

    from dspark_jax.convert.checkpoint import load_target
    from dspark_jax.data.sources import reply_record
    from dspark_jax.pipelines.evaluate import timed_decode, write_json_atomic
    from dspark_jax.tokenizer import encode_prompt, load_tokenizer

    p = paths(cfg)
    tdir = target_dir(cfg)
    tok = load_tokenizer(tdir, required=True)
    records = train_prompt_texts(cfg.num_train_prompts, min_bytes=cfg.prompt_min_bytes,
                                 max_bytes=cfg.prompt_max_bytes, seed=cfg.seed)
    prompts = [encode_prompt(tok, r["text"], raw=True) for r in records]  # the target's pretraining text
    tcfg, tparams = load_target(tdir)
    t0 = time.time()
    with tqdm(total=len(prompts), desc="sample", unit="prompt", disable=not progress) as bar:
        # no stop tokens: every row gets exactly continuation_tokens sampled tokens
        results = timed_decode(tcfg, tparams, prompts, max_new_tokens=cfg.continuation_tokens,
                               temperature=cfg.sample_temperature, batch_size=cfg.sample_batch_size,
                               seed=cfg.seed + 1, warmup=False, progress=bar.update)
    p["train_data"].parent.mkdir(parents=True, exist_ok=True)
    lines = [reply_record(prompt, res.output_ids) for prompt, res in zip(prompts, results)]
    cont = sum(len(res.output_ids) for res in results)
    write_jsonl(p["prompts"], records)
    write_jsonl(p["train_data"], lines)
    info = {"sequences": len(lines), "continuation_tokens": cont, "seconds": round(time.time() - t0, 1),
            "temperature": cfg.sample_temperature, "file": str(p["train_data"])}
    write_json_atomic(p["out"] / "data" / "sample.json", info)
    log(f"sample: {len(lines)} sequences, {cont} sampled tokens in {info['seconds']}s -> {p['train_data']}")
    return info


# --------------------------------------------------------------------------- train


def drafter_overrides(cfg: DemoConfig, name: str, tcfg) -> dict:
    """DraftConfig overrides of drafter ``name`` ("dspark" or "dflash") for target ``tcfg``."""
    from dspark_jax.tokenizer import load_tokenizer

    if name not in DRAFTERS:
        raise InputError(f"unknown demo drafter {name!r}; expected one of {DRAFTERS}")
    tok = load_tokenizer(target_dir(cfg), required=True)
    if getattr(tok, "mask_token_id", None) is None:
        raise ConfigError(f"the tokenizer of target {str(target_dir(cfg))!r} has no mask token; the "
                          "drafters need one (mask_token_id)")
    n = tcfg.num_hidden_layers
    layers = tuple(range(0, n - 1)) if n <= 4 else tuple(np.linspace(0, n - 2, 4).round().astype(int).tolist())
    base = dict(num_hidden_layers=cfg.num_draft_layers, block_size=cfg.block_size,
                target_layer_ids=layers, mask_token_id=int(tok.mask_token_id), num_anchors=cfg.num_anchors,
                enable_confidence_head=True)
    if name == "dspark":
        return dict(base, markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                    confidence_head_with_markov=True)
    return dict(base, markov_rank=0, confidence_head_with_markov=False)


def train_config(cfg: DemoConfig, name: str, *, progress: bool = True):
    """The ``TrainConfig`` of drafter ``name`` (same budget for both drafters)."""
    from dspark_jax.config import TargetConfig
    from dspark_jax.train.config import TrainConfig

    p = paths(cfg)
    tdir = target_dir(cfg)
    tcfg = TargetConfig.from_hf(json.loads((tdir / "config.json").read_text()))
    return TrainConfig(
        target=str(tdir.absolute()), data=str(p["train_data"].absolute()),
        output_dir=str(p[f"run_{name}"].absolute()), draft=drafter_overrides(cfg, name, tcfg),
        features="online", max_length=cfg.max_length, batch_size=cfg.batch_size, steps=cfg.steps,
        optimizer=dict(learning_rate=cfg.learning_rate, warmup_ratio=cfg.warmup_ratio), compute_dtype="float32",
        mesh="data=1", num_devices=1, seed=cfg.seed, checkpoint=dict(every=max(cfg.steps // 2, 1), keep=1),
        progress=progress)


def write_train_config_file(cfg: DemoConfig, name: str) -> Path:
    """``train/<name>_config.py``: the same run for ``dspark-jax train --config FILE``."""
    tc = train_config(cfg, name, progress=True)
    fields = {k: v for k, v in tc.to_dict(changed_only=True).items() if k != "progress"}
    body = ",\n".join(f"    {k}={v!r}" for k, v in fields.items())
    path = paths(cfg)[f"train_config_{name}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (f'"""The demo\'s {name} drafter run: dspark-jax train --config {path}"""\n\n'
            f"CONFIG = dict(\n{body},\n)\n")
    write_text(path, text)
    return path


def stage_train(cfg: DemoConfig, *, names=DRAFTERS, progress: bool = True,
                log: Callable[[str], None] = print) -> dict:
    """Train the drafters ``names`` (skipping finished ones) -> ``train/<name>/export``."""
    from dspark_jax.train.loop import train

    _require(cfg, "train", "sample")
    p = paths(cfg)
    out = {}
    for name in names:
        cfg_file = write_train_config_file(cfg, name)
        summary_file = p[f"run_{name}"] / "summary.json"
        if summary_file.is_file() and (p[f"export_{name}"] / "config.json").is_file():
            log(f"train {name}: done already ({p[f'export_{name}']})")
            out[name] = json.loads(summary_file.read_text())
            continue
        log(f"train {name}: {cfg.steps} steps (same as `dspark-jax train --config {cfg_file}`)")
        summary = train(train_config(cfg, name, progress=progress), fast_compile=cfg.fast_compile)
        out[name] = {k: v for k, v in summary.items() if k not in ("history", "params")}
        fin = out[name].get("final") or {}
        log(f"train {name}: loss {fin.get('loss', float('nan')):.4f}, expected accept length "
            f"{fin.get('expected_accept_length', float('nan')):.3f} (a training-batch estimate at "
            f"T=1; the decode tables' tau is measured on held-out prompts and is usually lower), "
            f"{summary['wall_s']:.0f}s")
    return out


# --------------------------------------------------------------------------- decode


def eval_prompts(cfg: DemoConfig):
    """The held-out prompts of the demo (``EvalPrompt`` list)."""
    from dspark_jax.data.eval_datasets import load_dataset
    return load_dataset(cfg.eval_dataset, max_samples=cfg.num_eval_prompts)


def stage_decode(cfg: DemoConfig, *, modes=MODES, progress: bool = True,
                 log: Callable[[str], None] = print) -> dict:
    """Decode the held-out prompts with each mode at each temperature of ``decode_settings``
    -> ``decode/<mode>.jsonl`` (headline) and ``decode/greedy/<mode>.jsonl``.
    Returns {table: {mode: summary}}."""
    from tqdm import tqdm

    from dspark_jax.convert.checkpoint import load_draft, load_target
    from dspark_jax.decode.settings import DecodeOptions, resolve
    from dspark_jax.pipelines.evaluate import decode_summary, timed_decode, write_results_jsonl
    from dspark_jax.tokenizer import encode_prompt, load_tokenizer

    _require(cfg, "decode", "train")
    p = paths(cfg)
    tdir = target_dir(cfg)
    tok = load_tokenizer(tdir, required=True)
    records = eval_prompts(cfg)
    tcfg, tparams = load_target(tdir)
    drafts = {m: load_draft(p[f"export_{m}"]) for m in modes if m != "autoregressive"}
    extra = [{"dataset": r.dataset, "index": r.index, "line": r.line} for r in records]
    out: dict[str, dict] = {}
    for table, (prefix, temperature) in decode_settings(cfg).items():
        options = DecodeOptions(max_new_tokens=cfg.max_new_tokens, temperature=temperature,
                                batch_size=cfg.decode_batch_size, seed=cfg.seed, raw_prompt=True)
        prompts = [encode_prompt(tok, r.text, raw=options.raw_prompt) for r in records]
        settings = resolve(options, tdir, tokenizer=tok)
        out[table] = {}
        for mode in modes:
            dcfg, dparams = drafts.get(mode, (None, None))
            with tqdm(total=len(prompts), desc=f"decode {mode} T={temperature:g}", unit="prompt",
                      disable=not progress) as bar:
                results = timed_decode(tcfg, tparams, prompts, draft_cfg=dcfg, draft_params=dparams,
                                       progress=bar.update,
                                       **settings.decode_kwargs(options, speculative=False))
            write_results_jsonl(p[f"{prefix}{mode}"], results, extra)
            s = decode_summary(results, dcfg.block_size if dcfg else None, calibration=False)
            out[table][mode] = s
            log(f"decode {mode} (temperature {temperature:g}): tau {s['tau']:.3f}, "
                f"{s['tokens_per_second']:.1f} tokens/s")
    return out


# --------------------------------------------------------------------------- report


def stage_report(cfg: DemoConfig, *, log: Callable[[str], None] = print) -> dict:
    """The tables (stdout, table.txt), sample continuations, report.json, acceptance.png,
    reliability_<name>.png, tb/."""
    from dspark_jax.convert.checkpoint import load_draft
    from dspark_jax.pipelines.evaluate import (DEGENERACY_NOTE, format_table, plot_acceptance, plot_reliability,
                                     read_results_jsonl, tensorboard_scalars, write_json_atomic)
    from dspark_jax.tokenizer import load_tokenizer

    _require(cfg, "report", "decode")
    p = paths(cfg)
    tdir = target_dir(cfg)
    tok = load_tokenizer(tdir, required=True)
    block = {m: load_draft(p[f"export_{m}"])[0].block_size for m in DRAFTERS}
    settings = decode_settings(cfg)
    results = {t: {m: read_results_jsonl(p[f"{pre}{m}"]) for m in MODES} for t, (pre, _) in settings.items()}
    tables = {t: demo_report.summary_rows(results[t], block, tok) for t in settings}
    rows = tables["headline"]
    lossless = "greedy" if "greedy" in tables else "headline"
    ar_out = [r.output_ids for r in results[lossless]["autoregressive"]]
    agree = {m: float(np.mean([a == r.output_ids for a, r in zip(ar_out, results[lossless][m])]))
             for m in DRAFTERS}
    max_k = max(block.values())
    titles = {t: (f"temperature {temp:g}" + (" (headline, the paper's setting; lossless sampling)"
                                               if t == "headline" and temp > 0 else
                                               " (greedy; lossless: outputs equal the target's)"))
              for t, (_, temp) in settings.items()}
    text_tables = [f"{titles[t]}: {cfg.eval_dataset}, {rows['autoregressive']['requests']} held-out prompts, "
                   f"{cfg.max_new_tokens} new tokens\n" + format_table(tables[t], max_k=max_k, baseline="autoregressive")
                   for t in settings]
    detok = lambda ids: tok.decode(list(ids), skip_special_tokens=True)
    records = eval_prompts(cfg)
    samples = demo_report.sample_continuations(cfg.num_samples, results["headline"]["dspark"], records, detok)
    files = {"table": str(p["table"]),
             "acceptance_png": str(plot_acceptance({m: rows[m] for m in DRAFTERS}, p["acceptance_png"],
                                                   title=f"held-out prompts ({cfg.eval_dataset})",
                                                   temperature=cfg.temperature,
                                                   results=results["headline"]))}
    for m in DRAFTERS:
        rel = plot_reliability(results["headline"][m], p["out"] / f"reliability_{m}.png",
                               title=f"{m}: confidence (temperature {cfg.temperature:g})")
        if rel is not None:
            files[f"reliability_{m}"] = str(rel)
    tensorboard_scalars(p["tb"], rows)
    files["tensorboard"] = str(p["tb"])
    commands = reproduce_commands(cfg, tdir)
    ratio = rows["dspark"]["tau"] / rows["dflash"]["tau"] if rows["dflash"]["tau"] else None
    report = {
        "temperature": cfg.temperature,
        "table": demo_report.table_json(rows),
        "details": rows,
        "dspark_tau_minus_dflash_tau": rows["dspark"]["tau"] - rows["dflash"]["tau"],
        "dspark_tau_over_dflash_tau": ratio,
        "outputs_equal_to_autoregressive": agree,
        "outputs_equal_to_autoregressive_table": lossless,
        "samples": samples,
        "train": demo_report.train_info({m: p[f"run_{m}"] / "summary.json" for m in DRAFTERS}),
        "config": cfg.to_dict(),
        "target": str(tdir),
        "commands": commands,
        "files": files,
    }
    if "greedy" in tables:
        report["table_greedy"] = demo_report.table_json(tables["greedy"])
        report["details_greedy"] = tables["greedy"]
    summary_line = demo_report.summary_line(ratio, report["dspark_tau_minus_dflash_tau"], agree, cfg.temperature,
                                            lossless == "greedy" or cfg.temperature == 0)
    text = "\n\n".join(text_tables + [DEGENERACY_NOTE, summary_line,
                                      demo_report.format_samples(samples, cfg.temperature)])
    write_text(p["table"], text.rstrip("\n") + "\n")
    write_json_atomic(p["report"], report)
    log(text)
    return report


def reproduce_commands(cfg: DemoConfig, tdir: Path) -> dict[str, str]:
    """Equivalent stand-alone commands for each stage."""
    p = paths(cfg)
    out = {f"stage_{s}": f"dspark-jax demo --out {cfg.out} --stage {s}" for s in STAGES}
    for m in DRAFTERS:
        out[f"train_{m}"] = f"dspark-jax train --config {p[f'train_config_{m}']}"
        out[f"eval_{m}"] = (f"dspark-jax eval --target {tdir} --draft {p[f'export_{m}']} "
                            f"--datasets {cfg.eval_dataset} --max-samples {cfg.num_eval_prompts} "
                            f"--max-new-tokens {cfg.max_new_tokens} --temperature {cfg.temperature} "
                            f"--raw-prompt --baseline --out {p['out'] / ('eval_' + m)}")
    return out


# --------------------------------------------------------------------------- all


def run_demo(cfg: DemoConfig, *, stage: str = "all", force: bool = False, progress: bool = True,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``stage`` ("all" or one of STAGES). "all" skips finished stages (resume); a single
    stage re-runs only when ``force`` or not yet done. Returns {stage: info} and ``wall_s``."""
    if stage != "all" and stage not in STAGES:
        raise InputError(f"unknown demo stage {stage!r}; expected 'all' or one of {STAGES}")
    t0 = time.time()
    prepare_out(cfg, force=force, stage=stage)
    fns = {"sample": stage_sample, "train": stage_train, "decode": stage_decode, "report": stage_report}
    todo = STAGES if stage == "all" else (stage,)
    info: dict[str, Any] = {}
    for s in todo:
        if stage_done(cfg, s) and not (force and stage != "all"):
            log(f"{s}: done already (outputs in {cfg.out}); skipping")
            continue
        if force and stage != "all" and s == "train":
            for name in DRAFTERS:
                shutil.rmtree(paths(cfg)[f"run_{name}"], ignore_errors=True)
        kwargs = {"log": log} if s == "report" else {"log": log, "progress": progress}
        ts = time.time()
        info[s] = fns[s](cfg, **kwargs)
        info[f"{s}_seconds"] = time.time() - ts
    info["wall_s"] = time.time() - t0
    return info
