"""The drafter's decode step (draft/decode.py): context cache writes and one block proposal."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

import decode_pairs
from dspark_jax.draft import decode as draft_decode


def test_context_cache_prefix_and_scatter():
    k = jnp.arange(2 * 3 * 2 * 4 * 2, dtype=jnp.float32).reshape(2, 3, 2, 4, 2)  # [Ld,B,Hkv,P,D]
    cache = draft_decode.ContextCache.from_prefix(k, -k, max_len=6)
    chex.assert_shape([cache.k, cache.v], (2, 3, 2, 6, 2))
    np.testing.assert_array_equal(cache.k[:, :, :, :4], k)
    assert not np.any(np.asarray(cache.k[:, :, :, 4:]))
    new = jnp.stack([jnp.ones((2, 3, 2, 2)), 2 * jnp.ones((2, 3, 2, 2))], axis=3)  # token t holds t + 1
    slots = jnp.array([[4, 5], [6, 7], [0, 1]])  # row 1 out of range: dropped
    out = cache.scatter(new, -new, slots)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, cache)
    np.testing.assert_array_equal(out.k[:, 0, :, 4:], new[:, 0])
    np.testing.assert_array_equal(out.v[:, 0, :, 4:], -new[:, 0])
    np.testing.assert_array_equal(out.k[:, 1], cache.k[:, 1])
    np.testing.assert_array_equal(out.k[:, 2, :, :2], new[:, 2])
    np.testing.assert_array_equal(out.k[:, 2, :, 2:4], k[:, 2, :, 2:4])
    leaves = jax.tree_util.tree_leaves(out)  # a pytree: jit/scan carry it
    assert len(leaves) == 2
    # per-layer buffers (GPU decode with per-layer draft params): the same contents, layer by layer
    apart = draft_decode.ContextCache.from_prefix(k, -k, max_len=6, per_layer=True)
    assert apart.per_layer and len(apart.k) == 2 and apart.max_len == 6
    assert apart.axes().k == (draft_decode.LAYER_CONTEXT_AXES,) * 2
    out_apart = apart.scatter(new, -new, slots)
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.stack(getattr(out_apart, name)), getattr(out, name))
    read_k, read_v = out_apart.read(5)   # whole: block_forward reads the first 5 slots in place
    assert read_k is out_apart.k and read_v is out_apart.v
    np.testing.assert_array_equal(np.stack(out.read(5)[1]), out.v[:, :, :, :5])


def test_propose_shapes_and_greedy_determinism():
    tcfg, tparams, dcfg, dparams = decode_pairs.tiny_pair(block_size=3)
    b, max_len = 2, 16
    taps = jax.random.normal(jax.random.PRNGKey(0), (b, 5, dcfg.num_context_features * dcfg.hidden_size))
    ctx = draft_decode.init_context(dparams, dcfg, taps, max_len)
    anchor, pos = jnp.array([1, 2], jnp.int32), jnp.array([5, 3], jnp.int32)
    prop = draft_decode.propose(dparams, dcfg, anchor, pos, ctx, jax.random.PRNGKey(1), 1.0, True)
    chex.assert_shape(prop.drafts, (b, 3))
    chex.assert_shape(prop.logits, (b, 3, dcfg.vocab_size))
    chex.assert_shape(prop.conf_logits, (b, 3))
    np.testing.assert_array_equal(prop.drafts, jnp.argmax(prop.logits, axis=-1))  # greedy
    again = draft_decode.propose(dparams, dcfg, anchor, pos, ctx, jax.random.PRNGKey(2), 1.0, True)
    chex.assert_trees_all_close(prop, again)  # greedy ignores the key
