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

    @functools.partial(jax.jit, compiler_options=step_lib.FAST_COMPILE_OPTIONS)
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
    tcfg = TrainConfig(target="x", data="x", steps=10, warmup_ratio=0.0)
    optimizer, schedule = optim.make_optimizer(tcfg, 10)
    trainable, frozen = optim.split_params(params)
    mesh = sharding.make_mesh("fsdp=2", jax.devices()[:2])  # weights ZeRO-sharded, one row per device
    axes_t, axes_f = optim.split_params(model.param_axes(cfg))
    state = step_lib.init_state(trainable, optimizer, 0)
    state_sh = step_lib.state_shardings(jax.eval_shape(lambda: state), axes_t, mesh, optimizer)
    frozen_sh = sharding.param_shardings(axes_f, mesh, frozen)
    batch_sh = step_lib.batch_shardings(mesh, batch)
    outs = []
    for kw in ({}, dict(remat="dots", loss_chunk=3, mesh=mesh)):
        fn = step_lib.build_train_step(cfg, LOSS, optimizer, schedule, compute_dtype=jnp.float32, **kw)
        jstep = step_lib.jit_train_step(fn, mesh, state_sh, frozen_sh, None, batch_sh, fast_compile=True)
        fresh = jax.tree.map(lambda x: jnp.array(x, copy=True), trainable)  # the step donates its state
        st = jax.device_put(step_lib.init_state(fresh, optimizer, 0), state_sh)
        outs.append(jstep(st, jax.device_put(frozen, frozen_sh), None, jax.device_put(batch, batch_sh)))
    (ref_state, ref_m), (got_state, got_m) = outs
    assert float(ref_m["loss"]) > 0 and bool(ref_m["finite"])
    for key in ("loss", "ce_loss", "l1_loss", "confidence_loss", "expected_accept_length", "grad_norm"):
        np.testing.assert_allclose(float(got_m[key]), float(ref_m[key]), rtol=1e-5)
    assert_trees_close(got_state.params, ref_state.params, rtol=1e-5, atol=1e-6)


def test_memory_option_validation(fixture):
    assert TrainConfig(target="x", data="x").remat == "none"
    assert TrainConfig(target="x", data="x").loss_chunk == 0
    with pytest.raises(ConfigError, match="remat"):
        TrainConfig(target="x", data="x", remat="everything")
    with pytest.raises(ConfigError, match="loss_chunk"):
        TrainConfig(target="x", data="x", loss_chunk=-1)
    with pytest.raises(ConfigError, match="loss_chunk"):
        step_lib.build_train_step(fixture[0], LOSS, None, None, loss_chunk=-2)
    with pytest.raises(ConfigError, match="remat"):
        step_lib.build_train_step(fixture[0], LOSS, None, None, remat="some")
