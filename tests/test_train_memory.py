"""Memory options of the train step: chunked heads/loss and layer remat give the same numbers."""

import dataclasses
import functools
import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from dspark_jax import sharding
from dspark_jax.config import DraftConfig, LossConfig
from dspark_jax.convert import mapping
from dspark_jax.draft import model
from dspark_jax.errors import ConfigError
from dspark_jax.train import loss as loss_lib
from dspark_jax.train import optim
from dspark_jax.train import step as step_lib
from dspark_jax.train.config import TrainConfig
from dspark_jax.train.program import FAST_COMPILE_OPTIONS, build_program

LOSS = LossConfig()


@pytest.fixture(scope="module")
def fixture(tiny_dir):
    """Drafter (vanilla Markov + confidence, N=8 anchors of block 7) and its reference inputs."""
    cfg = DraftConfig.from_hf(json.loads((tiny_dir / "draft" / "config.json").read_text()))
    params = jax.tree.map(jnp.asarray, mapping.draft_from_torch(
        cfg, load_file(str(tiny_dir / "draft" / "model.safetensors"))))
    data = {k: jnp.asarray(v) for k, v in np.load(tiny_dir / "train_forward.npz").items()}
    args = (data["input_ids"], data["target_hidden_states"], data["loss_mask"], data["anchor_positions"],
            data["block_keep_mask"], data["target_last_hidden_states"])
    return cfg, params, args


def plain_sums(params, cfg, args):
    return loss_lib.loss_sums(model.training_forward(params, cfg, *args), LOSS)


def chunked_sums(params, cfg, args, chunk, remat=False):
    p = model.cast_params(params, jnp.float32)
    th = model.training_hidden(p, cfg, *args, remat=remat)
    return loss_lib.chunked_loss_sums(p, cfg, th, LOSS, chunk)


def objective(sums):
    return 0.1 * sums["ce"] + 0.9 * sums["l1"] + sums["confidence"]


def sums_and_grads(fn, params):
    """(sums, d objective / d trainable params) of ``fn(params) -> sums``, jitted."""
    trainable, frozen = optim.split_params(params)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE_OPTIONS)
    def run(tp):
        def obj(tp):
            sums = fn(optim.merge_params(tp, frozen))
            return objective(sums), sums
        (_, sums), grads = jax.value_and_grad(obj, has_aux=True)(tp)
        return sums, grads
    return run(trainable)


def assert_trees_close(a, b, rtol, atol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_chunked_loss_equals_unchunked(fixture, head):
    cfg, params, args = fixture
    if head == "rnn":  # the recurrent head scans over block positions: chunks must keep blocks whole
        cfg = dataclasses.replace(cfg, markov_head_type="rnn")
        params = dict(params, markov_head=dict(params["markov_head"], **{
            k: v for k, v in model.markov.init_params(cfg, jax.random.PRNGKey(3)).items()
            if k == "joint_proj"}))
    ref, ref_grads = sums_and_grads(lambda p: plain_sums(p, cfg, args), params)
    assert float(ref["weight"]) > 0 and float(ref["blocks"]) > 1
    for chunk in (3, 0):  # 3 pads 8 anchors to 9 with an empty block; 0 = one piece
        got, grads = sums_and_grads(lambda p: chunked_sums(p, cfg, args, chunk), params)
        assert set(got) == set(ref)
        assert_trees_close(got, ref, rtol=2e-5, atol=1e-5)
        assert_trees_close(grads, ref_grads, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_gives_identical_gradients(fixture, remat):
    cfg, params, args = fixture
    _, ref = sums_and_grads(lambda p: chunked_sums(p, cfg, args, 0), params)
    _, got = sums_and_grads(lambda p: chunked_sums(p, cfg, args, 0, remat=remat), params)
    assert_trees_close(got, ref, rtol=1e-5, atol=1e-7)
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(got["layers"]))


def test_train_step_options_keep_the_step(fixture):
    """One sharded step with remat + chunked loss + pinned activations on an fsdp=2 mesh equals
    the plain step: same metrics, same updated params."""
    cfg, params, args = fixture
    ids, feats, lm, _, _, last = args
    b, s = ids.shape
    batch = {"input_ids": ids[None], "loss_mask": lm[None], "features": feats[None], "last_hidden": last[None]}
    tcfg = TrainConfig(target="x", cache_dir="x", features="cache", steps=10, batch_size=b, max_length=s,
                       compute_dtype="float32", optimizer=dict(warmup_ratio=0.0))
    trainable, frozen = optim.split_params(params)
    mesh = sharding.make_mesh("fsdp=2", jax.devices()[:2])  # weights ZeRO-sharded, one row per device
    outs = []
    for mem in ({}, dict(remat="dots", loss_chunk=3, shard_activations=True)):
        prog = build_program(cfg, None, tcfg.replace(memory=mem), mesh, total_steps=10, fast_compile=True)
        assert jax.tree.structure(prog.batch) == jax.tree.structure(batch)
        fresh = jax.tree.map(lambda x: jnp.array(x, copy=True), trainable)  # the step donates its state
        st = prog.init_state(jax.device_put(fresh, prog.state_sharding.params))
        outs.append(prog.step(st, jax.device_put(frozen, prog.frozen_sharding), None,
                              jax.device_put(batch, prog.batch_sharding)))
    (ref_state, ref_m), (got_state, got_m) = outs
    assert float(ref_m["loss"]) > 0 and bool(ref_m["finite"])
    for key in ("loss", "ce_loss", "l1_loss", "confidence_loss", "expected_accept_length", "grad_norm"):
        np.testing.assert_allclose(float(got_m[key]), float(ref_m[key]), rtol=1e-5)
    # one Adam step moves a weight by ~lr * g / (|g| + eps) whatever |g|: where g is ~eps, the two
    # programs' rounding shows in the update (seen: 1.2e-6 = 0.2% of lr, under the suite's -O0 XLA:CPU
    # flags), so the weights agree to 1% of the step, not to float rounding
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=0.01 * tcfg.optimizer.learning_rate)


def test_memory_option_validation(fixture):
    assert TrainConfig(target="x", data="x").memory.remat == "none"
    assert TrainConfig(target="x", data="x").memory.loss_chunk == 0
    with pytest.raises(ConfigError, match="remat"):
        TrainConfig(target="x", data="x", memory=dict(remat="everything"))
    with pytest.raises(ConfigError, match="loss_chunk"):
        TrainConfig(target="x", data="x", memory=dict(loss_chunk=-1))
    with pytest.raises(ConfigError, match="loss_chunk"):
        step_lib.build_train_step(fixture[0], LOSS, None, None, loss_chunk=-2)
    with pytest.raises(ConfigError, match="remat"):
        step_lib.build_train_step(fixture[0], LOSS, None, None, remat="some")


def test_program_abstract_arguments_and_batch_checks(fixture):
    """build_program's abstract batch follows the config; the step's chex checks reject a batch of
    the wrong shape; a micro-batch that does not divide over the mesh is a ConfigError."""
    cfg = fixture[0]
    tcfg = TrainConfig(target="x", cache_dir="x", features="cache", batch_size=4, grad_accum=2, max_length=16,
                       compute_dtype="float32")
    mesh = sharding.make_mesh("data=2", jax.devices()[:2])
    prog = build_program(cfg, None, tcfg, mesh, total_steps=10)
    state, frozen, target, batch = prog.abstract_args
    assert target is None and not prog.online
    assert batch["input_ids"].shape == (2, 2, 16) and batch["input_ids"].dtype == jnp.int32
    assert batch["features"].shape == (2, 2, 16, cfg.num_context_features * cfg.hidden_size)
    assert batch["input_ids"].sharding.shard_shape((2, 2, 16)) == (2, 1, 16)  # rows split over data
    assert jax.tree.structure(state.params) == jax.tree.structure(optim.split_params(fixture[1])[0])
    out_state, metrics = jax.eval_shape(prog.step, state, frozen, None, batch)
    assert out_state.step.shape == () and metrics["loss"].shape == ()
    bad = dict(batch, last_hidden=jax.ShapeDtypeStruct((2, 2, 16, 7), jnp.float32,
                                                       sharding=batch["last_hidden"].sharding))
    with pytest.raises(AssertionError):
        jax.eval_shape(prog.step, state, frozen, None, bad)
    with pytest.raises(ConfigError, match="does not divide"):
        build_program(cfg, None, tcfg.replace(batch_size=6), mesh, total_steps=10)
