"""Name/layout tables between PyTorch (Hugging Face) state dicts and our params pytrees.

PyTorch ``nn.Linear.weight`` is [out, in]; our kernels are [in, out]. Per-layer
tensors ``layers.{i}.*`` are stacked along a leading layer axis. Everything here
works on numpy arrays and never changes values or dtypes (round trips are
bit-exact).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from dspark_jax.config import DraftConfig, TargetConfig


from dspark_jax.errors import CheckpointError  # noqa: E402  (re-exported)


# (our key inside a stacked layer, torch suffix inside layer i, transpose?)
LAYER_TABLE = (
    ("q_proj", "self_attn.q_proj.weight", True),
    ("k_proj", "self_attn.k_proj.weight", True),
    ("v_proj", "self_attn.v_proj.weight", True),
    ("o_proj", "self_attn.o_proj.weight", True),
    ("q_norm", "self_attn.q_norm.weight", False),
    ("k_norm", "self_attn.k_norm.weight", False),
    ("gate_proj", "mlp.gate_proj.weight", True),
    ("up_proj", "mlp.up_proj.weight", True),
    ("down_proj", "mlp.down_proj.weight", True),
    ("input_layernorm", "input_layernorm.weight", False),
    ("post_attention_layernorm", "post_attention_layernorm.weight", False),
)


def _layer_shapes(hidden, inter, heads, kv_heads, head_dim) -> dict[str, tuple[int, ...]]:
    """Torch-layout shapes of one decoder layer's tensors."""
    return {
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }


def draft_tensor_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``Qwen3DSparkModel`` checkpoint with its torch shape (SPEC section 11)."""
    h, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
    shapes = {
        "embed_tokens.weight": (v, h),
        "lm_head.weight": (v, h),
        "fc.weight": (h, cfg.num_context_features * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    layer = _layer_shapes(h, cfg.intermediate_size, cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in layer.items()})
    if cfg.has_markov:
        shapes["markov_head.markov_w1.weight"] = (v, r)
        shapes["markov_head.markov_w2.weight"] = (v, r)
        if cfg.markov_head_type == "gated":
            shapes["markov_head.gate_proj.weight"] = (r, h + r)
            shapes["markov_head.gate_proj.bias"] = (r,)
        elif cfg.markov_head_type == "rnn":
            shapes["markov_head.joint_proj.weight"] = (3 * r, 2 * r + h)
            shapes["markov_head.joint_proj.bias"] = (3 * r,)
    if cfg.enable_confidence_head:
        d = h + (r if cfg.confidence_uses_markov else 0)
        shapes["confidence_head.proj.weight"] = (1, d)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def target_tensor_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``Qwen3ForCausalLM`` checkpoint with its torch shape."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    layer = _layer_shapes(h, cfg.intermediate_size, cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    return shapes


def check_tensors(tensors: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]],
                  what: str, *, allow_extra: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped tensor."""
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise CheckpointError(f"{what}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = [k for k in tensors if k not in expected and not k.startswith(allow_extra or ("\0",))]
    if extra:
        raise CheckpointError(f"{what}: unexpected tensor {extra[0]!r}"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                              + " for this config")
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != tuple(shape):
            raise CheckpointError(f"{what}: tensor {k!r} has shape {tuple(tensors[k].shape)}, "
                                  f"expected {tuple(shape)}")
    dtypes = {np.dtype(t.dtype) for t in tensors.values()}
    if len(dtypes) > 1:
        by_dtype = {}
        for k, t in tensors.items():
            by_dtype.setdefault(np.dtype(t.dtype).name, k)
        raise CheckpointError(f"{what}: tensors have mixed dtypes {sorted(by_dtype)}; e.g. "
                              + ", ".join(f"{k!r} is {d}" for d, k in sorted(by_dtype.items())))
    for k, t in tensors.items():
        if not np.issubdtype(np.dtype(t.dtype), np.floating) and np.dtype(t.dtype).name != "bfloat16":
            raise CheckpointError(f"{what}: tensor {k!r} has dtype {t.dtype}, expected a float dtype")


def param_sources(config: DraftConfig | TargetConfig) -> dict[tuple[str, ...], tuple[str, bool]]:
    """Where every leaf of our params tree lives in the PyTorch state dict.

    our path -> (torch name, transpose?). A name containing ``{i}`` marks a
    stacked leaf [L, ...] holding one torch tensor per layer.
    """
    if isinstance(config, TargetConfig):
        prefix = "model."
        table = {("embed_tokens",): ("model.embed_tokens.weight", False),
                 ("norm",): ("model.norm.weight", False)}
        if not config.tie_word_embeddings:
            table[("lm_head",)] = ("lm_head.weight", True)
    else:
        prefix = ""
        table = {("embed_tokens",): ("embed_tokens.weight", False), ("lm_head",): ("lm_head.weight", True),
                 ("fc",): ("fc.weight", True), ("hidden_norm",): ("hidden_norm.weight", False),
                 ("norm",): ("norm.weight", False)}
        if config.has_markov:
            table[("markov_head", "markov_w1")] = ("markov_head.markov_w1.weight", False)
            table[("markov_head", "markov_w2")] = ("markov_head.markov_w2.weight", True)
            extra = {"gated": "gate_proj", "rnn": "joint_proj"}.get(config.markov_head_type)
            if extra:
                table[("markov_head", extra, "kernel")] = (f"markov_head.{extra}.weight", True)
                table[("markov_head", extra, "bias")] = (f"markov_head.{extra}.bias", False)
        if config.enable_confidence_head:
            table[("confidence_head", "kernel")] = ("confidence_head.proj.weight", True)
            table[("confidence_head", "bias")] = ("confidence_head.proj.bias", False)
    for ours, suffix, transpose in LAYER_TABLE:
        table[("layers", ours)] = (f"{prefix}layers.{{i}}.{suffix}", transpose)
    return table


def _from_torch(config, tensors: Mapping[str, np.ndarray]) -> dict:
    params: dict = {}
    for path, (name, transpose) in param_sources(config).items():
        fix = (lambda a: a.T) if transpose else (lambda a: a)
        if "{i}" in name:
            leaf = np.stack([fix(tensors[name.format(i=i)]) for i in range(config.num_hidden_layers)])
        else:
            leaf = np.ascontiguousarray(fix(tensors[name]))
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return params


def _to_torch(config, params: Mapping) -> dict[str, np.ndarray]:
    out = {}
    for path, (name, transpose) in param_sources(config).items():
        leaf = params
        for key in path:
            leaf = leaf[key]
        leaf = np.asarray(leaf)
        fix = (lambda a: a.T) if transpose else (lambda a: a)
        if "{i}" in name:
            for i in range(leaf.shape[0]):
                out[name.format(i=i)] = np.ascontiguousarray(fix(leaf[i]))
        else:
            out[name] = np.ascontiguousarray(fix(leaf))
    return out


def draft_from_torch(cfg: DraftConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """Torch-named tensors of a DSpark checkpoint -> our params tree (numpy leaves)."""
    check_tensors(tensors, draft_tensor_shapes(cfg), "drafter checkpoint")
    return _from_torch(cfg, tensors)


def draft_to_torch(cfg: DraftConfig, params: Mapping) -> dict[str, np.ndarray]:
    """Our params tree -> torch-named tensors (numpy, torch layout)."""
    out = _to_torch(cfg, params)
    check_tensors(out, draft_tensor_shapes(cfg), "drafter params")
    return out


def target_from_torch(cfg: TargetConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """Torch-named tensors of a Qwen3ForCausalLM checkpoint -> our params tree."""
    tensors = dict(tensors)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        # Some exports write the tied head explicitly; it must equal the embedding.
        if not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise CheckpointError("target checkpoint: tie_word_embeddings=true but 'lm_head.weight' "
                                  "differs from 'model.embed_tokens.weight'")
        del tensors["lm_head.weight"]
    check_tensors(tensors, target_tensor_shapes(cfg), "target checkpoint")
    return _from_torch(cfg, tensors)


def target_to_torch(cfg: TargetConfig, params: Mapping) -> dict[str, np.ndarray]:
    """Our params tree -> torch-named tensors of a Qwen3ForCausalLM checkpoint."""
    out = _to_torch(cfg, params)
    check_tensors(out, target_tensor_shapes(cfg), "target params")
    return out
