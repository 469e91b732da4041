"""The training loop: data, sharded state, jitted step, orbax checkpoints, metrics, export.

``train(cfg)`` runs (or resumes) a whole run in ``cfg.output_dir``::

    output_dir/
      run.json             train + drafter config of this run (resume checks it)
      checkpoints/<step>/  orbax: {"state": TrainState, "data": grain iterator state}
      metrics.jsonl        one JSON object per step (process 0)
      tb/                  TensorBoard events (process 0)
      export/              the drafter in the PyTorch (HF) format at the end
      summary.json         the final summary (also returned)
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from tqdm import tqdm

from dspark_jax import sharding as shard_lib
from dspark_jax.convert import checkpoint as ckpt_io
from dspark_jax.data import cache as cache_lib
from dspark_jax.data import pipeline, sources
from dspark_jax.draft import model as draft_model
from dspark_jax.errors import CheckpointError, ConfigError, DSparkError, InputError
from dspark_jax.target import qwen3
from dspark_jax.tokenizer import load_tokenizer
from dspark_jax.train import optim, step as step_lib
from dspark_jax.train.config import TrainConfig


class NonFiniteLossError(DSparkError):
    """The loss or gradient became NaN/inf; training stopped, the last checkpoint is kept."""


def _global_array(local: np.ndarray, sharding, global_shape):
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


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
        src = cache_lib.FeatureCache(cfg.cache_dir, cfg.max_length, cfg.overlong)
        src.validate(draft_cfg, target_cfg, cache_lib.target_identity(target_cfg, target_params))
        return src
    if cfg.data_format == "chat":
        tok = load_tokenizer(cfg.tokenizer, required=True)
        return sources.read_chat_jsonl(cfg.data, tok, cfg.max_length, cfg.overlong)
    return sources.read_token_jsonl(cfg.data, cfg.max_length, target_cfg.vocab_size, cfg.overlong)


def _check_run_dir(out: Path, record: dict, resume: bool) -> None:
    run_file = out / "run.json"
    if run_file.exists():
        old = json.loads(run_file.read_text())
        if resume and old.get("draft") != record["draft"]:
            raise ConfigError(f"{out} holds a run with a different drafter config; use another output_dir")


def train(cfg: TrainConfig) -> dict:
    """Run or resume training; returns the final summary dict."""
    t_start = time.time()
    is_main = jax.process_index() == 0
    target_cfg, target_params = ckpt_io.load_target(cfg.target)
    if cfg.draft_init:
        draft_cfg, params = ckpt_io.load_draft(cfg.draft_init)
        draft_cfg.check_compatible(target_cfg)
    else:
        draft_cfg = cfg.draft_config(target_cfg)
        params = draft_model.init_params(draft_cfg, jax.random.PRNGKey(cfg.seed),
                                         embed_tokens=target_params["embed_tokens"],
                                         lm_head=qwen3.lm_head_kernel(target_params))
    source = load_source(cfg, target_cfg, draft_cfg, target_params)

    spe = pipeline.steps_per_epoch(len(source), cfg.batch_size)
    if spe == 0:
        raise ConfigError(f"the dataset has {len(source)} sequences, fewer than batch_size={cfg.batch_size}")
    total_steps = cfg.steps or cfg.epochs * spe
    epochs = math.ceil(total_steps / spe)

    devices = jax.devices()
    if cfg.num_devices:
        if jax.process_count() > 1:
            raise ConfigError("num_devices cannot be used with several processes (all devices take part)")
        if cfg.num_devices > len(devices):
            raise ConfigError(f"num_devices={cfg.num_devices} but only {len(devices)} devices exist")
        devices = devices[:cfg.num_devices]
    try:
        mesh = shard_lib.make_mesh(cfg.mesh, devices)
    except ValueError as e:
        raise ConfigError(f"TrainConfig.mesh={cfg.mesh!r}: {e}") from None
    n_batch_shards = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    if cfg.micro_batch_size % n_batch_shards:
        raise ConfigError(f"micro-batch of {cfg.micro_batch_size} rows (batch_size/grad_accum) does not "
                          f"divide over {n_batch_shards} data-parallel devices of mesh {dict(mesh.shape)}")
    compute_dtype = jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32
    optimizer, schedule = optim.make_optimizer(cfg, total_steps)
    trainable, frozen = optim.split_params(params)
    axes = draft_model.param_axes(draft_cfg)
    train_axes, frozen_axes = optim.split_params(axes)

    state_shapes = jax.eval_shape(lambda p: step_lib.init_state(p, optimizer, cfg.seed), trainable)
    state_sh = step_lib.state_shardings(state_shapes, train_axes, mesh, optimizer)
    frozen_sh = shard_lib.param_shardings(frozen_axes, mesh, frozen)
    frozen = _put(frozen, frozen_sh)
    online = cfg.features == "online"
    if online:
        t_sh = shard_lib.param_shardings(qwen3.param_axes(target_cfg), mesh, target_params)
        target_dev = _put(target_params, t_sh)
    else:
        t_sh, target_dev = None, None
    trainable_dev = _put(trainable, state_sh.params)
    state = jax.jit(lambda p: step_lib.init_state(p, optimizer, cfg.seed),
                    in_shardings=(state_sh.params,), out_shardings=state_sh)(trainable_dev)

    a, bm = cfg.grad_accum, cfg.micro_batch_size
    example = source[0]
    fields = [k for k in ("input_ids", "loss_mask", "features", "last_hidden") if k in example]
    global_shapes = {k: (a, bm) + example[k].shape for k in fields}
    batch_sh = step_lib.batch_shardings(mesh, {k: jax.ShapeDtypeStruct(v, example[k].dtype)
                                               for k, v in global_shapes.items()})
    row_start, row_count = _local_rows(batch_sh["input_ids"], global_shapes["input_ids"])
    dataset = pipeline.make_dataset(source, global_batch=cfg.batch_size, grad_accum=a, seed=cfg.seed,
                                    epochs=epochs, row_start=row_start, row_count=row_count)
    data_iter = iter(dataset)

    step_fn = step_lib.build_train_step(draft_cfg, cfg.loss_config(), optimizer, schedule,
                                        target_cfg=target_cfg if online else None, compute_dtype=compute_dtype,
                                        remat=cfg.remat, loss_chunk=cfg.loss_chunk,
                                        mesh=mesh if cfg.shard_activations else None)
    jstep = step_lib.jit_train_step(step_fn, mesh, state_sh, frozen_sh, t_sh, batch_sh, cfg.fast_compile)

    out = Path(cfg.output_dir).absolute()
    record = {"train": cfg.to_dict(), "draft": draft_cfg.to_hf(), "total_steps": total_steps}
    _check_run_dir(out, record, cfg.resume)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".run.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, out / "run.json")
    mgr = ocp.CheckpointManager(
        out / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints or None,
                                             enable_async_checkpointing=cfg.async_checkpoint, create=True))
    start = 0
    latest = mgr.latest_step()
    if latest is not None and not cfg.resume:
        mgr.close()
        raise InputError(f"{out / 'checkpoints'} already holds checkpoints (newest {latest}); "
                         "set resume=True to continue that run or choose another output_dir")
    if latest is not None:
        abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                state_shapes, state_sh)
        try:
            restored = mgr.restore(latest, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(data_iter)))
        except Exception as e:
            raise CheckpointError(f"cannot restore checkpoint {out / 'checkpoints' / str(latest)}: {e}") from e
        state = restored["state"]
        start = int(jax.device_get(state.step))

    writer = None
    metrics_file = None
    if is_main:
        from tensorboardX import SummaryWriter
        writer = SummaryWriter(str(out / "tb"))
        metrics_file = (out / "metrics.jsonl").open("a")
    bar = tqdm(total=total_steps, initial=start, desc="train", unit="step",
               disable=not (cfg.progress and is_main))
    history = []
    tokens_seen = 0
    t_loop = time.time()
    try:
        for it in range(start, total_steps):
            host = next(data_iter)
            indices = host.pop("index")
            local_shape = lambda k: (a, row_count) + host[k].shape[1:]
            batch = {k: _global_array(host[k].reshape(local_shape(k)), batch_sh[k], global_shapes[k])
                     for k in fields}
            t0 = time.time()
            state, metrics = jstep(state, frozen, target_dev, batch)
            metrics = {k: np.asarray(v).item() for k, v in jax.device_get(metrics).items()}
            dt = time.time() - t0
            finite = bool(metrics.pop("finite"))
            tokens_seen += int(metrics["tokens"])
            row = {"step": it + 1, **metrics, "step_time_s": dt,
                   "data": [int(i) for i in np.asarray(indices).reshape(-1)][:64]}
            if not finite:
                mgr.wait_until_finished()
                good = mgr.latest_step()
                raise NonFiniteLossError(
                    f"non-finite loss/gradient at step {it + 1} (loss={metrics['loss']}, grad_norm="
                    f"{metrics['grad_norm']}); the update was not applied and training stopped. "
                    f"Last good checkpoint: {good if good is not None else 'none'} in {out / 'checkpoints'}. "
                    "Lower learning_rate or check the data.")
            history.append(row)
            if is_main:
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
                if (it + 1) % cfg.log_every == 0:
                    for k, v in metrics.items():
                        writer.add_scalar(f"train/{k}", v, it + 1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}",
                                tau=f"{metrics.get('expected_accept_length', float('nan')):.3f}")
            bar.update(1)
            last = it + 1 == total_steps
            if cfg.checkpoint_every and ((it + 1) % cfg.checkpoint_every == 0 or last):
                mgr.save(it + 1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          data=grain.checkpoint.CheckpointSave(data_iter)))
                if cfg.kill_at_step and it + 1 >= cfg.kill_at_step:
                    mgr.wait_until_finished()
                    os.kill(os.getpid(), signal.SIGKILL)
        mgr.wait_until_finished()
    finally:
        bar.close()
        if metrics_file:
            metrics_file.close()
        if writer:
            writer.close()
        mgr.close()

    final = _gather(state.params)
    final_params = optim.merge_params(final, _gather(frozen))
    export_dir = None
    if cfg.export_format != "none" and is_main:
        export_dir = Path(cfg.export_dir) if cfg.export_dir else out / "export"
        ckpt_io.save_draft(export_dir, draft_cfg, final_params, format=cfg.export_format, force=True)
    elapsed = time.time() - t_loop
    summary = {
        "output_dir": str(out), "steps": total_steps, "resumed_from": start,
        "final": history[-1] if history else None,
        "first": history[0] if history else None,
        "tokens_per_s": tokens_seen / elapsed if elapsed > 0 else None,
        "wall_s": time.time() - t_start, "export": str(export_dir) if export_dir else None,
        "num_processes": jax.process_count(), "num_devices": jax.device_count(), "mesh": dict(mesh.shape),
    }
    if is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["history"] = history
    summary["params"] = final_params
    return summary


def _gather(tree):
    """Fully-replicated host numpy copy of a (possibly multi-process sharded) tree."""
    if jax.process_count() > 1:
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
