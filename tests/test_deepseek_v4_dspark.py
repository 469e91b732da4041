"""DeepSeek-V4's in-checkpoint DSpark module: config, declaration, conversion, forward, decode step.

Fixture: tests/fixtures/deepseek_v4_tiny/target_dspark (the tiny V4 target plus a random module in
the released layout; its golden README section) and forward.npz (transformers' layer stream means,
the module's input). The forward is checked against tests/torch_v4_dspark.py, an independent torch
reference written from the layout facts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax.config import LossConfig
from dspark_jax.convert import dspark_v4, quant, safetensors_io
from dspark_jax.draft import decode
from dspark_jax.draft import deepseek_v4 as dv4
from dspark_jax.draft import model as draft_model
from dspark_jax.errors import CheckpointError, ConfigError, InputError
from dspark_jax.target.deepseek_v4 import DeepseekV4Config
from dspark_jax.train import loss as loss_lib
from tests import torch_v4_dspark

FIX = Path(__file__).parent / "fixtures" / "deepseek_v4_tiny"
SRC = FIX / "target_dspark"


def _hf() -> dict:
    return json.loads((SRC / "config.json").read_text())


@functools.lru_cache(maxsize=None)
def _module():
    cfg, params = dspark_v4.load_module(SRC)
    tensors = safetensors_io.read_tensors(SRC)
    shared = {"embed": jnp.asarray(tensors["embed.weight"]), "head": jnp.asarray(tensors["head.weight"].T)}
    return cfg, dv4.with_target(jax.tree.map(jnp.asarray, params), shared), tensors


@functools.lru_cache(maxsize=None)
def _golden():
    ref = np.load(FIX / "forward.npz")
    cfg = _module()[0]
    feats = np.concatenate([ref["layer_mean"][i] for i in cfg.target_layer_ids], axis=-1)
    return ref["input_ids"], feats, ref["last_hidden"]


# ----------------------------------------------------------------------------- config, declaration


def test_config_declaration_and_registry():
    hf = _hf()
    cfg = dv4.DeepseekV4DSparkConfig.from_hf(hf)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.markov_rank, cfg.noise_token_id) == (5, (3, 4, 5), 16, 511)
    assert cfg.num_hidden_layers == 3 and cfg.window == 16 and cfg.mask_token_id == 511
    assert dv4.DeepseekV4DSparkConfig.from_hf(cfg.to_hf()) == cfg
    decl = dv4.declare(cfg)
    names = {n for s in dv4.module_specs(cfg).values() for n in s.torch_names()}
    stored = {n for n in safetensors_io.TensorReader(SRC).infos if n.startswith("mtp.")}
    assert names == stored                                   # every mtp.* tensor declared once
    assert decl[("embed",)].frozen and decl[("head",)].frozen and decl[("head",)].torch == "head.weight"
    assert families.drafter_family(DeepseekV4Config.from_hf(hf)).name == "deepseek_v4_dspark"
    assert families.draft_ops(cfg) is dv4.OPS
    info = dv4.describe(hf)
    assert info["present"] and info["target_layer_ids"] == [3, 4, 5] and info["heads"] == 4
    assert dv4.describe({k: v for k, v in hf.items() if not k.startswith("dspark_")}) == {"present": False}
    built = dv4.DeepseekV4DSparkConfig.for_target(cfg.target, target_layer_ids=[3, 4, 5], num_hidden_layers=3,
                                                  block_size=5, markov_rank=16, mask_token_id=511)
    assert built == cfg
    for bad in ({"num_hidden_layers": 2}, {"markov_head_type": "gated"}, {"fc_bias": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            dv4.DeepseekV4DSparkConfig.for_target(cfg.target, target_layer_ids=[3, 4, 5], **bad)


@pytest.mark.parametrize("change, match", [
    ({"dspark_markov_rank": None}, "dspark_markov_rank"),
    ({"dspark_target_layer_ids": [3, 4, 6]}, "dspark_target_layer_ids"),
    ({"dspark_markov_rank": 0}, "dspark_markov_rank"),
    ({"dspark_noise_token_id": 512}, "dspark_noise_token_id"),
    ({"compress_ratios": [0, 4, 128, 4, 128, 0, 0, 4, 0]}, "compress_ratios"),
])
def test_config_refuses_by_name(change, match):
    with pytest.raises(ConfigError, match=match):
        dv4.DeepseekV4DSparkConfig.from_hf({**_hf(), **change})


# ----------------------------------------------------------------------------- conversion


def test_round_trip_byte_exact(tmp_path):
    cfg, params, tensors = _module()
    out = dspark_v4.module_tensors(cfg, jax.tree.map(np.asarray, params))
    want = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    assert set(out) == set(want)
    assert all(out[k].dtype == want[k].dtype and out[k].tobytes() == want[k].tobytes() for k in want)
    dspark_v4.save_module(tmp_path / "m", cfg, params)
    cfg2, params2 = dspark_v4.load_module(tmp_path / "m")
    assert cfg2 == cfg
    again = dspark_v4.module_tensors(cfg2, params2)
    assert all(again[k].tobytes() == want[k].tobytes() for k in want)
    with pytest.raises(InputError):
        dspark_v4.save_module(tmp_path / "m", cfg, params)


def test_fp8_and_fp4_module_is_dequantized(tmp_path):
    """A module stored as the released checkpoints store it (FP8 weights with ue8m0 block scales,
    MXFP4 routed experts) reads back as the dequantized values; a missing scale is named."""
    cfg, params, tensors = _module()
    hf = dict(_hf(), quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "weight_block_size": [16, 16]}, expert_dtype="fp4")
    qcfg = dv4.DeepseekV4DSparkConfig.from_hf(hf)
    specs = dv4.module_specs(qcfg)
    stored, want = {}, {}
    for s in specs.values():
        for name in s.torch_names():
            w = tensors[name]
            if s.quant is None:
                stored[name] = want[name] = w
                continue
            data, scale = quant.quantize(w, s.quant)
            stored[name], stored[s.quant.scale_name(name)] = data, scale
            want[name] = quant.dequantize(data, scale, s.quant)
    assert any(v.dtype == np.int8 for v in stored.values()) and any(v.dtype == quant.FP8 for v in stored.values())
    (tmp_path / "q").mkdir()
    safetensors_io.write_tensors(tmp_path / "q", stored)
    (tmp_path / "q" / "config.json").write_text(json.dumps(hf))
    got_cfg, got = dspark_v4.load_module(tmp_path / "q")
    assert got_cfg.target.quant is None
    out = dspark_v4.module_tensors(got_cfg, got)
    assert all(np.array_equal(out[k], want[k]) for k in want)
    del stored["mtp.1.attn.wq_b.scale"]
    (tmp_path / "q" / "model.safetensors").unlink()
    safetensors_io.write_tensors(tmp_path / "q", stored)
    with pytest.raises(CheckpointError, match="mtp.1.attn.wq_b.scale"):
        dspark_v4.load_module(tmp_path / "q")


# ----------------------------------------------------------------------------- forward vs torch

ANCHORS = np.array([[3, 20, 41, 77, 150], [0, 9, 16, 100, 154]], np.int32)
KEEP = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], bool)


@functools.lru_cache(maxsize=None)
def _train_forward():
    cfg, params, _ = _module()
    ids, feats, last = _golden()
    fwd = jax.jit(dv4.training_forward, static_argnums=(1,))(
        params, cfg, jnp.asarray(ids), jnp.asarray(feats), jnp.ones(ids.shape, jnp.float32),
        jnp.asarray(ANCHORS), jnp.asarray(KEEP), jnp.asarray(last))
    return fwd


def test_training_forward_and_loss_equal_torch_reference():
    cfg, params, tensors = _module()
    ids, feats, last = _golden()
    fwd = _train_forward()
    ref = torch_v4_dspark.Module(tensors, _hf())
    g, s = cfg.block_size, ids.shape[1]
    logits, confs, labels, aligned, valid = [], [], [], [], []
    with torch.no_grad():
        for b in range(ids.shape[0]):
            main_x = ref.main_x(torch.as_tensor(feats[b]))
            rows = [ref.context_kv(st, main_x, torch.arange(s)) for st in range(cfg.num_hidden_layers)]
            for n, a in enumerate(ANCHORS[b]):
                if not KEEP[b, n]:
                    continue
                h = ref.block(int(ids[b, a]), int(a), rows)
                pos = np.minimum(a + 1 + np.arange(g), s - 1)
                lab = torch.as_tensor(ids[b, pos]).long()
                lg, cf = ref.heads(h, torch.cat([torch.as_tensor(ids[b, a:a + 1]).long(), lab[:-1]]))
                logits.append(lg), confs.append(cf), labels.append(lab)
                aligned.append(torch.as_tensor(last[b, pos - 1]) @ ref.w("head.weight").T)
                valid.append(torch.as_tensor(a + 1 + np.arange(g) < s).cumprod(0).bool())
    mask = np.asarray(fwd.eval_mask)[KEEP]
    np.testing.assert_array_equal(mask, torch.stack(valid).numpy())
    ours = np.asarray(fwd.draft_logits)[KEEP]
    np.testing.assert_allclose(ours[mask], torch.stack(logits).numpy()[mask], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(fwd.confidence_logits)[KEEP][mask], torch.stack(confs).numpy()[mask],
                               atol=2e-4, rtol=1e-4)
    want = torch_v4_dspark.loss_terms(torch.stack(logits), torch.stack(confs), torch.stack(labels),
                                      torch.stack(aligned), torch.as_tensor(mask))
    _, terms = loss_lib.dspark_loss(fwd, LossConfig())
    for k, v in want.items():
        np.testing.assert_allclose(float(terms[k]), float(v), rtol=1e-4, err_msg=k)


# ----------------------------------------------------------------------------- decode step


def test_propose_equals_training_block():
    """The decode-time step (``draft.decode`` over the family's ``DraftRuntime``: a context ring
    of W rows, committed in chunks wider than W, one row past the window and one inside it) gives
    the training forward's block at the same anchors."""
    cfg, params, _ = _module()
    ids, feats, _ = _golden()
    anchors = np.array([50, 9], np.int32)
    w = cfg.window
    assert anchors[0] > 30 + w and anchors[1] < w  # the second chunk alone overfills the ring

    @functools.partial(jax.jit, static_argnums=(1,))
    def both(params, cfg):
        ring = decode.init_context(params, cfg, jnp.asarray(feats[:, :30]), 64, jnp.asarray(np.minimum(anchors, 30)))
        positions = jnp.broadcast_to(30 + jnp.arange(25, dtype=jnp.int32), (2, 25))
        ring = decode.extend_context(params, cfg, ring, jnp.asarray(feats[:, 30:55]), positions,
                                     positions < jnp.asarray(anchors)[:, None])
        prop = decode.propose(params, cfg, anchor_tok, jnp.asarray(anchors), ring, jax.random.key(0), 1.0, True)
        th = draft_model.training_hidden(params, cfg, jnp.asarray(ids), jnp.asarray(feats), jnp.ones(ids.shape),
                                         jnp.asarray(anchors[:, None]), jnp.ones((2, 1), bool),
                                         compute_dtype=jnp.float32, ops=dv4.OPS)
        h = decode.block_hidden(params, cfg, anchor_tok, jnp.asarray(anchors), ring)
        return ring, prop, h, th.hidden[:, 0]

    anchor_tok = jnp.asarray(ids[np.arange(2), anchors])
    ring, (drafts, logits, conf), h, h_train = both(params, cfg)
    assert ring.ring and ring.v is None and ring.k.shape[3] == w  # W rows, K = V once
    np.testing.assert_allclose(h, h_train, atol=2e-5, rtol=1e-5)
    prev = jnp.concatenate([anchor_tok[:, None], drafts[:, :-1]], axis=1)
    want_logits, want_conf, _ = dv4.block_heads(params, cfg, h_train, prev)
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(conf, want_conf, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(drafts, np.argmax(want_logits, -1))   # greedy, left to right


# ----------------------------------------------------------------------------- training


@pytest.mark.slow  # ~40 s of CPU, nearly all XLA compile of the V4 target forward and the module's gradient
def test_training_on_online_target_features_lowers_the_loss():
    """Adam on the module (embed / head / gate bias frozen) with features computed online from the V4
    target (``v4.forward`` taps: the stream means of ``target_layer_ids``), anchors packed by
    ``train.batch.sample_anchors``, the DSpark loss: the loss falls and the training-batch
    acceptance estimate rises."""
    import optax

    from dspark_jax.convert import checkpoint
    from dspark_jax.target import deepseek_v4 as v4
    from dspark_jax.train import batch as batch_lib

    cfg, params, _ = _module()
    tcfg, tparams = checkpoint.load_target(SRC)
    trainable, frozen = params_lib.split_frozen(dv4.declare(cfg), params)
    assert set(frozen) == {"embed", "head", "moe"}
    golden_ids, golden_feats, _ = _golden()
    ids = jnp.asarray(golden_ids[:, :128])  # >= one HCA window: the target forward needs S >= 128
    mask = jnp.ones(ids.shape, jnp.float32)
    # online: the target's own forward (its taps are the stream means), once for this fixed batch;
    # they equal the cached features (transformers' layer means in forward.npz)
    hidden, feats, _ = jax.jit(lambda tp: v4.forward(tp, tcfg, ids, None, taps=cfg.target_layer_ids))(tparams)
    np.testing.assert_allclose(feats, golden_feats[:, :128], atol=2e-4, rtol=1e-4)
    opt = optax.adam(3e-3)
    loss_cfg = LossConfig()

    def loss_fn(tp, key):
        anchors, keep = batch_lib.sample_anchors(key, mask, 16)
        fwd = dv4.training_forward({**tp, **frozen}, cfg, ids, feats, mask, anchors, keep, hidden)
        return loss_lib.dspark_loss(fwd, loss_cfg)

    @jax.jit
    def step(tp, state, key):
        (loss, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(tp, key)
        updates, state = opt.update(grads, state, tp)
        return optax.apply_updates(tp, updates), state, terms

    state = opt.init(trainable)
    history = []
    for i in range(30):
        trainable, state, terms = step(trainable, state, jax.random.key(i % 3))
        history.append({k: float(v) for k, v in terms.items()})
    first, last = history[0], history[-1]
    assert last["loss"] < 0.7 * first["loss"], (first["loss"], last["loss"])
    assert last["expected_accept_length"] > first["expected_accept_length"]


def test_write_checkpoint_replaces_only_the_module(tmp_path):
    """A V4 checkpoint written back with a changed module: its mtp.* tensors are the module's, every
    target tensor is the source's byte for byte, and both still read (target and module)."""
    from dspark_jax.convert import checkpoint

    cfg, params, tensors = _module()
    changed = dict(params, main_norm=params["main_norm"] + 1.0)
    out = dspark_v4.write_checkpoint(SRC, tmp_path / "v4", cfg, changed)
    written = safetensors_io.read_tensors(out)
    assert set(written) == set(tensors)
    for name, value in tensors.items():
        want = np.asarray(params["main_norm"] + 1.0) if name == "mtp.0.main_norm.weight" else value
        assert written[name].tobytes() == np.asarray(want).tobytes(), name
    assert dv4.DeepseekV4DSparkConfig.from_hf(json.loads((out / "config.json").read_text())) == cfg
    tcfg, _ = checkpoint.load_target(out)
    assert tcfg == checkpoint.load_target(SRC)[0]
    with pytest.raises(CheckpointError, match="target config differs"):
        dspark_v4.write_checkpoint(SRC, tmp_path / "v4b", dataclasses.replace(
            cfg, target=dataclasses.replace(cfg.target, hidden_size=128)), changed)


@pytest.mark.parametrize("name, layer_ids, rank, experts, width", [
    ("deepseek-ai/DeepSeek-V4-Flash", (40, 41, 42), 256, 256, 2048),
    ("deepseek-ai/DeepSeek-V4-Pro", (58, 59, 60), 512, 384, 3072),
])
def test_released_module_shapes(name, layer_ids, rank, experts, width):
    """The V4-Flash / V4-Pro modules (DEEPSEEK_V4.md: block 5, three stages reading layers
    ``layer_ids``, Markov rank ``rank``) declare the tensors the released checkpoints hold."""
    from dspark_jax import presets

    target = presets.TARGETS[name]
    cfg = dv4.DeepseekV4DSparkConfig(target=target, target_layer_ids=layer_ids, markov_rank=rank)
    h, v = target.hidden_size, target.vocab_size
    shapes = params_lib.torch_shapes(dv4.module_specs(cfg))
    assert shapes["mtp.0.main_proj.weight"] == (h, 3 * h) and shapes["mtp.0.main_norm.weight"] == (h,)
    assert shapes["mtp.2.markov_head.markov_w1.weight"] == (v, rank) == shapes["mtp.2.markov_head.markov_w2.weight"]
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, h + rank)
    assert shapes[f"mtp.1.ffn.experts.{experts - 1}.w1.weight"] == (width, h)
    assert shapes["mtp.2.hc_head_fn"] == (4, 4 * h) and "mtp.3.attn.wkv.weight" not in shapes
    assert not any(n.startswith("mtp.0.hc_head") or "tid2eid" in n or "compressor" in n for n in shapes)
    assert cfg.hf_fields()["compress_ratios"][-3:] == [0, 0, 0]


@pytest.mark.slow  # an 8-device SPMD compile of the module's forward
def test_expert_parallel_module_equals_one_device():
    """The module's routed experts sharded over an ``expert`` mesh axis (the declaration's axes,
    expert parallelism as the target's) give the one-device training forward."""
    from jax.sharding import NamedSharding

    from dspark_jax import sharding

    cfg, params, _ = _module()
    ids, feats, last = _golden()
    one = _train_forward()
    mesh = sharding.make_mesh("data=2,expert=4")
    placed = jax.tree.map(jax.device_put, params, params_lib.shardings(dv4.declare(cfg), mesh))
    assert placed["layers"]["experts_w1"].sharding.spec[1] == "expert"
    row = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, sharding.logical_to_spec(
        ("batch",) + (None,) * (np.ndim(x) - 1), mesh=mesh, shape=np.shape(x))))
    fwd = jax.jit(dv4.training_forward, static_argnums=(1,))(
        placed, cfg, row(ids), row(feats), row(np.ones(ids.shape, np.float32)), row(ANCHORS), row(KEEP), row(last))
    np.testing.assert_allclose(fwd.draft_logits, one.draft_logits, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(fwd.confidence_logits, one.confidence_logits, atol=1e-5, rtol=1e-5)
