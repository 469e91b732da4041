"""What the flash-decoding kernels share: the softmax partials they return over a cache are merged
here with the block's own keys (``merge``), and ``dispatch`` lowers a kernel only into the programs
of its platform. ``NEG_INF`` and ``SMALL_QUERY`` are the masking value and the decode-step query
count of every attention in the package (``nn`` reads them from here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # large finite negative, so fully masked rows stay NaN-free
# a decode step's few queries per row (the verify block, the drafter's block, the AR step): the
# kernels take at most this many, and ``nn.cache_scores`` reads K in place on CUDA up to it
SMALL_QUERY = 16


def dispatch(xla_path, kernel_path, *args, platform: str = "cuda"):
    """``xla_path(*args)`` on every backend but ``platform`` (CUDA for ``flash``; TPU for ``flash_tpu``), where
    ``kernel_path(*args)`` (the same values, its cache part from a kernel's ``cache_partials``;
    differentiated as ``xla_path``: the kernels have no backward). Only the matching branch is
    lowered: other platforms' programs never see the kernel."""
    @jax.custom_vjp
    def kernel(*a):
        return kernel_path(*a)

    kernel.defvjp(lambda *a: (kernel_path(*a), a), lambda a, g: jax.vjp(xla_path, *a)[1](g))
    return jax.lax.platform_dependent(*args, default=xla_path, **{platform: kernel})


def merge(o: jax.Array, m: jax.Array, l: jax.Array, scores: jax.Array, visible: jax.Array,
          scale: float) -> tuple[jax.Array, jax.Array]:
    """One softmax over [cache ; block]: the cache's partials (o [..., D], m, l [...] from
    ``cache_partials``) and the block's own raw f32 scores [..., K] (``visible`` broadcast to
    them). Returns the cache part's output [..., D] and the block keys' probabilities [..., K],
    both normalised f32; everything zero for a row with nothing visible (``nn.masked_softmax``)."""
    s = jnp.where(visible, scores * scale, NEG_INF)
    top = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(visible, jnp.exp(s - top[..., None]), 0.0)
    w = jnp.exp(m - top)
    total = w * l + jnp.sum(p, axis=-1)
    inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    return o * (w * inv)[..., None], p * inv[..., None]
