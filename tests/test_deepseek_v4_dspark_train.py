"""Training configs of DeepSeek-V4's own DSpark module: configs/dspark_deepseek_v4_{flash,pro}.py
build the released modules' shapes on the V4 presets, and the train loop's drafter (fresh, or
``draft_init`` = a V4 checkpoint) shares the target's embedding and head arrays."""

from __future__ import annotations

from pathlib import Path

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
    exports the module; `export --engine vllm --target` writes it into the target checkpoint."""
    from dspark_jax import cli
    from dspark_jax.convert import engines, safetensors_io
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
    dst = tmp_path / "served"
    assert cli.main(["export", str(tmp_path / "run" / "export"), str(dst), "--engine", "vllm",
                     "--target", str(PAIR)]) in (0, None)
    reader = safetensors_io.TensorReader(dst)
    facts = engines.v4_facts(json.loads((dst / "config.json").read_text()), reader.infos)
    assert engines.v4_violations(facts, "vllm") == []
    _, trained = checkpoint.load_draft(tmp_path / "run" / "export")
    _, served = checkpoint.load_draft(dst)
    assert float(abs(served["main_proj"] - trained["main_proj"]).max()) == 0.0
