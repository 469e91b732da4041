"""The training loop: data, sharded state, jitted step, orbax checkpoints, metrics, export.

``train(cfg)`` runs (or resumes) a whole run in ``cfg.output_dir``::

    output_dir/
      run.json             train + drafter config of this run (resume checks it)
      checkpoints/<step>/  orbax: {"state": TrainState, "data": grain iterator state}
      metrics.jsonl        one JSON object per step (process 0)
      tb/                  TensorBoard events (process 0)
      export/              the drafter in the PyTorch (HF) format at the end
      summary.json         the final summary (also returned)

It is four steps: ``setup`` (target, drafter, data, mesh, the train program of
``train/program.py``, run directory), ``restore_or_init`` (newest checkpoint or fresh
state), ``iterate`` (the steps, metrics and checkpoints) and ``export``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from tqdm import tqdm

from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.convert import checkpoint as ckpt_io
from dspark_jax.convert import engines
from dspark_jax.convert.identity import target_identity
from dspark_jax.data import chat, pipeline, reference_cache, sources
from dspark_jax import families, interrupt
from dspark_jax.errors import CheckpointError, ConfigError, DSparkError, InputError
from dspark_jax.pairing import check_pair_paths, stored_config
from dspark_jax.fileio import atomic_open, check_output, dumps, mark_dir, write_json
from dspark_jax.tokenizer import load_tokenizer
from dspark_jax.train import optim
from dspark_jax.train.config import TrainConfig
from dspark_jax.train.program import Program, build_program, make_train_mesh

# Testing hooks (environment, never the user's config): DSPARK_FAST_COMPILE=1 compiles the step
# with FAST_COMPILE_OPTIONS; DSPARK_KILL_AT_STEP=N SIGKILLs the process once step N's checkpoint
# is saved (the resume test).
FAST_COMPILE_ENV = "DSPARK_FAST_COMPILE"
KILL_AT_STEP_ENV = "DSPARK_KILL_AT_STEP"


class NonFiniteLossError(DSparkError):
    """The loss or gradient became NaN/inf; training stopped, the last checkpoint is kept."""


@dataclasses.dataclass
class Run:
    """Everything ``setup`` prepares: configs, data, the program and the device-side frozen
    weights. ``rows`` is (start, count) of the batch rows (dim 1) this process feeds."""

    cfg: TrainConfig
    out: Path
    draft_cfg: DraftConfig
    target_cfg: TargetConfig
    source: Any
    total_steps: int
    epochs: int
    program: Program
    trainable: dict
    frozen: Any
    target: Any
    rows: tuple[int, int]
    is_main: bool = dataclasses.field(default_factory=lambda: jax.process_index() == 0)


def _put(tree, shardings):
    """Host (numpy/jax) tree -> global arrays with ``shardings`` (works across processes)."""
    def one(x, sh):
        x = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])
    return jax.tree.map(one, tree, shardings)


def _local_rows(sharding, global_shape) -> tuple[int, int]:
    """(start, count) of dim-1 rows this process holds."""
    spans = [idx[1] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    starts = [s.start or 0 for s in spans]
    stops = [global_shape[1] if s.stop is None else s.stop for s in spans]
    return min(starts), max(stops) - min(starts)


def load_source(cfg: TrainConfig, target_cfg, draft_cfg, target_params):
    """The dataset of this run (validated before anything compiles)."""
    if cfg.features == "cache":
        # ours (``dspark-jax cache``) or the reference's v2 cache, whichever cache_dir holds
        src = reference_cache.open_feature_cache(cfg.cache_dir, cfg.max_length, cfg.overlong)
        src.validate(draft_cfg, target_cfg, target_identity(target_cfg, target_params))
        return src
    if cfg.data_format == "chat":
        tok = load_tokenizer(cfg.tokenizer or cfg.target, required=True)
        return chat.read_chat_jsonl(cfg.data, tok, cfg.max_length, cfg.overlong,
                                    thinking=cfg.chat_thinking, vocab_size=target_cfg.vocab_size)
    return sources.read_token_jsonl(cfg.data, cfg.max_length, target_cfg.vocab_size, cfg.overlong)


def load_drafter(cfg: TrainConfig, target_cfg: TargetConfig, target_params) -> tuple[DraftConfig, dict]:
    """(config, params) of the drafter to train: ``draft_init`` or a fresh one sharing the
    target's embedding and LM head."""
    if cfg.draft_init:  # (a V4 checkpoint's own module shares target_params' embedding and head)
        draft_cfg, params = ckpt_io.load_draft(cfg.draft_init, target_params=target_params)
        families.check_pair(draft_cfg, target_cfg)
        draft_cfg.check_compatible(target_cfg)
        return draft_cfg, params
    draft_cfg = cfg.draft_config(target_cfg)
    params = families.init_params(draft_cfg, jax.random.PRNGKey(cfg.seed),
                                  **families.shared_with_target(draft_cfg, target_cfg, target_params))
    return draft_cfg, params


def _step_counts(cfg: TrainConfig, num_sequences: int) -> tuple[int, int]:
    """(total optimizer steps, epochs the data pipeline must cover)."""
    spe = pipeline.steps_per_epoch(num_sequences, cfg.batch_size)
    if spe == 0:
        raise ConfigError(f"the dataset has {num_sequences} sequences, fewer than batch_size={cfg.batch_size}")
    total = cfg.steps or cfg.epochs * spe
    return total, math.ceil(total / spe)


# TrainConfig fields that define a run (a resume that changes one is refused); the others
# (output_dir, progress, log_every, checkpoint.*, memory.*, mesh, num_devices, export_*) may change.
IDENTITY_FIELDS = ("features", "data_format", "max_length", "overlong", "batch_size", "grad_accum",
                   "epochs", "steps", "seed", "compute_dtype", "draft_init", "optimizer", "loss")


def file_identity(path) -> dict:
    """{"path", "size", "sha256"} of a data file (what a resume compares)."""
    import hashlib
    path = Path(path).absolute()
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"path": str(path), "size": path.stat().st_size, "sha256": h.hexdigest()}


def run_identity(cfg: TrainConfig, draft_cfg: DraftConfig, target_id: str, total_steps: int) -> dict:
    """What defines a run: data identity, feature mode, optimizer/loss settings, drafter config,
    target identity (weights sha256) and the step count. Flat {dotted field: value}."""
    d = cfg.to_dict()
    ident = {"target.sha256": target_id, "total_steps": total_steps}
    if cfg.features == "cache":
        ident.update({f"cache.manifest.{k}": v for k, v in
                      file_identity(Path(cfg.cache_dir) / "manifest.json").items()})
    else:
        ident.update({f"data.{k}": v for k, v in file_identity(cfg.data).items()})
        if cfg.data_format == "chat":
            ident["tokenizer"] = str(Path(cfg.tokenizer or cfg.target).absolute())
            if cfg.chat_thinking is not None:
                ident["chat_thinking"] = cfg.chat_thinking
    for name in IDENTITY_FIELDS:
        value = d[name]
        if isinstance(value, dict):
            ident.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            ident[name] = value
    ident.update({f"draft.{k}": v for k, v in draft_cfg.to_hf().items()})
    return json.loads(json.dumps(ident))  # JSON-normalised (tuples -> lists) for comparison


def _has_checkpoints(out: Path) -> bool:
    d = out / "checkpoints"
    return d.is_dir() and any(p.name.isdigit() for p in d.iterdir())


def check_run_dir(out: Path, identity: dict, *, resume: bool, force_resume: bool) -> dict | None:
    """Compare ``out``'s ``run.json`` with this run before anything is written.

    Returns the finished run's summary when ``out`` holds this run finished (nothing to do),
    else None. A run with checkpoints whose identity differs is refused naming the fields
    (ConfigError) unless ``force_resume``; so is a run without ``run.json`` identity.
    """
    if out.exists() and not out.is_dir():
        raise InputError(f"output_dir {str(out)!r} is a file; give a directory")
    run_file, summary_file = out / "run.json", out / "summary.json"
    if not (_has_checkpoints(out) or summary_file.is_file()):
        return None  # nothing of value: a fresh run (or a start that failed before step 1's checkpoint)
    if not resume:
        raise InputError(f"{out} already holds a run; set checkpoint.resume=True to continue it "
                         "or choose another output_dir")
    try:
        old = json.loads(run_file.read_text()).get("identity")
    except (OSError, ValueError):
        old = None
    if not force_resume:
        if old is None:
            raise ConfigError(f"{run_file}: missing or unreadable (or written by an older version), so "
                              "this run cannot be checked against it; pass --force-resume to continue it "
                              "anyway or choose another output_dir")
        diff = [k for k in sorted(set(old) | set(identity)) if old.get(k) != identity.get(k)]
        if diff:
            shown = ", ".join(f"{k} ({old.get(k)!r} -> {identity.get(k)!r})" for k in diff[:6])
            more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
            raise ConfigError(f"{out} holds a run that differs in {shown}{more}; pass --force-resume "
                              "to continue it anyway or choose another output_dir")
    if summary_file.is_file():
        try:
            summary = json.loads(summary_file.read_text())
        except ValueError:
            summary = {}
        final = summary.get("final")
        if final and final.get("step") == identity["total_steps"]:
            return summary
    return None


def _write_run_record(out: Path, record: dict, is_main: bool) -> None:
    """``run.json`` (atomic, process 0)."""
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        mark_dir(out, "train")
        write_json(out / "run.json", record, indent=1)


def setup(cfg: TrainConfig, *, fast_compile: bool = False, force_resume: bool = False) -> Run:
    """Load target, drafter and data, check the run directory, build the train program, place
    the frozen weights, and write ``run.json``. A finished run raises ``RunFinished``."""
    inputs = ({f: getattr(cfg, f) for f in ("target", "draft_init", "data", "tokenizer")}
              | {"cache_dir": cfg.cache_dir if cfg.features == "cache" else None})
    check_output(cfg.output_dir, kind="dir", flag="output_dir", marker=("run.json", "checkpoints"),
                 inputs=inputs, reuse=True)
    if cfg.export_dir:  # replaced at the end of the run: never an input, a folder of ours
        check_output(cfg.export_dir, kind="dir", flag="export_dir", force=True, inputs=inputs)
    if cfg.draft_init and Path(cfg.target).is_dir():  # before the target's weights are read
        check_pair_paths(cfg.target, cfg.draft_init, target_flag="target", draft_flag="draft_init")
    target_cfg, target_params = ckpt_io.load_target(cfg.target)
    planned = stored_config(cfg.draft_init, "draft") if cfg.draft_init else cfg.draft_config(target_cfg)
    source = load_source(cfg, target_cfg, planned, target_params)  # the data, before the drafter's init
    sources.check_trainable(source, cfg.max_length, what=f"data {cfg.data!r}")
    draft_cfg, params = load_drafter(cfg, target_cfg, target_params)
    if jax.process_index() == 0:
        for line in engines.serving_warnings(draft_cfg, cfg.serve_engines):
            print(f"warning: this drafter {line}", file=sys.stderr)
    total_steps, epochs = _step_counts(cfg, len(source))
    out = Path(cfg.output_dir).absolute()
    identity = run_identity(cfg, draft_cfg, target_identity(target_cfg, target_params), total_steps)
    finished = check_run_dir(out, identity, resume=cfg.checkpoint.resume, force_resume=force_resume)
    if finished is not None:
        raise RunFinished(out, finished)
    mesh = make_train_mesh(cfg)
    trainable, frozen = optim.split_params(params, draft_cfg)
    example = source[0]
    program = build_program(draft_cfg, target_cfg, cfg, mesh, total_steps=total_steps,
                            weights_dtype=families.lm_head_kernel(target_cfg, target_params).dtype,
                            feature_dtype=example["features"].dtype if "features" in example else np.float32,
                            fast_compile=fast_compile)
    target = _put(target_params, program.target_sharding) if program.online else None
    ids = program.batch["input_ids"]
    run = Run(cfg, out, draft_cfg, target_cfg, source, total_steps, epochs,
              program, trainable, _put(frozen, program.frozen_sharding), target,
              _local_rows(ids.sharding, ids.shape))
    record = {"identity": identity, "train": cfg.to_dict(), "draft": draft_cfg.to_hf(),
              "total_steps": total_steps}
    _write_run_record(run.out, record, run.is_main)
    return run


class RunFinished(Exception):
    """``output_dir`` holds this run, finished: nothing to do (``summary`` is its summary.json)."""

    def __init__(self, out: Path, summary: dict):
        super().__init__(f"{out} holds this run, finished at step {summary['final']['step']} "
                         f"(summary.json); nothing to do. Choose another output_dir to train again")
        self.out, self.summary = out, summary


def make_data_iterator(run: Run):
    """grain iterator over this process's rows of each step's batch (checkpointable)."""
    cfg = run.cfg
    start, count = run.rows
    dataset = pipeline.make_dataset(run.source, global_batch=cfg.batch_size, grad_accum=cfg.grad_accum,
                                    seed=cfg.seed, epochs=run.epochs, row_start=start, row_count=count)
    return iter(dataset)


def checkpoint_manager(run: Run) -> ocp.CheckpointManager:
    ck = run.cfg.checkpoint
    return ocp.CheckpointManager(
        run.out / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=ck.keep or None, enable_async_checkpointing=ck.async_save,
                                             create=True))


def restore_or_init(run: Run, mgr: ocp.CheckpointManager, data_iter):
    """(state, first step): the newest checkpoint (state + data position) or a fresh state."""
    latest = mgr.latest_step()
    if latest is None:
        return run.program.init_state(_put(run.trainable, run.program.state_sharding.params)), 0
    if not run.cfg.checkpoint.resume:
        raise InputError(f"{run.out / 'checkpoints'} already holds checkpoints (newest {latest}); "
                         "set checkpoint.resume=True to continue that run or choose another output_dir")
    try:
        restored = mgr.restore(latest, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(run.program.state),
            data=grain.checkpoint.CheckpointRestore(data_iter)))
    except Exception as e:
        raise CheckpointError(f"cannot restore checkpoint {run.out / 'checkpoints' / str(latest)}: {e}") from e
    state = restored["state"]
    return state, int(jax.device_get(state.step))


def _device_batch(run: Run, host: dict) -> dict:
    """This process's rows of one step (numpy) -> global arrays with the program's batch shardings."""
    count = run.rows[1]
    out = {}
    for k, spec in run.program.batch.items():
        local = host[k].reshape((run.cfg.grad_accum, count) + host[k].shape[1:])
        out[k] = jax.make_array_from_process_local_data(spec.sharding, local, spec.shape)
    return out


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (the restored checkpoint): the steps a
    killed run logged after its last checkpoint are replayed, and must appear once."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the kill
    if keep != lines:
        with atomic_open(path) as f:
            f.writelines(keep)


class _Log:
    """metrics.jsonl, TensorBoard and the progress bar (process 0 writes; all processes keep history)."""

    def __init__(self, run: Run, start: int):
        self.run, self.history, self.tokens, self.parts = run, [], 0, 0
        self.file = self.writer = None
        if run.is_main:
            from tensorboardX import SummaryWriter
            truncate_metrics(run.out / "metrics.jsonl", start)
            # purge_step: TensorBoard drops the events of steps > start written before a kill
            self.writer = SummaryWriter(str(run.out / "tb"), purge_step=start + 1 if start else None)
            self.file = (run.out / "metrics.jsonl").open("a")
        self.bar = tqdm(total=run.total_steps, initial=start, desc="train", unit="step",
                        disable=not (run.cfg.progress and run.is_main))

    def add(self, step: int, metrics: dict, row: dict) -> None:
        self.history.append(row)
        self.tokens += int(metrics["tokens"])
        if self.run.is_main:
            self.file.write(dumps(row) + "\n")
            self.file.flush()
            if step % self.run.cfg.log_every == 0:
                for k, v in metrics.items():
                    self.writer.add_scalar(f"train/{k}", v, step)
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}",
                                 exp_accept_len=f"{metrics.get('expected_accept_length', float('nan')):.3f}")
        self.bar.update(1)

    def flush(self) -> None:
        """Get every logged event onto disk (tensorboardX's flush leaves queued events in its
        writer thread: closing drains the queue; a new event file continues the log)."""
        if self.writer:
            from tensorboardX import SummaryWriter
            self.writer.close()
            self.parts += 1  # a distinct file name (tensorboardX names files by the second)
            self.writer = SummaryWriter(str(self.run.out / "tb"), filename_suffix=f".{os.getpid()}.{self.parts}")

    def close(self) -> None:
        self.bar.close()
        for f in (self.file, self.writer):
            if f:
                f.close()


def _non_finite(run: Run, mgr, step: int, metrics: dict) -> NonFiniteLossError:
    mgr.wait_until_finished()
    good = mgr.latest_step()
    return NonFiniteLossError(
        f"non-finite loss/gradient at step {step} (loss={metrics['loss']}, grad_norm="
        f"{metrics['grad_norm']}); the update was not applied and training stopped. "
        f"Last good checkpoint: {good if good is not None else 'none'} in {run.out / 'checkpoints'}. "
        "Lower optimizer.learning_rate or check the data.")


def _save(run: Run, mgr, step: int, state, data_iter, log: "_Log", *, now: bool = False) -> None:
    """Checkpoint every ``checkpoint.every`` steps, at the last step and, ``now``, at this one (the
    step a Ctrl-C stops at: its work is kept, not redone from the last periodic checkpoint);
    TensorBoard flushed first, so a killed run's events reach the restored step."""
    every = run.cfg.checkpoint.every
    if not now and (not every or (step % every and step != run.total_steps)):
        return
    log.flush()
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                           data=grain.checkpoint.CheckpointSave(data_iter)))
    kill_at = int(os.environ.get(KILL_AT_STEP_ENV, "0") or 0)
    if kill_at and step >= kill_at:
        mgr.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)


def iterate(run: Run, state, start: int, mgr, data_iter, log: _Log):
    """Run steps ``start+1 .. total_steps``; returns the final state. Stops on a non-finite loss,
    and after a step's checkpoint when Ctrl-C was pressed (``interrupt.check``)."""
    for it in range(start, run.total_steps):
        host = next(data_iter)
        indices = host.pop("index")
        t0 = time.time()
        state, metrics = run.program.step(state, run.frozen, run.target, _device_batch(run, host))
        metrics = {k: np.asarray(v).item() for k, v in jax.device_get(metrics).items()}
        dt = time.time() - t0
        finite = bool(metrics.pop("finite"))
        row = {"step": it + 1, **metrics, "step_time_s": dt,
               "data": [int(i) for i in np.asarray(indices).reshape(-1)][:64]}
        if not finite:
            raise _non_finite(run, mgr, it + 1, metrics)
        log.add(it + 1, metrics, row)
        _save(run, mgr, it + 1, state, data_iter, log)
        if interrupt.requested() and run.cfg.checkpoint.every and mgr.latest_step() != it + 1:
            _save(run, mgr, it + 1, state, data_iter, log, now=True)  # the step Ctrl-C stops at
        interrupt.check()
    mgr.wait_until_finished()
    return state


def _gather(tree):
    """Fully-replicated host numpy copy of a (possibly multi-process sharded) tree."""
    if jax.process_count() > 1:
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def export(run: Run, state) -> tuple[dict, Path | None]:
    """(full drafter params as host numpy, export dir or None): the drafter written in
    ``export_format`` (process 0)."""
    params = optim.merge_params(_gather(state.params), _gather(run.frozen))
    cfg = run.cfg
    if cfg.export_format == "none" or not run.is_main:
        return params, None
    export_dir = Path(cfg.export_dir) if cfg.export_dir else run.out / "export"
    ckpt_io.save_draft(export_dir, run.draft_cfg, params, format=cfg.export_format, force=True)
    return params, export_dir


def train(cfg: TrainConfig, *, fast_compile: bool | None = None, force_resume: bool = False) -> dict:
    """Run or resume training; returns the final summary dict (plus "history" and "params").

    A rerun of a finished run changes nothing on disk and returns its summary.json with
    ``"finished": True`` (params None). Resuming a run that differs (data, feature mode,
    optimizer, loss, drafter, target, steps) is refused naming the fields unless ``force_resume``.

    ``fast_compile`` (default: environment ``DSPARK_FAST_COMPILE=1``) trades step speed for
    compile time (CPU smoke runs).
    """
    t_start = time.time()
    if fast_compile is None:
        fast_compile = os.environ.get(FAST_COMPILE_ENV) == "1"
    try:
        run = setup(cfg, fast_compile=fast_compile, force_resume=force_resume)
    except RunFinished as done:
        return dict(done.summary, finished=True, message=str(done), history=[], params=None)
    data_iter = make_data_iterator(run)
    mgr = checkpoint_manager(run)
    log = None
    try:
        # Ctrl-C ends a single-process run between steps, not inside XLA/orbax work (several
        # processes would stop at different steps and hang in a collective: there it raises)
        with interrupt.deferred_sigint(enabled=jax.process_count() == 1):
            state, start = restore_or_init(run, mgr, data_iter)
            log = _Log(run, start)
            t_loop = time.time()
            state = iterate(run, state, start, mgr, data_iter, log)
    finally:
        if log:
            log.close()
        mgr.close()
    params, export_dir = export(run, state)
    elapsed = time.time() - t_loop
    history = log.history
    summary = {
        "output_dir": str(run.out), "steps": run.total_steps, "resumed_from": start,
        "final": history[-1] if history else None,
        "first": history[0] if history else None,
        "tokens_per_s": log.tokens / elapsed if elapsed > 0 else None,
        "wall_s": time.time() - t_start, "export": str(export_dir) if export_dir else None,
        "num_processes": jax.process_count(), "num_devices": jax.device_count(),
        "mesh": dict(run.program.mesh.shape),
    }
    if summary["final"] and "expected_accept_length" in summary["final"]:
        from dspark_jax.train.loss import EXPECTED_ACCEPT_LENGTH_NOTE
        summary["note"] = EXPECTED_ACCEPT_LENGTH_NOTE
    if run.is_main:
        write_json(run.out / "summary.json", summary, indent=1)
    return dict(summary, history=history, params=params)
