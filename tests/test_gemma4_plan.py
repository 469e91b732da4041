"""Gemma4-12B: the released drafter's shape and parameter count, its configs, and its online train
step planned on 8 simulated devices."""

import json
from pathlib import Path

import pytest

from dspark_jax import cli, families, presets
from dspark_jax import params as params_lib
from dspark_jax.draft.gemma4 import Gemma4DraftConfig
from dspark_jax.errors import ConfigError
from dspark_jax.pipelines import plan
from dspark_jax.target.gemma4 import Gemma4TargetConfig
from dspark_jax.train.config import load_config

CONFIGS = Path(__file__).parents[1] / "configs"


def released_tensor_count(kind: str) -> int:
    """By hand from the released tensor shapes (SPEC 13): hidden 3840, 5 layers, 16 heads of
    global_head_dim 512, 1 KV head with k = v (no v_proj), vocab 262144, 5 tapped layers, Markov
    rank 256 vanilla, confidence head on Markov features; MLP 15360 (the 12B preset's)."""
    h, inter, v, r, heads, d, kv, n = 3840, 15360, 262144, 256, 16, 512, 1, 5
    layer = (h * heads * d + h * kv * d + heads * d * h   # q_proj, k_proj, o_proj
             + 2 * d                                     # q_norm, k_norm
             + 3 * h * inter                             # gate, up, down
             + 4 * h + 1)                                # sandwich norms, layer_scalar
    total = 5 * layer + n * h * h + 2 * h + 2 * v * h     # layers, fc, hidden_norm + norm, embed + head
    if kind == "dspark":
        total += 2 * v * r + (h + r + 1)                  # markov w1, w2; confidence proj + bias
    return total


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_released_gemma4_drafter_shape_and_param_count(kind):
    target = presets.TARGETS[presets.GEMMA4_12B]
    cfg = presets.released_drafter(presets.GEMMA4_12B, kind=kind)
    assert isinstance(target, Gemma4TargetConfig) and isinstance(cfg, Gemma4DraftConfig)
    assert target.layer_types.count("sliding_attention") == 40 and target.layer_types[5::6] == ("full_attention",) * 8
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim,
            cfg.num_key_value_heads) == (3840, 5, 16, 512, 1)
    assert (cfg.target_layer_ids, cfg.num_target_layers, cfg.block_size, cfg.mask_token_id) == \
        ((5, 17, 29, 41, 46), 48, 7, 4)
    assert cfg.vocab_size == 262144 and cfg.final_logit_softcapping == 30.0 and cfg.text.attention_k_eq_v
    if kind == "dspark":
        assert (cfg.markov_rank, cfg.markov_head_type, cfg.enable_confidence_head,
                cfg.confidence_head_with_markov) == (256, "vanilla", True, True)
    report = plan.param_report(cfg, target)
    print(kind, report["draft_params"], report["draft_trainable_params"], report["target_params"])
    expected = released_tensor_count(kind)
    assert report["draft_params"] == report["draft_params_from_reference_shapes"] == expected
    assert report["draft_trainable_params"] == expected - 2 * 262144 * 3840 - 5  # embed, head, layer_scalar
    shapes = params_lib.torch_shapes(families.declare(cfg))
    assert shapes["layers.0.self_attn.k_proj.weight"] == (512, 3840) and "layers.0.self_attn.v_proj.weight" not in shapes
    assert shapes["fc.weight"] == (3840, 5 * 3840)
    if kind == "dspark":
        assert shapes["confidence_head.proj.weight"] == (1, 3840 + 256)
    else:
        assert "confidence_head.proj.weight" not in shapes and "markov_head.markov_w1.weight" not in shapes


@pytest.mark.parametrize("name", ["dspark_gemma4_12b", "dflash_gemma4_12b"])
def test_gemma4_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.py")
    target = presets.resolve_target(cfg.target)
    draft = cfg.draft_config(target)
    kind = name.split("_")[0]
    assert draft == presets.released_drafter(presets.GEMMA4_12B, kind=kind)
    assert cfg.batch_size == 512 and cfg.memory.remat == "dots" and cfg.features == "online"


def test_plan_refuses_a_family_mismatch_before_compiling():
    qwen = presets.TARGETS["Qwen/Qwen3-4B"]
    with pytest.raises(ConfigError, match="drafter family 'gemma4_dspark' reads 'gemma4' targets"):
        plan.plan_train_step(presets.released_drafter(presets.GEMMA4_12B), qwen,
                             load_config(CONFIGS / "dspark_gemma4_12b.py"), None)


def test_plan_gemma4_12b_online_train_step_on_8_devices(tmp_path):
    """`plan --config configs/dspark_gemma4_12b.py --modes online` on data=1,fsdp=8 (full-size
    shapes, sequence length cut to 256 to keep the compile short)."""
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", str(CONFIGS / "dspark_gemma4_12b.py"), "--mesh", "data=1,fsdp=8",
                     "--modes", "online", "--seq-len", "256", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "draft"})[:2000])
    assert report["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert report["draft_params"] == report["draft_params_from_reference_shapes"] == released_tensor_count("dspark")
    online = report["programs"]["online"]
    assert online["peak_bytes"] > 0 and online["collectives"]


def test_plan_gemma4_12b_decode_round_on_8_devices():
    """One speculative decode round of the released Gemma4-12B DSpark drafter on data=2,tensor=4
    (abstract params): compiles and reports per-device memory."""
    from dspark_jax.decode import sharded
    mesh = sharded.make_decode_mesh("data=2,tensor=4")
    prog, sizes = plan.plan_decode_round(presets.released_drafter(presets.GEMMA4_12B),
                                         presets.TARGETS[presets.GEMMA4_12B], mesh, batch=2, max_len=256)
    print(prog, sizes)
    assert prog.peak_bytes > 0 and all(v > 0 for k, v in sizes.items() if k.endswith("_bytes"))
