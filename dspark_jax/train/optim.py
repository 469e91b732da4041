"""Optimizer: AdamW, linear warm-up then cosine decay to 0, global grad-norm clipping.

Only trainable params reach the optimizer: ``split_params`` moves the leaves the drafter's
declaration marks frozen (the embedding and LM head shared with the target; a family's
per-layer buffers such as ``layers/layer_scalar``) out of the tree, so no Adam moments are ever allocated for them.
"""

from __future__ import annotations

from typing import Mapping

import optax

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax.draft.model import FROZEN_KEYS
from dspark_jax.train.config import OptimizerConfig


def split_params(params: dict, config=None) -> tuple[dict, dict]:
    """(trainable, frozen) subtrees of a drafter params-shaped tree (params, axes, shapes...):
    frozen = exactly the leaves ``config``'s declaration marks ``frozen``. Without ``config``
    ``draft.model.FROZEN_KEYS`` (the default drafter declaration's frozen leaves)."""
    if config is not None:
        return params_lib.split_frozen(families.declare(config), params)
    trainable = {k: v for k, v in params.items() if k not in FROZEN_KEYS}
    frozen = {k: v for k, v in params.items() if k in FROZEN_KEYS}
    return trainable, frozen


def merge_params(trainable: Mapping, frozen: Mapping) -> dict:
    """The inverse of ``split_params``: nested dicts merged key by key."""
    out = dict(trainable)
    for k, v in frozen.items():
        if k in out and isinstance(v, Mapping) and isinstance(out[k], Mapping):
            out[k] = merge_params(out[k], v)
        else:
            out[k] = v
    return out


def learning_rate_schedule(peak: float, total_steps: int, warmup_ratio: float) -> optax.Schedule:
    """0 -> peak linearly over round(warmup_ratio * total) steps, then cosine to 0 at total."""
    total = max(int(total_steps), 1)
    warmup = min(int(round(warmup_ratio * total)), total - 1)
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                              decay_steps=total, end_value=0.0)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW(b1, b2, eps, weight_decay) with the schedule, after clip_by_global_norm(grad_clip)."""
    schedule = learning_rate_schedule(cfg.learning_rate, total_steps, cfg.warmup_ratio)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts), schedule
