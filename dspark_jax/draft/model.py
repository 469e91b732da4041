"""The DSpark drafter: params, logical axes and the training forward.

Params (names follow the PyTorch state dict; kernels are [in, out])::

    embed_tokens [V, H]   lm_head [H, V]   (frozen copies of the target's)
    fc [n*H, H]   hidden_norm [H]   norm [H]   layers {stacked, leading axis Ld}
    markov_head {...}        (markov_rank > 0, see markov.py)
    confidence_head {...}    (enable_confidence_head, see confidence.py)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.config import DraftConfig
from dspark_jax.params import ParamSpec
from dspark_jax.draft import backbone, confidence, markov
from dspark_jax.draft import blocks
from dspark_jax.target import qwen3

FROZEN_KEYS = ("embed_tokens", "lm_head")  # == params.frozen_paths(declare(cfg)) (tested)


def declare(config: DraftConfig) -> dict[tuple, ParamSpec]:
    """Every leaf of a ``Qwen3DSparkModel`` params tree, in checkpoint order (SPEC section 11).

    Initial keys follow ``split(rng, 6)``: embed, lm_head, fc, layers, markov, confidence.
    """
    h, v, n = config.hidden_size, config.vocab_size, config.num_context_features
    specs = {
        ("embed_tokens",): ParamSpec((v, h), ("vocab", "embed"), "embed_tokens.weight",
                                     frozen=True, rng_path=((6, 0),)),
        ("lm_head",): ParamSpec((h, v), ("embed", "vocab"), "lm_head.weight", transpose=True,
                                frozen=True, rng_path=((6, 1),)),
        ("fc",): ParamSpec((n * h, h), ("features", "embed"), "fc.weight", transpose=True, rng_path=((6, 2),)),
        ("hidden_norm",): ParamSpec((h,), (None,), "hidden_norm.weight", init="ones"),
        ("norm",): ParamSpec((h,), (None,), "norm.weight", init="ones"),
    }
    if config.has_markov:
        specs.update(params_lib.with_prefix(markov.declare(config, rng_path=((6, 4),)),
                                            ("markov_head",), "markov_head."))
    if config.enable_confidence_head:
        specs.update(params_lib.with_prefix(confidence.declare(config, rng_path=((6, 5),)),
                                            ("confidence_head",), "confidence_head."))
    specs.update(qwen3.declare_layers(config, "", ((6, 3),)))
    return specs


def init_params(config: DraftConfig, rng: jax.Array, dtype=jnp.float32, *,
                embed_tokens: jax.Array | None = None, lm_head: jax.Array | None = None) -> dict:
    """Random drafter params; pass the target's ``embed_tokens``/``lm_head`` [H, V] to share them."""
    given = {(k,): x for k, x in (("embed_tokens", embed_tokens), ("lm_head", lm_head)) if x is not None}
    return params_lib.init_params(declare(config), rng, dtype, given)


def param_axes(config: DraftConfig) -> dict:
    """Logical axis names, same tree structure as ``init_params``."""
    return params_lib.param_axes(declare(config))


def compute_logits(params: dict, hidden: jax.Array) -> jax.Array:
    """Base logits U = LMHead(h): [..., H] -> [..., V] float32."""
    return jnp.einsum("...h,hv->...v", hidden, params["lm_head"].astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


class TrainForward(NamedTuple):
    """One training forward. All [B, N, G] unless noted; V = vocab."""

    draft_logits: jax.Array           # [B, N, G, V] after the Markov bias
    confidence_logits: jax.Array | None  # before the sigmoid
    target_ids: jax.Array             # labels y
    eval_mask: jax.Array              # bool, contiguous prefix per block
    aligned_target_logits: jax.Array | None  # [B, N, G, V] target logits T
    block_keep_mask: jax.Array        # [B, N]


def training_forward(
    params: dict,
    config: DraftConfig,
    input_ids: jax.Array,
    target_hidden_states: jax.Array,
    loss_mask: jax.Array,
    anchor_positions: jax.Array,
    block_keep_mask: jax.Array,
    target_last_hidden_states: jax.Array | None = None,
    compute_dtype=None,
    ops=None,
) -> TrainForward:
    """All anchors' blocks in one backbone call (paper section 3: blocks, Markov head, confidence head).

    input_ids [B, S]; target_hidden_states [B, S, n*H] (raw layer outputs,
    concatenated in target_layer_ids order); loss_mask [B, S];
    anchor_positions, block_keep_mask [B, N]; target_last_hidden_states
    [B, S, H] (post final norm) for the aligned target logits. ``ops``: the family's
    backbone functions (see ``QWEN3_OPS``; None = Qwen3).
    """
    th = training_hidden(params, config, input_ids, target_hidden_states, loss_mask, anchor_positions,
                         block_keep_mask, target_last_hidden_states, compute_dtype, ops=ops)
    p = cast_params(params, compute_dtype or params["fc"].dtype)
    logits, conf, aligned = block_heads(p, config, th.hidden, th.prev_ids, th.target_hidden, ops=ops)
    return TrainForward(logits, conf, th.target_ids, th.eval_mask, aligned, th.block_keep_mask)


class TrainHidden(NamedTuple):
    """Backbone outputs of one training forward, before the vocabulary-sized heads.

    hidden [B, N, G, H] (after the final norm); prev_ids [B, N, G] (anchor, then labels);
    target_ids, eval_mask [B, N, G]; target_hidden [B, N, G, H] (the target's last hidden
    state at each label's preceding position, or None); block_keep_mask [B, N].
    """

    hidden: jax.Array
    prev_ids: jax.Array
    target_ids: jax.Array
    eval_mask: jax.Array
    target_hidden: jax.Array | None
    block_keep_mask: jax.Array


def cast_params(params: dict, dtype) -> dict:
    """Every leaf cast to ``dtype`` (the compute copy of fp32 masters)."""
    return jax.tree.map(lambda a: a.astype(dtype), params)


def training_hidden(
    params: dict,
    config: DraftConfig,
    input_ids: jax.Array,
    target_hidden_states: jax.Array,
    loss_mask: jax.Array,
    anchor_positions: jax.Array,
    block_keep_mask: jax.Array,
    target_last_hidden_states: jax.Array | None = None,
    compute_dtype=None,
    remat: bool | str = False,
    constrain=None,
    ops=None,
) -> TrainHidden:
    """``training_forward`` up to (not including) the [.., V] heads; same arguments.

    ``block_heads`` applied to the result (whole or per chunk of anchors) gives
    exactly ``training_forward``'s logits. ``remat`` is passed to
    ``backbone.block_forward``; ``constrain`` (optional, x -> x) pins the
    sharding of [B, ...] activations (batch-sharded).
    """
    ops = ops or QWEN3_OPS
    dtype = compute_dtype or params["fc"].dtype
    p = cast_params(params, dtype)
    pin = constrain or (lambda x: x)
    b, s = input_ids.shape
    g = config.block_size
    anchors = anchor_positions.astype(jnp.int32)
    keep = block_keep_mask.astype(bool)

    labels, eval_mask, safe = blocks.block_targets(input_ids, loss_mask, anchors, keep, g)
    block_ids = blocks.block_input_ids(input_ids, anchors, keep, g, config.mask_token_id)

    ctx = pin(ops.project_context(p, config, pin(target_hidden_states.astype(dtype))))
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    ctx_k, ctx_v = ops.context_kv(p, config, ctx, ctx_pos)
    ctx_mask = jnp.arange(s)[None, None, :] < anchors[:, :, None]
    block_pos = anchors[:, :, None] + jnp.arange(g, dtype=jnp.int32)
    hidden = pin(ops.block_forward(p, config, pin(ops.embed_block(p, config, block_ids)), block_pos,
                                   ctx_k, ctx_v, ctx_mask, keep, remat=remat))

    anchor_tok = jnp.take_along_axis(input_ids, anchors, axis=1)
    prev = jnp.concatenate([anchor_tok[..., None], labels[..., :-1]], axis=-1)
    th = None
    if target_last_hidden_states is not None:
        idx = jnp.maximum(safe - 1, 0).reshape(b, -1)
        th = jnp.take_along_axis(pin(target_last_hidden_states.astype(dtype)), idx[..., None], axis=1)
        th = pin(th.reshape(*safe.shape, -1))
    return TrainHidden(hidden, prev, labels, eval_mask, th, keep)


def block_heads(p: dict, config: DraftConfig, hidden: jax.Array, prev_ids: jax.Array,
                target_hidden: jax.Array | None = None, ops=None):
    """The [.., V] heads of ``training_forward`` on (a chunk of) backbone outputs.

    p: compute-dtype params (``cast_params``); hidden [..., G, H]; prev_ids [..., G];
    target_hidden [..., G, H] or None. Returns (draft logits [..., G, V] after the Markov
    bias, confidence logits [..., G] or None, aligned target logits [..., G, V] or None).
    """
    ops = ops or QWEN3_OPS
    if ops.block_heads is not None:
        return ops.block_heads(p, config, hidden, prev_ids, target_hidden)
    logits = ops.compute_logits(p, config, hidden)
    if config.has_markov:
        logits = markov.teacher_forced(p["markov_head"], config, logits, prev_ids, hidden)
    conf = confidence.logits(p, config, hidden, prev_ids) if config.enable_confidence_head else None
    aligned = ops.compute_logits(p, config, target_hidden) if target_hidden is not None else None
    return logits, conf, aligned


# The Qwen3 drafter's runtime record (``runtime.DraftRuntime``): the backbone functions
# ``training_forward``/``training_hidden``/``block_heads`` (``ops`` argument) and the decode-time
# drafter call. Gemma4's is ``dspark_jax.draft.gemma4.OPS``.
QWEN3_OPS = runtime.DraftRuntime(
    project_context=backbone.project_context,          # (params, config, features [B,S,n*H]) -> ctx
    context_kv=backbone.context_kv,                    # (params, config, ctx, positions) -> k, v
    block_forward=backbone.block_forward,              # (params, config, embeds, positions, ...) -> h
    embed_block=lambda p, config, ids: p["embed_tokens"][ids],        # block input embeddings
    compute_logits=lambda p, config, hidden: compute_logits(p, hidden),  # [..., H] -> [..., V] f32
    per_layer=True,                                    # per-layer layers on GPUs (params.for_platform)
)

FAMILY = params_lib.Family(
    name="qwen3_dspark", kind="draft", architectures=("Qwen3DSparkModel",), model_types=("qwen3", None),
    config_cls=DraftConfig, declare=declare, forward=__name__, pairs_with="qwen3", runtime=QWEN3_OPS)
