"""TrainConfig files and overrides, the LR schedule, and frozen params kept out of the optimizer."""

from pathlib import Path

import jax
import numpy as np
import pytest

from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import model as draft_model
from dspark_jax.errors import ConfigError
from dspark_jax.train import optim, step as step_lib
from dspark_jax.train.config import TrainConfig, load_config

REPO = Path(__file__).resolve().parents[1]


def test_tiny_config_file_and_overrides():
    cfg = load_config(REPO / "configs/tiny.py", ["steps=5", "draft.markov_rank=0",
                                                 "draft.confidence_head_with_markov=False",
                                                 "mesh=data=2,fsdp=2", "optimizer.learning_rate=1",
                                                 "loss.l1_weight=0", "checkpoint.every=7"])
    assert cfg.steps == 5 and cfg.mesh == "data=2,fsdp=2" and cfg.optimizer.learning_rate == 1.0
    assert cfg.optimizer.warmup_ratio == 0.04  # the rest of the file's section is kept
    assert cfg.loss.l1_weight == 0.0 and cfg.loss.ce_weight == 0.1 and cfg.checkpoint.every == 7
    assert cfg.checkpoint.keep == 2
    assert cfg.draft["markov_rank"] == 0 and cfg.draft["num_anchors"] == 8
    assert Path(cfg.target).is_absolute() and (Path(cfg.target) / "config.json").is_file()
    with pytest.raises(ConfigError, match="unknown TrainConfig field 'stepz'"):
        load_config(REPO / "configs/tiny.py", ["stepz=5"])
    for bad in ("learning_rate=1", "optimizer.lr=1", "optimizer=1", "memory.remat.x=1"):
        with pytest.raises(ConfigError, match="unknown TrainConfig field"):
            load_config(REPO / "configs/tiny.py", [bad])
    with pytest.raises(ConfigError, match="TrainConfig.optimizer: .*unexpected keyword"):
        TrainConfig(target="t", data="d", optimizer=dict(lr=1))
    with pytest.raises(ConfigError, match="warmup_ratio must be in"):
        TrainConfig(target="t", data="d", optimizer=dict(warmup_ratio=1.5))
    with pytest.raises(ConfigError, match="LossConfig.ce_weight must be >= 0"):
        TrainConfig(target="t", data="d", loss=dict(ce_weight=-1))
    with pytest.raises(ConfigError, match="batch_size=10 is not divisible by grad_accum=4"):
        load_config(REPO / "configs/tiny.py", ["batch_size=10", "grad_accum=4"])
    with pytest.raises(ConfigError, match="features='disk' must be one of"):
        TrainConfig(target="t", data="d", features="disk")
    with pytest.raises(ConfigError, match="cache_dir is required"):
        TrainConfig(target="t", features="cache")


def test_schedule_warmup_cosine_and_frozen_params_not_in_optimizer():
    cfg = TrainConfig(target="t", data="d")  # SPEC defaults: 6e-4, 4% warm-up, cosine to 0
    opt, sched = optim.make_optimizer(cfg.optimizer, 100)
    lr = np.array([float(sched(i)) for i in range(101)])
    assert lr[0] == 0 and np.isclose(lr[4], 6e-4) and lr.argmax() == 4
    assert np.all(np.diff(lr[4:]) <= 1e-12) and np.isclose(lr[100], 0, atol=1e-12)
    assert np.isclose(lr[52], 3e-4, rtol=1e-3)  # halfway through the cosine
    tcfg = TargetConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    dcfg = DraftConfig.for_target(tcfg, num_hidden_layers=1, target_layer_ids=(0, 1), mask_token_id=63,
                                  num_anchors=2, markov_rank=4)
    params = draft_model.init_params(dcfg, jax.random.PRNGKey(0))
    trainable, frozen = optim.split_params(params)
    assert set(frozen) == {"embed_tokens", "lm_head"}
    state = step_lib.init_state(trainable, opt, 0)
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
    n_train = sum(x.size for x in jax.tree.leaves(trainable))
    assert n_opt <= 2 * n_train + 8  # Adam moments for trainable params only (+ counters)
    assert n_opt < 2 * n_train + params["embed_tokens"].size


def test_config_round_trips_through_a_config_file(tmp_path):
    cfg = TrainConfig(target="/t", data="/d", optimizer=dict(learning_rate=1e-3), memory=dict(remat="dots"),
                      draft=dict(markov_rank=0))
    assert TrainConfig(**cfg.to_dict()) == cfg
    changed = cfg.to_dict(changed_only=True)
    assert changed == {"target": "/t", "data": "/d", "draft": {"markov_rank": 0},
                       "optimizer": {"learning_rate": 1e-3}, "memory": {"remat": "dots"}}
    path = tmp_path / "c.py"
    path.write_text(f"CONFIG = {changed!r}\n")
    assert load_config(path) == cfg
