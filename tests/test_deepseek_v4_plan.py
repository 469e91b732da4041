"""DeepSeek-V4 plans: the presets' parameter counts from the tensor shapes DEEPSEEK_V4.md lists,
and `plan` of a small V4 forward on 8 simulated devices with expert parallelism."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from dspark_jax import cli, presets, sharding
from dspark_jax.convert import mapping
from dspark_jax.pipelines import plan
from dspark_jax.target.deepseek_v4 import moe
from test_deepseek_v4 import _small

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
# DEEPSEEK_V4.md "Sizes": hidden, layers, heads, q-LoRA, o groups x rank, experts, expert width
SIZES = {presets.V4_FLASH: dict(H=4096, L=43, nh=64, q=1024, g=8, o=1024, E=256, I=2048),
         presets.V4_PRO: dict(H=7168, L=61, nh=128, q=1536, g=16, o=1024, E=384, I=3072)}


def _documented_tensors(cfg, H, L, nh, q, g, o, E, I) -> dict[str, tuple[int, ...]]:
    """Every upstream tensor name -> torch shape [out, in], written from DEEPSEEK_V4.md: vocab
    129280, head_dim 512 (one K = V head), 4 mHC streams (fn [24, 4H]), top-6, 3 hash layers,
    indexer 64 heads x 128, CSA ratio 4 (overlapping: 2x wide), HCA ratio 128. The per-layer
    attention type is the preset's (the doc gives no per-layer list)."""
    V, D, N, k, ih, idim = 129280, 512, 4, 6, 64, 128
    mix = (2 + N) * N
    out = {"embed.weight": (V, H), "head.weight": (V, H), "norm.weight": (H,),
           "hc_head_fn": (N, N * H), "hc_head_base": (N,), "hc_head_scale": (1,)}
    for i in range(L):
        p = f"layers.{i}."
        for s in ("attn", "ffn"):
            out.update({p + f"hc_{s}_fn": (mix, N * H), p + f"hc_{s}_base": (mix,), p + f"hc_{s}_scale": (3,)})
        out.update({p + "attn_norm.weight": (H,), p + "ffn_norm.weight": (H,),
                    p + "attn.wq_a.weight": (q, H), p + "attn.q_norm.weight": (q,),
                    p + "attn.wq_b.weight": (nh * D, q), p + "attn.wkv.weight": (D, H),
                    p + "attn.kv_norm.weight": (D,), p + "attn.wo_a.weight": (g * o, nh * D // g),
                    p + "attn.wo_b.weight": (H, g * o), p + "attn.attn_sink": (nh,),
                    p + "ffn.gate.weight": (E, H)})
        out[p + ("ffn.gate.tid2eid" if i < 3 else "ffn.gate.bias")] = (V, k) if i < 3 else (E,)
        for e in range(E):
            x = f"{p}ffn.experts.{e}."
            out.update({x + "w1.weight": (I, H), x + "w3.weight": (I, H), x + "w2.weight": (H, I)})
        out.update({p + "ffn.shared_experts.w1.weight": (I, H), p + "ffn.shared_experts.w3.weight": (I, H),
                    p + "ffn.shared_experts.w2.weight": (H, I)})
        kind = cfg.layer_types[i]
        if kind == CSA:
            for c, w in (("attn.compressor.", D), ("attn.indexer.compressor.", idim)):
                out.update({p + c + "wkv.weight": (2 * w, H), p + c + "wgate.weight": (2 * w, H),
                            p + c + "ape": (4, 2 * w), p + c + "norm.weight": (w,)})
            out.update({p + "attn.indexer.wq_b.weight": (ih * idim, q), p + "attn.indexer.weights_proj.weight": (ih, H)})
        elif kind == HCA:
            c = "attn.compressor."
            out.update({p + c + "wkv.weight": (D, H), p + c + "wgate.weight": (D, H), p + c + "ape": (128, D),
                        p + c + "norm.weight": (D,)})
    return out


@pytest.mark.parametrize("name", [presets.V4_FLASH, presets.V4_PRO])
def test_preset_parameter_counts_from_the_documented_tensor_shapes(name):
    """The preset's checkpoint tensors (from the declaration) are exactly the documented ones;
    the plan's total and active (per token: k of E routed experts) counts are their sums."""
    cfg, s = presets.TARGETS[name], SIZES[name]
    documented = _documented_tensors(cfg, **s)
    assert mapping.tensor_shapes(cfg) == documented
    total = sum(math.prod(v) for v in documented.values())
    one_expert = 3 * s["H"] * s["I"]
    active = total - s["L"] * (s["E"] - 6) * one_expert
    report = plan.target_param_report(cfg)
    assert report == {"target_params": total, "target_active_params": active}
    # what docs/scaling.md quotes: Flash 284.3B (13.8B active), Pro 1.573T (49.8B active)
    print(name, f"{total / 1e9:.1f}B total, {active / 1e9:.1f}B active")


@pytest.mark.slow
def test_plan_small_v4_forward_on_an_expert_mesh_reports_per_device_memory(tmp_path, monkeypatch, capsys):
    """`plan --target <V4 preset>` (the preset swapped for a small V4 with the same layer kinds) on
    expert=4,tensor=2: the default programs are the forward and the AR step; the expert weights
    are split 4 ways, the compiled forward reports per-device bytes and its all-reduces (the
    expert-parallel sum), and the JSON holds them."""
    cfg = _small(n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=2, hidden_size=64,
                 moe_intermediate_size=32, layer_types=(HCA, CSA), mlp_layer_types=("hash_moe", "moe"))
    monkeypatch.setitem(presets.TARGETS, presets.V4_FLASH, cfg)
    monkeypatch.setitem(presets._V4_DSPARK_LAYER_IDS, presets.V4_FLASH, (0, 1))
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--target", presets.V4_FLASH, "--mesh", "expert=4,tensor=2", "--seq-len", "256",
                     "--decode-batch", "2", "--decode-len", "256", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mesh"] == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 2}
    specs = plan.families.declare(cfg)
    leaves = plan.params_lib.abstract_params(specs, "bfloat16")
    assert report["target_params"] == plan.count_params(leaves)
    assert list(report["programs"]) == ["forward", "decode"]  # no drafter: the forward and the AR step
    fwd = report["programs"]["forward"]
    nbytes = lambda x: math.prod(x.shape) * x.dtype.itemsize  # noqa: E731
    experts = sum(nbytes(leaves["layers"][w]) for w in ("experts_w1", "experts_w3", "experts_w2"))
    whole = sum(nbytes(x) for x in plan.jax.tree.leaves(leaves))
    assert 0 < fwd["target_bytes"] <= whole - experts * 3 // 4  # the experts split (at least) 4 ways
    assert fwd["temp_bytes"] > 0 and fwd["peak_bytes"] >= fwd["argument_bytes"]
    assert moe.choose(256, cfg) == moe.SORTED
    assert fwd["collectives"]["all-reduce"]["count"] >= 2  # one expert-parallel sum per layer at least
    ar = report["programs"]["decode"]  # through the runtime protocol (init_cache / forward)
    assert ar["name"] == "ar_step" and ar["kv_cache_bytes"] > 0 and ar["peak_bytes"] > 0
    printed = capsys.readouterr().out
    assert "active per token" in printed and "[target_forward] compiled" in printed and "[ar_step]" in printed

    assert cli.main(["plan", "--target", presets.V4_FLASH, "--mesh", "expert=8", "--modes", "online"]) == 2
    assert "no released drafter" in capsys.readouterr().err


def test_expert_weights_split_over_the_expert_axis_in_the_plan():
    """Per-device parameter bytes of V4-Flash shrink with the expert axis (abstract params only)."""
    import jax
    import jax.numpy as jnp
    cfg = presets.TARGETS[presets.V4_FLASH]
    cfg = dataclasses.replace(cfg, num_hidden_layers=4, layer_types=cfg.layer_types[:4],
                              mlp_layer_types=cfg.mlp_layer_types[:4])
    sizes = {}
    for spec in ("data=8", "expert=8"):
        t, _ = plan.families.abstract_params(cfg, sharding.make_mesh(spec, jax.devices()[:8]), jnp.bfloat16)
        sizes[spec] = plan.tree_bytes_per_device(t)
    experts = 4 * 256 * 3 * 4096 * 2048 * 2
    assert sizes["data=8"] - sizes["expert=8"] == experts * 7 // 8


SLIDING = "sliding_attention"


def _shard_maps(jaxpr) -> list:
    """Every ``shard_map`` equation in ``jaxpr`` and its sub-jaxprs (scan / remat / cond bodies)."""
    from jax.extend import core as jcore
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            out.append(eqn)
        for sub in jcore.jaxprs_in_params(eqn.params):
            out += _shard_maps(sub)
    return out


def test_plan_v4_dspark_online_train_step_on_an_expert_mesh(tmp_path, monkeypatch):
    """`plan --config` of a V4 DSpark train config (the V4-Flash preset swapped for a one-layer V4,
    the module one stage on it) on `data=2,expert=2`: the online train step (the frozen target's
    forward inside it) compiles and reports per-device bytes; the module's routed experts (and
    their Adam moments) are split over the expert axis, the rest whole; inside the step the
    module's MoE is expert-parallel: shard_maps over `expert` in the forward and the backward."""
    import functools

    import jax

    from dspark_jax.train import program as program_lib
    from dspark_jax.train.config import load_config
    cfg = _small(n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=1, layer_types=(SLIDING,),
                 mlp_layer_types=("moe",))
    monkeypatch.setitem(presets.TARGETS, presets.V4_FLASH, cfg)
    # one compile at XLA's low optimisation level (the same program; this test checks its shape)
    monkeypatch.setattr(plan, "build_program", functools.partial(program_lib.build_program, fast_compile=True))
    config = tmp_path / "tiny_v4_dspark.py"
    config.write_text(
        f"CONFIG = dict(target={presets.V4_FLASH!r}, data='x.jsonl', features='online', max_length=64,\n"
        "    draft=dict(target_layer_ids=(0,), block_size=3, markov_rank=8, mask_token_id=63, num_anchors=32),\n"
        "    batch_size=2, memory=dict(remat='dots', loss_chunk=8, shard_activations=True), mesh='data=2,expert=2')\n")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", str(config), "--modes", "online", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mesh"] == {"data": 2, "fsdp": 1, "expert": 2, "tensor": 1} and report["micro_batch"] == 2
    step = report["programs"]["online"]
    tcfg = load_config(config)
    dcfg = tcfg.draft_config(cfg)
    specs = plan.families.declare(dcfg)
    trainable = {p: s for p, s in specs.items() if not s.frozen}
    whole = sum(4 * math.prod(s.shape) for s in trainable.values())
    experts = sum(4 * math.prod(s.shape) for p, s in trainable.items() if "expert" in (s.axes or ()))
    assert experts > 0 and step["params_bytes"] == whole - experts // 2  # fp32 masters: experts halved
    assert step["optimizer_bytes"] >= 2 * step["params_bytes"]           # Adam moments like their params
    assert step["target_bytes"] > 0 and step["temp_bytes"] > 0 and step["peak_bytes"] >= step["argument_bytes"]
    assert step["collectives"]["all-reduce"]["count"] >= 1

    # the module's experts go through the expert-parallel dispatch (1 stage, tokens 2 x 32 x 3 x 8
    # experts > moe.DENSE_MAX: sorted) in the forward and its transpose in the backward
    mesh = sharding.make_mesh("data=2,expert=2", jax.devices()[:4])
    prog = program_lib.build_program(dcfg, cfg, tcfg.replace(batch_size=2), mesh, total_steps=10)
    maps = _shard_maps(jax.make_jaxpr(prog.step)(*prog.abstract_args).jaxpr)
    expert_maps = [e for e in maps if "expert" in e.params["mesh"].axis_names
                   and any("expert" in str(s) for s in e.params["in_specs"])]
    assert len(expert_maps) >= 2, [str(e.params["in_specs"]) for e in maps]
