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


def test_train_loop_drafter_shares_the_target_arrays():
    tcfg, tparams = checkpoint.load_target(PAIR)
    fresh = TrainConfig(target=str(PAIR), data="x", draft=dict(target_layer_ids=(3, 4, 5), block_size=5,
                                                                markov_rank=16, mask_token_id=500))
    dcfg, params = loop.load_drafter(fresh, tcfg, tparams)
    assert dcfg.num_hidden_layers == 3 and params["embed"] is tparams["embed"] and params["head"] is tparams["head"]
    dcfg, params = loop.load_drafter(fresh.replace(draft_init=str(PAIR)), tcfg, tparams)
    assert dcfg.markov_rank == 16 and params["head"] is tparams["head"]
