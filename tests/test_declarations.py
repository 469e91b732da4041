"""One declaration per model drives init, axes, abstract params, conversion and the registry."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from dspark_jax import families, params, sharding
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.convert import mapping
from dspark_jax.convert.safetensors_io import TensorReader, read_tensors
from dspark_jax.draft import model as draft_model
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.params import ParamSpec
from dspark_jax.target import qwen3

FIXTURE = Path(__file__).parent / "fixtures" / "dspark_qwen3_tiny"
TARGET = TargetConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
HEADS = {  # every drafter head layout the declaration knows
    "dflash": dict(markov_rank=0, enable_confidence_head=False),
    "dflash_conf": dict(markov_rank=0, enable_confidence_head=True, confidence_head_with_markov=False),
    "vanilla": dict(markov_rank=8, markov_head_type="vanilla", enable_confidence_head=False),
    "vanilla_conf_markov": dict(markov_rank=8, markov_head_type="vanilla"),
    "gated_conf": dict(markov_rank=8, markov_head_type="gated", confidence_head_with_markov=False),
    "rnn_conf_markov": dict(markov_rank=8, markov_head_type="rnn"),
}
CONFIGS = {"target": TARGET, "target_tied": dataclasses.replace(TARGET, tie_word_embeddings=True)}
CONFIGS.update({name: DraftConfig.for_target(TARGET, num_hidden_layers=2, target_layer_ids=(0, 2), **kw)
                for name, kw in HEADS.items()})


def _flat(tree):
    return traverse_util.flatten_dict(tree, is_leaf=lambda _, x: not isinstance(x, dict))


def _module_init(cfg):
    return (qwen3 if isinstance(cfg, TargetConfig) else draft_model).init_params(cfg, jax.random.key(0))


def _module_axes(cfg):
    return (qwen3 if isinstance(cfg, TargetConfig) else draft_model).param_axes(cfg)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_declaration_drives_every_tree(name):
    cfg = CONFIGS[name]
    specs = families.declare(cfg)
    init = _flat(jax.eval_shape(lambda: _module_init(cfg)))
    axes = _flat(_module_axes(cfg))
    abstract = _flat(params.abstract_params(specs, jnp.bfloat16))
    assert set(specs) == set(init) == set(axes) == set(abstract)
    for path, spec in specs.items():
        assert init[path].shape == spec.shape == abstract[path].shape, path
        assert abstract[path].dtype == jnp.bfloat16
        assert axes[path] == spec.axes and len(spec.axes) == len(spec.shape)
    # torch side: names and shapes follow from the same specs, and every leaf is reached
    shapes = params.torch_shapes(specs)
    assert shapes == mapping.tensor_shapes(cfg)
    assert sum(int(np.prod(s)) for s in shapes.values()) == sum(int(np.prod(s.shape)) for s in specs.values())
    assert set(mapping.param_sources(cfg)) == set(specs)
    # frozen leaves: exactly the drafter's shared embedding and head
    frozen = params.frozen_paths(specs)
    assert frozen == (() if isinstance(cfg, TargetConfig) else tuple((k,) for k in draft_model.FROZEN_KEYS))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_round_trip_and_split(name):
    cfg = CONFIGS[name]
    specs = families.declare(cfg)
    rng = np.random.default_rng(0)
    tree = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                        params.abstract_params(specs))
    tensors = params.to_torch(specs, tree)
    assert {k: v.shape for k, v in tensors.items()} == params.torch_shapes(specs)
    back = params.from_torch(specs, tensors)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        assert a.tobytes() == b.tobytes()
    trainable, frozen = params.split_frozen(specs, tree)
    assert set(_flat(trainable)) | set(_flat(frozen)) == set(specs)
    assert set(_flat(frozen)) == set(params.frozen_paths(specs))


@pytest.mark.parametrize("part", ["draft", "target"])
def test_declaration_matches_fixture_checkpoint(part):
    d = FIXTURE / part
    hf = json.loads((d / "config.json").read_text())
    family = families.for_hf(hf)
    cfg = family.config_from_hf(hf)
    assert family.kind == part and families.for_config(cfg) is family
    infos = TensorReader(d).infos
    want = params.torch_shapes(family.declare(cfg))
    assert {k: tuple(v.shape) for k, v in infos.items()} == want
    loaded = mapping.from_torch(cfg, read_tensors(d))
    assert jax.tree.map(np.shape, loaded) == params.shapes(family.declare(cfg))


def test_stacked_leaves_hold_the_declared_layers():
    spec = families.declare(TARGET)[("layers", "q_proj")]
    assert spec.layer_ids == (0, 1, 2, 3) and spec.torch_shape == (32, 32) and spec.transpose
    assert spec.torch_names()[2] == "model.layers.2.self_attn.q_proj.weight"
    sub = ParamSpec((2, 3, 5), ("layers", None, None), "x.{i}.w", transpose=True, layer_ids=(4, 9))
    tensors = params.to_torch({("w",): sub}, {"w": np.arange(30.0).reshape(2, 3, 5)})
    assert list(tensors) == ["x.4.w", "x.9.w"] and tensors["x.9.w"].shape == (5, 3)


def test_default_init_keys_are_per_path():
    specs = {("a",): ParamSpec((4,), (None,), "a"), ("b",): ParamSpec((4,), (None,), "b"),
             ("c",): ParamSpec((4,), (None,), "c", init="zeros")}
    p1 = params.init_params(specs, jax.random.key(1))
    p2 = params.init_params({("b",): specs[("b",)]}, jax.random.key(1))
    assert not np.array_equal(p1["a"], p1["b"]) and np.array_equal(p1["b"], p2["b"])
    assert np.all(np.asarray(p1["c"]) == 0)


def test_paramspec_validates():
    with pytest.raises(ValueError, match="rank"):
        ParamSpec((2, 3), (None,), "w")
    with pytest.raises(ValueError, match="layer_ids"):
        ParamSpec((2, 3), (None, None), "l.{i}.w")
    with pytest.raises(ValueError, match="leading dim"):
        ParamSpec((2, 3), (None, None), "l.{i}.w", layer_ids=(0, 1, 2))


def test_unknown_architecture_lists_known_ones():
    for hf in ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
               {"model_type": "llama"}):
        with pytest.raises(families.UnknownArchitectureError) as e:
            families.for_hf(hf, "x/config.json")
        assert isinstance(e.value, CheckpointError) and isinstance(e.value, ConfigError)
        msg = str(e.value)
        assert msg.startswith("x/config.json") and "Qwen3ForCausalLM" in msg and "Qwen3DSparkModel" in msg
    assert families.for_hf({"model_type": "qwen3"}).name == "qwen3"
    assert families.for_hf({"model_type": "qwen3", "target_layer_ids": [0]}).name == "qwen3_dspark"
    with pytest.raises(ConfigError, match="not the config class"):
        families.for_config(object())


def test_register_a_family(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))

    @dataclasses.dataclass(frozen=True)
    class ToyConfig:
        width: int = 4

        @classmethod
        def from_hf(cls, hf):
            return cls(hf["width"])

    def declare(cfg):
        body = {("w",): ParamSpec((cfg.width, cfg.width), ("embed", "mlp"), "model.w.weight", transpose=True)}
        return params.rename_torch(body, "model.", "model.language_model.")

    toy = families.register(params.Family(
        name="toy", kind="draft", architectures=("ToyDrafter",), model_types=("toy",),
        config_cls=ToyConfig, declare=declare, forward="dspark_jax.draft.model", pairs_with="toy_target"))
    cfg = families.for_hf({"architectures": ["ToyDrafter"], "width": 3}).config_from_hf({"width": 3})
    assert families.for_config(cfg) is toy and "ToyDrafter" in families.known_architectures("draft")
    assert mapping.tensor_shapes(cfg) == {"model.language_model.w.weight": (3, 3)}
    with pytest.raises(ValueError, match="already read by family 'toy'"):
        families.register(dataclasses.replace(toy, name="toy2"))
    with pytest.raises(ConfigError, match="drafter family 'toy' reads 'toy_target' targets, not 'qwen3'"):
        families.check_pair(cfg, TARGET)
    families.check_pair(CONFIGS["vanilla"], TARGET)


def test_tied_head_rule(tmp_path):
    cfg = CONFIGS["target_tied"]
    tensors = params.to_torch(families.declare(cfg), jax.tree.map(np.asarray, qwen3.init_params(cfg, jax.random.key(0))))
    extra = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"].copy()})
    assert set(mapping.from_torch(cfg, extra)) == {"embed_tokens", "norm", "layers"}
    extra["lm_head.weight"] = extra["lm_head.weight"] + 1
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        mapping.from_torch(cfg, extra)


def test_logical_to_spec_refuses_a_mesh_axis_twice():
    with pytest.raises(ConfigError, match=r"'vocab' and 'mlp'.*mesh axis 'tensor'"):
        sharding.logical_to_spec(("vocab", "mlp"))
    rules = dict(sharding.DEFAULT_RULES, embed=("fsdp", "tensor"))
    with pytest.raises(ConfigError, match=r"'embed' and 'heads'.*'tensor'"):
        sharding.logical_to_spec(("layers", "embed", "heads"), rules)
    # indivisible dims still fall back to replication; distinct axes are fine
    mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
    assert sharding.logical_to_spec(("vocab", "embed"), shape=(3, 4), mesh=mesh) == P(None, "fsdp")


def test_abstract_params_equal_init_shapes_and_axes():
    """The planner's abstract params (from the declaration) equal eval_shape of init + axes."""
    mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
    for cfg in CONFIGS.values():
        module = families.for_config(cfg).module()
        ours, ours_sh = families.abstract_params(cfg, mesh, jnp.bfloat16)
        shapes = jax.eval_shape(lambda: module.init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
        theirs_sh = sharding.param_shardings(module.param_axes(cfg), mesh, shapes)
        theirs = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              shapes, theirs_sh)
        assert jax.tree.structure(ours) == jax.tree.structure(theirs)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)
        assert jax.tree.leaves(ours_sh) == jax.tree.leaves(theirs_sh)


def test_given_leaves_are_taken_not_drawn():
    cfg = CONFIGS["vanilla"]
    embed = jnp.full((TARGET.vocab_size, TARGET.hidden_size), 0.5, jnp.float32)
    p = draft_model.init_params(cfg, jax.random.key(0), jnp.bfloat16, embed_tokens=embed)
    ref = draft_model.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    assert p["embed_tokens"].dtype == jnp.bfloat16 and np.all(np.asarray(p["embed_tokens"], np.float32) == 0.5)
    assert np.array_equal(np.asarray(p["fc"], np.float32), np.asarray(ref["fc"], np.float32))
    with pytest.raises(ValueError, match="has shape"):
        draft_model.init_params(cfg, jax.random.key(0), lm_head=embed)
