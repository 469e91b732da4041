"""Ahead-of-time planning: parameter counts of the released drafters, and compiled memory plans."""

import jax
import jax.numpy as jnp
import pytest

from dspark_jax import presets, sharding
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import model as draft_model
from dspark_jax.pipelines import plan
from dspark_jax.train.config import TrainConfig


def plan_config(mode: str, seq_len: int, micro_batch: int, **kw) -> TrainConfig:
    """A float32 train config of one micro-batch of ``micro_batch`` sequences (global)."""
    return TrainConfig(target="<plan>", data="<plan>", cache_dir="<plan>", features=mode, max_length=seq_len,
                       batch_size=micro_batch, compute_dtype="float32", **kw)

# Parameter counts from the reference's tensor shapes, all tensors incl. the
# frozen embedding and LM head copies. DSpark: vanilla Markov rank 256 + confidence head.
RELEASED = {
    ("Qwen/Qwen3-4B", "dspark"): 1_393_133_569,
    ("Qwen/Qwen3-8B", "dspark"): 2_371_081_729,
    ("Qwen/Qwen3-14B", "dspark"): 3_416_263_169,
    ("Qwen/Qwen3-4B", "dflash"): 1_315_339_520,
}


@pytest.mark.parametrize("target,kind", sorted(RELEASED))
def test_released_drafter_param_counts(target, kind):
    cfg = presets.released_drafter(target, kind=kind)
    shapes = jax.eval_shape(lambda: draft_model.init_params(cfg, jax.random.PRNGKey(0)))
    assert plan.count_params(shapes) == plan.reference_param_count(cfg) == RELEASED[(target, kind)]
    # Hand check of the 8B DSpark number: 5 layers of Qwen3-8B shape + fc + norms + heads.
    if (target, kind) == ("Qwen/Qwen3-8B", "dspark"):
        h, inter, v, r = 4096, 12288, 151936, 256
        layer = h * 4096 * 2 + h * 1024 * 2 + 3 * h * inter + 2 * 128 + 2 * h
        expected = 5 * layer + 5 * h * h + 2 * h + 2 * v * h + 2 * v * r + (h + r + 1)
        assert plan.count_params(shapes) == expected


def test_collectives_parser():
    hlo = """
      %all-reduce.1 = f32[128,64]{1,0} all-reduce(f32[128,64]{1,0} %x), replica_groups={}
      %ag = (bf16[8,32]{1,0}, bf16[4]{0}) all-gather-start(bf16[2,32]{1,0} %y)
      %cp = s32[10]{0} collective-permute(s32[10]{0} %z)
    """
    got = plan.collectives_in(hlo)
    assert got["all-reduce"] == {"count": 1, "bytes": 128 * 64 * 4}
    assert got["all-gather"] == {"count": 1, "bytes": 8 * 32 * 2 + 4 * 2}
    assert got["collective-permute"] == {"count": 1, "bytes": 40}


def mid_size() -> tuple[TargetConfig, DraftConfig]:
    """A 4-layer target (hidden 256, vocab 4096) and a one-layer drafter of block 4."""
    target = TargetConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    draft = DraftConfig.for_target(target, num_hidden_layers=1, target_layer_ids=(0, 2), mask_token_id=4095,
                                   num_anchors=16, markov_rank=32, block_size=4)
    return target, draft


def test_upcast_bytes_parser():
    """Entry-computation converts of bf16 parameters to f32 (plain or wrapped) are counted once;
    converts of f32 or of computed values, and other fusions, are not."""
    hlo = """
%wrapped_convert_computation (p: bf16[4,8]) -> f32[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %c = f32[4,8]{1,0} convert(%p)
}

ENTRY %main (param.1: bf16[4,8], param.2: f32[16], param.3: bf16[2,3,5]) -> f32[4,8] {
  %param.1 = bf16[4,8]{1,0} parameter(0)
  %param.2 = f32[16]{0} parameter(1)
  %param.3 = bf16[2,3,5]{2,1,0} parameter(2)
  %wrapped_convert = f32[4,8]{1,0} fusion(%param.1), kind=kLoop, calls=%wrapped_convert_computation
  %convert.1 = f32[2,3,5]{2,1,0} convert(%param.3)
  %other = f32[4,8]{1,0} fusion(%param.1), kind=kLoop, calls=%fused_computation.3
  %convert.2 = f32[16]{0} convert(%param.2)
  ROOT %r = f32[4,8]{1,0} add(%wrapped_convert, %other)
}
"""
    assert plan.upcast_bytes(hlo) == 4 * 8 * 4 + 2 * 3 * 5 * 4
    assert plan.upcast_bytes("no entry computation") == 0


def test_plan_reports_cpu_upcasts_of_bf16_weights():
    """A bf16 layer scan: whatever XLA:CPU upcasts is counted inside the temporaries; in f32
    there is nothing to upcast."""
    def layers(ws, x):
        body = lambda h, w: (jnp.einsum("bh,hv->bv", h, w, preferred_element_type=jnp.float32).astype(h.dtype), None)
        return jax.lax.scan(body, x, ws)[0]

    for dtype in (jnp.bfloat16, jnp.float32):
        p = plan.compile_plan("scan", layers, jax.ShapeDtypeStruct((4, 64, 64), dtype),
                              jax.ShapeDtypeStruct((2, 64), dtype))
        if dtype == jnp.float32:
            assert p.upcast_bytes == 0
        else:
            assert p.upcast_bytes in (0, 4 * 64 * 64 * 4) and p.upcast_bytes <= p.temp_bytes
        assert p.to_json()["upcast_bytes"] == p.upcast_bytes


def test_plan_train_step_mid_size():
    target, draft = mid_size()
    mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2", jax.devices()[:8])
    p_online, s_online = plan.plan_train_step(draft, target, plan_config("online", 128, 4), mesh)
    p_cache, s_cache = plan.plan_train_step(draft, target, plan_config("cache", 128, 4), mesh)
    full = jax.eval_shape(lambda: draft_model.init_params(draft, jax.random.PRNGKey(0)))
    trainable = plan.count_params({k: v for k, v in full.items() if k not in draft_model.FROZEN_KEYS})
    # fsdp=2 x tensor=2 shard most weights 4 ways: well under the replicated fp32 size.
    assert 0 < s_online["params_bytes"] < trainable * 4 / 2
    assert s_online["optimizer_bytes"] == pytest.approx(2 * s_online["params_bytes"], rel=0.05)
    assert s_online["target_bytes"] > 0 and s_cache["target_bytes"] == 0
    assert s_cache["batch_bytes"] > s_online["batch_bytes"]  # cached features travel with the batch
    for p in (p_online, p_cache):
        assert p.temp_bytes > 0 and p.peak_bytes > p.temp_bytes
        assert "all-reduce" in p.collectives or "reduce-scatter" in p.collectives


def test_plan_decode_round_mid_size():
    target, draft = mid_size()
    mesh = sharding.make_mesh("data=4,tensor=2", jax.devices()[:8])
    p, sizes = plan.plan_decode_round(draft, target, mesh, batch=8, max_len=256, dtype=jnp.float32)
    # KV cache: 4 layers x 8 rows x 256 slots x 2 heads x 64 x f32 x (k, v); rows split 4 ways
    # over data, KV heads 2 ways over tensor; plus the per-row int32 lengths split over data.
    assert sizes["kv_cache_bytes"] == 4 * 8 * 256 * 2 * 64 * 4 * 2 // 8 + 8 // 4 * 4
    assert p.alias_bytes > 0  # the state is donated
    assert p.collectives  # tensor-parallel weights need collectives


def test_plan_cli(tmp_path, tiny_dir, capsys):
    from dspark_jax import cli
    config = tmp_path / "tiny_plan.py"
    config.write_text(
        f"CONFIG = dict(target={str(tiny_dir / 'target')!r}, data='x.jsonl', max_length=64, mesh='data=2,fsdp=2',\n"
        "              draft=dict(num_hidden_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=511,\n"
        "                         num_anchors=4, markov_rank=8))\n")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", str(config), "--modes", "cache,decode", "--decode-len", "128",
                     "--dtype", "float32", "--json", str(out)]) == 0
    report = __import__("json").loads(out.read_text())
    assert report["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    assert report["draft_params"] == report["draft_params_from_reference_shapes"]
    assert set(report["programs"]) == {"cache", "decode"}
    assert "peak estimate" in capsys.readouterr().out
    assert cli.main(["plan", "--config", str(config), "--modes", "bogus"]) == 2


@pytest.mark.parametrize("name", ["dspark_qwen3_4b", "dspark_qwen3_8b", "dspark_qwen3_14b", "dflash_qwen3_4b",
                                  "dflash_qwen3_8b", "dflash_qwen3_14b", "dspark_qwen3_8b_production"])
def test_full_size_configs_load(name):
    from pathlib import Path

    from dspark_jax.train.config import load_config
    cfg = load_config(Path(__file__).parents[1] / "configs" / f"{name}.py")
    target = presets.resolve_target(cfg.target)
    draft = cfg.draft_config(target)
    assert cfg.target in presets.TARGETS and draft.mask_token_id == presets.QWEN3_MASK_TOKEN_ID
    mesh = sharding.parse_mesh_spec(cfg.mesh)
    assert cfg.batch_size == 512 and cfg.batch_size // cfg.grad_accum == mesh["data"] * mesh["fsdp"] * mesh["tensor"]
    if name.endswith("production"):
        assert (draft.block_size, draft.num_hidden_layers) == (5, 3)
    else:
        kind = name.split("_")[0]
        assert draft == presets.released_drafter(cfg.target, kind=kind)
        assert (cfg.loss.ce_weight, cfg.loss.l1_weight) == ((0.1, 0.9) if kind == "dspark" else (1.0, 0.0))
    assert cfg.memory.remat == "dots" and cfg.optimizer.learning_rate == 6e-4


def test_plan_memory_options_shrink_train_step():
    """Chunked heads/loss + layer remat + batch-pinned activations cut the online step's temporaries
    (no whole-batch [B, N, G, V] logits per device) and its all-reduced bytes on an fsdp mesh."""
    target = TargetConfig(vocab_size=16384, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    draft = DraftConfig.for_target(target, num_hidden_layers=2, target_layer_ids=(0, 1), mask_token_id=16383,
                                   num_anchors=32, markov_rank=16, block_size=4)
    mesh = sharding.make_mesh("fsdp=4", jax.devices()[:4])
    base, _ = plan.plan_train_step(draft, target, plan_config("online", 128, 4), mesh)
    opt, _ = plan.plan_train_step(draft, target, plan_config("online", 128, 4, memory=dict(
        remat="dots", loss_chunk=8, shard_activations=True)), mesh)
    logits_all_rows = 4 * 32 * 4 * 16384 * 4  # one f32 [B, N, G, V] for the whole micro-batch
    assert base.temp_bytes > logits_all_rows  # before: whole-batch logits live on each device
    assert opt.temp_bytes < base.temp_bytes / 2
    reduced = lambda p: p.collectives.get("all-reduce", {}).get("bytes", 0)
    assert reduced(opt) < reduced(base) / 2


def test_plan_cli_memory_options(tmp_path, tiny_dir):
    """`plan --config` takes remat / loss_chunk / shard_activations from the config; flags override."""
    from dspark_jax import cli
    config = tmp_path / "tiny_mem.py"
    config.write_text(
        f"CONFIG = dict(target={str(tiny_dir / 'target')!r}, data='x.jsonl', max_length=64, mesh='fsdp=2',\n"
        "              memory=dict(remat='dots', loss_chunk=2, shard_activations=True),\n"
        "              draft=dict(num_hidden_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=511,\n"
        "                         num_anchors=4, markov_rank=8))\n")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", str(config), "--modes", "cache", "--dtype", "float32",
                     "--no-shard-activations", "--json", str(out)]) == 0
    report = __import__("json").loads(out.read_text())
    assert report["memory_options"] == {"remat": "dots", "loss_chunk": 2, "shard_activations": False}
    assert report["programs"]["cache"]["temp_bytes"] > 0
    assert cli.main(["plan", "--config", str(config), "--modes", "cache", "--loss-chunk", "-1"]) == 2
