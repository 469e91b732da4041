"""Training configs of DeepSeek-V4's own DSpark module: configs/dspark_deepseek_v4_{flash,pro}.py
build the released modules' shapes on the V4 presets, and the train loop's drafter (fresh, or
``draft_init`` = a V4 checkpoint) shares the target's embedding and head arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dspark_jax import params as params_lib
from dspark_jax.convert import checkpoint
from dspark_jax.draft import deepseek_v4 as dv4
from dspark_jax.presets import TARGETS
from dspark_jax.train import loop
from dspark_jax.train.config import TrainConfig, load_config

ROOT = Path(__file__).parent.parent
PAIR = Path(__file__).parent / "fixtures" / "deepseek_v4_tiny" / "target_dspark"


@pytest.mark.parametrize("name, ids, rank, hidden", [("flash", (40, 41, 42), 256, 4096),
                                                     ("pro", (58, 59, 60), 512, 7168)])
def test_train_configs_build_the_released_modules(name, ids, rank, hidden):
    cfg = load_config(ROOT / "configs" / f"dspark_deepseek_v4_{name}.py")
    dcfg = cfg.draft_config(TARGETS[cfg.target])
    assert isinstance(dcfg, dv4.DeepseekV4DSparkConfig)
    assert (dcfg.target_layer_ids, dcfg.block_size, dcfg.markov_rank, dcfg.noise_token_id) == (ids, 5, rank, 128799)
    shapes = params_lib.torch_shapes(dv4.module_specs(dcfg))
    assert shapes["mtp.0.main_proj.weight"] == (hidden, 3 * hidden)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, hidden + rank)


FRESH = TrainConfig(target=str(PAIR), data="x", draft=dict(target_layer_ids=(3, 4, 5), block_size=5,
                                                            markov_rank=16, mask_token_id=500))


def test_train_loop_drafter_from_the_checkpoint_shares_the_target_arrays():
    tcfg, tparams = checkpoint.load_target(PAIR)
    dcfg, params = loop.load_drafter(FRESH.replace(draft_init=str(PAIR)), tcfg, tparams)
    assert dcfg.markov_rank == 16 and params["embed"] is tparams["embed"] and params["head"] is tparams["head"]


@pytest.mark.slow  # ~30 s on 2 shared cores: the random init of every module leaf
def test_fresh_train_loop_drafter_shares_the_target_arrays():
    tcfg, tparams = checkpoint.load_target(PAIR)
    dcfg, params = loop.load_drafter(FRESH, tcfg, tparams)
    assert dcfg.num_hidden_layers == 3 and params["embed"] is tparams["embed"] and params["head"] is tparams["head"]


@pytest.mark.slow  # one compile of the online V4 target forward + the module's gradient (~3 min here)
def test_train_pipeline_then_export_into_the_target(tmp_path):
    """`train` (online features, draft_init = the fixture's own module, 4 steps) lowers the loss and
    exports the module; the same run on `dspark-jax cache` features (the tap: the stream-mean of
    each layer's output) gives the same losses; `export --engine vllm --target` writes the module
    into the target checkpoint."""
    from dspark_jax import cli
    from dspark_jax.convert import engines_v4, safetensors_io
    from dspark_jax.data.sample import sample_sequences, write_jsonl
    from train_tiny import tiny_config
    tcfg, tparams = checkpoint.load_target(PAIR)
    write_jsonl(tmp_path / "seqs.jsonl", sample_sequences(tparams, tcfg, 8, 32, seed=3))
    cfg = tiny_config(tmp_path / "run", target=str(PAIR), data=str(tmp_path / "seqs.jsonl"), draft_init=str(PAIR),
                      draft={}, steps=4, batch_size=4, export_format="torch")
    loop.train(cfg, fast_compile=True)
    import json
    losses = [json.loads(line)["ce_loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0], losses
    layer_ids = checkpoint.load_draft(PAIR)[0].target_layer_ids
    assert cli.main(["cache", "--target", str(PAIR), "--data", str(tmp_path / "seqs.jsonl"), "--out",
                     str(tmp_path / "feats"), "--layer-ids", ",".join(map(str, layer_ids)),
                     "--max-length", "32", "--batch-size", "4", "--quiet"]) == 0
    cached = loop.train(tiny_config(tmp_path / "cached", target=str(PAIR), features="cache",
                                    cache_dir=str(tmp_path / "feats"), draft_init=str(PAIR), draft={}, steps=4,
                                    batch_size=4), fast_compile=True)
    np.testing.assert_allclose([r["ce_loss"] for r in cached["history"]], losses, rtol=0, atol=1e-5)
    dst = tmp_path / "served"
    assert cli.main(["export", str(tmp_path / "run" / "export"), str(dst), "--engine", "vllm",
                     "--target", str(PAIR)]) in (0, None)
    reader = safetensors_io.TensorReader(dst)
    facts = engines_v4.v4_facts(json.loads((dst / "config.json").read_text()), reader.infos)
    assert engines_v4.v4_violations(facts, "vllm") == []
    _, trained = checkpoint.load_draft(tmp_path / "run" / "export")
    _, served = checkpoint.load_draft(dst)
    assert float(abs(served["main_proj"] - trained["main_proj"]).max()) == 0.0


def test_expert_parallel_dispatch_gradients_equal_one_device():
    """The module's MoE trains expert-parallel: the gradients (tokens, combine weights, every
    expert's w1 / w3 / w2) of the sorted dispatch under shard_map on `expert=2`, `data=2,expert=2`
    and `expert=2,tensor=2` equal one device's (the psum over the expert axis transposes right)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax import runtime, sharding
    from dspark_jax.target.deepseek_v4 import moe
    from test_deepseek_v4 import _small
    cfg = _small(n_routed_experts=8, num_experts_per_tok=2)
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    b, s, h, i, e = 4, 16, cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    x = jax.random.normal(k[0], (b, s, h))
    weight, chosen = jax.lax.top_k(jax.random.normal(k[1], (b, s, e)), 2)
    combine = (jax.nn.one_hot(chosen, e) * jax.nn.softmax(weight)[..., None]).sum(2)   # [B, S, E]
    w1, w3 = (0.1 * jax.random.normal(kk, (e, h, i)) for kk in k[2:4])
    w2 = 0.1 * jax.random.normal(k[4], (e, i, h))
    probe = jax.random.normal(k[5], (b, s, h))

    def grads(where):
        loss = lambda *a: jnp.sum(moe.sorted_dispatch(cfg, *a, where) * probe)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, combine, w1, w3, w2)

    want = grads(None)
    for spec, n in (("expert=2", 2), ("data=2,expert=2", 4), ("expert=2,tensor=2", 4)):
        mesh = sharding.make_mesh(spec, jax.devices()[:n])
        got = grads(runtime.Context.make(mesh, sharding.DEFAULT_RULES, jnp.float32))
        for a, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-5, rtol=1e-5, err_msg=spec)


def test_blocks_dispatch_backward_keeps_no_per_block_weight_copies():
    """The module's experts train through the blocks grouped matmul, its scan body checkpointed:
    the backward pass keeps no per-block copy of w2 (it kept [blocks, I, H] of each weight: 3 x 9.1
    GB per V4-Flash stage on CPU); the w1 / w3 slices still are kept (at most 2 [blocks, H, I])."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.target.deepseek_v4 import moe
    from test_deepseek_v4 import _small
    cfg = _small(n_routed_experts=4, num_experts_per_tok=2)
    h, i, e, m = cfg.hidden_size, cfg.moe_intermediate_size, 4, 128
    block = moe.block_rows(m, e)
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    xs = jax.random.normal(k[0], (m, h))
    w1, w3 = (jax.random.normal(kk, (e, h, i)) for kk in k[1:3])
    w2 = jax.random.normal(k[3], (e, i, h))
    sizes = jnp.array([50, 0, 40, 38], jnp.int32)
    _, vjp = jax.vjp(lambda *w: moe.grouped_swiglu_blocks(cfg, xs, sizes, *w, block), w1, w3, w2)
    n_blocks = -(-m // block) + e
    kept = [x.shape for x in jax.tree.leaves(vjp) if hasattr(x, "shape")]
    assert (n_blocks, i, h) not in kept and kept.count((n_blocks, h, i)) <= 2, kept
