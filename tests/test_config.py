"""Config validation: clear errors naming the offending field."""

import json

import pytest

from dspark_jax.config import DraftConfig, LossConfig, TargetConfig
from dspark_jax.errors import ConfigError

TARGET = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def draft(**kw):
    base = dict(num_hidden_layers=2, target_layer_ids=(0, 2, 4), mask_token_id=63, markov_rank=8)
    base.update(kw)
    return DraftConfig.for_target(TARGET, **base)


@pytest.mark.parametrize("kw, match", [
    (dict(target_layer_ids=(2, 1)), "strictly increasing"),
    (dict(target_layer_ids=(0, 0)), "strictly increasing"),
    (dict(target_layer_ids=(0, 5)), "final decoder layer 5"),
    (dict(target_layer_ids=(0, 9)), "out of range"),
    (dict(target_layer_ids=()), "must not be empty"),
    (dict(markov_head_type="lstm"), "markov_head_type='lstm' is unknown"),
    (dict(markov_rank=0), "confidence_head_with_markov=true needs a Markov head"),
    (dict(markov_rank=-1), "markov_rank"),
    (dict(mask_token_id=64), "mask_token_id=64 is outside"),
    (dict(block_size=0), "block_size"),
    (dict(num_attention_heads=3), "not a multiple"),
])
def test_bad_draft_configs(kw, match):
    with pytest.raises(ConfigError, match=match):
        draft(**kw)


def test_dflash_config_is_valid():
    cfg = draft(markov_rank=0, confidence_head_with_markov=False)
    assert not cfg.has_markov and cfg.enable_confidence_head and not cfg.confidence_uses_markov


def test_hf_round_trip_and_required_fields(tiny_dir):
    hf = json.loads((tiny_dir / "draft" / "config.json").read_text())
    cfg = DraftConfig.from_hf(hf)
    assert cfg.target_layer_ids == (0, 2, 4) and cfg.rope_theta == 1e4 and cfg.markov_rank == 64
    assert DraftConfig.from_hf(cfg.to_hf()) == cfg
    out = cfg.to_hf()
    for key in ("architectures", "num_hidden_layers", "num_target_layers", "block_size",
                "tie_word_embeddings", "layer_types", "mask_token_id", "target_layer_ids", "num_anchors",
                "enable_confidence_head", "confidence_head_with_markov", "markov_rank", "markov_head_type"):
        assert key in out, key
    assert out["tie_word_embeddings"] is False and out["architectures"] == ["Qwen3DSparkModel"]
    for missing in ("target_layer_ids", "markov_rank", "block_size"):
        bad = dict(hf)
        del bad[missing]
        with pytest.raises(ConfigError, match=missing):
            DraftConfig.from_hf(bad)
    bad = dict(hf, markov_rank=4)
    del bad["markov_head_type"]
    with pytest.raises(ConfigError, match="markov_head_type is required"):
        DraftConfig.from_hf(bad)
    with pytest.raises(ConfigError, match="unsupported drafter architecture"):
        DraftConfig.from_hf(dict(hf, architectures=["LlamaForCausalLM"]))


def test_target_config(tiny_dir):
    hf = json.loads((tiny_dir / "target" / "config.json").read_text())
    cfg = TargetConfig.from_hf(hf)
    assert cfg.rope_theta == 1e4 and cfg.num_hidden_layers == 6
    assert TargetConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(ConfigError, match="unsupported target architecture"):
        TargetConfig.from_hf(dict(hf, architectures=["GemmaForCausalLM"], model_type="gemma"))
    with pytest.raises(ConfigError, match="rope_type"):
        TargetConfig.from_hf({**hf, "rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn"}})


def test_compatibility_check(tiny_dir):
    cfg = draft()
    cfg.check_compatible(TARGET)
    other = TargetConfig(vocab_size=65, hidden_size=16, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ConfigError, match="vocab_size 64 != target 65.*hidden_size.*num_target_layers"):
        cfg.check_compatible(other)


def test_loss_config():
    with pytest.raises(ConfigError, match="loss_decay_gamma"):
        LossConfig(loss_decay_gamma=0)
