"""DeepSeek-V4.1's Engram memory: n-gram hash ids and the gated injection into the streams.

Hash ids (per Engram layer l, at position p): the compressed ids c of the tokens p, p-1, ..,
p-(n-1) (n = ``engram_max_ngram_size``; before the sequence start: the pad token's id), each times
an odd per-(layer, look-back) multiplier m (numpy ``default_rng(10007 * layer)``), XOR-ed one
look-back at a time: after look-back j the running value is the (j+1)-gram's hash, taken modulo
each head's prime (drawn in order above ``engram_vocab_size``, never reused) plus that column's
bucket offset. Columns: (n - 1) n-gram sizes x ``engram_n_heads`` heads.

The products are 64-bit (< 2^63); JAX computes in 32 bits, so ``tables`` holds c * m per token
as (high, low) uint32 halves (host-side, exact) and the modulo is done on the halves
(``_mod``). The compressed id map comes from the tokenizer (``token_map``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.errors import CheckpointError, ConfigError


def token_map(tokenizer_json: Path, vocab_size: int, compressed_vocab_size: int, pad_id: int) -> list[int]:
    """[vocab_size] compressed ids of a ``tokenizers`` tokenizer.json: tokens that normalize alike
    (NFKC, NFD, accents stripped, lowercase, whitespace runs -> one space, stripped; a lone space
    kept) share an id, numbered in order of first appearance; a partial UTF-8 token is keyed by its
    raw form. Ids past the tokenizer's vocabulary take the pad token's id. ConfigError when the
    count differs from ``engram_compressed_vocab_size`` (the hash would address other rows)."""
    try:
        from tokenizers import Regex, Tokenizer, normalizers
    except ImportError as e:  # the hf extra
        raise ConfigError("the Engram layers need the 'tokenizers' package (pip install 'dspark-jax[hf]')") from e
    path = Path(tokenizer_json)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; DeepSeek-V4.1's Engram hashes are defined through the tokenizer")
    tok = Tokenizer.from_file(str(path))
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    keys: dict[str, int] = {}
    n = tok.get_vocab_size(with_added_tokens=True)
    ids = []
    for t in range(n):
        text = tok.decode([t], skip_special_tokens=False)
        key = tok.id_to_token(t) if "\ufffd" in text else (norm.normalize_str(text) or text)
        ids.append(keys.setdefault(key, len(keys)))
    if len(keys) != compressed_vocab_size:
        raise ConfigError(f"{path}: the tokenizer gives {len(keys)} compressed Engram ids, config.json "
                          f"engram_compressed_vocab_size is {compressed_vocab_size}")
    return (ids + [ids[pad_id]] * vocab_size)[:vocab_size]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, int(n ** 0.5) + 1))


@functools.lru_cache(maxsize=None)
def primes(cfg) -> tuple[tuple[int, ...], ...]:
    """Per Engram layer, its columns' primes in (n-gram size, head) order."""
    out, seen = [], set()
    for _ in cfg.engram_layer_ids:
        row = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            current = cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                row.append(current)
        out.append(tuple(row))
    return tuple(out)


def multipliers(cfg) -> np.ndarray:
    """[Le, n] int64 odd multipliers, one per (Engram layer, look-back)."""
    bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
    return np.stack([np.random.default_rng(10007 * i).integers(0, bound, size=(cfg.engram_max_ngram_size,),
                                                               dtype=np.int64) * 2 + 1
                     for i in cfg.engram_layer_ids])


@functools.lru_cache(maxsize=None)
def tables(cfg) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) uint32 [Le, n, V + 1]: token v's compressed id times each multiplier (row V: the
    pad id's), the 64-bit products split in halves."""
    if cfg.engram_token_map is None:
        raise ConfigError("DeepSeek-V4.1 Engram layers need the tokenizer's compressed ids: load the config "
                          "with its checkpoint directory (tokenizer.json)")
    cmap = np.asarray(cfg.engram_token_map.ids, np.uint64)
    cmap = np.concatenate([cmap, cmap[cfg.engram_pad_token_id:cfg.engram_pad_token_id + 1]])
    prod = cmap[None, None, :] * multipliers(cfg).astype(np.uint64)[:, :, None]
    return (prod >> np.uint64(32)).astype(np.uint32), (prod & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _mulmod(a: jax.Array, c: int, p: int) -> jax.Array:
    """(a * c) mod p for uint32 a < p < 2^31 and a static c < p (double and add)."""
    if p < (1 << 16):
        return (a * jnp.uint32(c)) % jnp.uint32(p)
    out, base = jnp.zeros_like(a), a
    while c:
        if c & 1:
            out = (out + base) % jnp.uint32(p)
        base, c = (base + base) % jnp.uint32(p), c >> 1
    return out


def _mod(hi: jax.Array, lo: jax.Array, p: int) -> jax.Array:
    """(hi * 2^32 + lo) mod p, uint32 halves, p < 2^31."""
    return (_mulmod(hi % jnp.uint32(p), (1 << 32) % p, p) + lo % jnp.uint32(p)) % jnp.uint32(p)


def hash_ids(cfg, tokens: jax.Array, history: jax.Array | None = None) -> jax.Array:
    """[B, T, Le, cols] int32 table rows (bucket offsets included) of tokens [B, T]; ``history``
    [B, n-1] the tokens before them (oldest first; -1: before the sequence start), None: the
    sequence starts at tokens[:, 0]."""
    n = cfg.engram_max_ngram_size
    b, t = tokens.shape
    v = cfg.vocab_size
    if history is None:
        history = jnp.full((b, n - 1), -1, jnp.int32)
    seq = jnp.concatenate([history.astype(jnp.int32), tokens.astype(jnp.int32)], axis=1)
    seq = jnp.where(seq < 0, v, seq)  # the pad row
    hi_t, lo_t = (jnp.asarray(a) for a in tables(cfg))
    out = []
    for k, layer_primes in enumerate(primes(cfg)):
        hi = lo = None
        cols = []
        for j in range(n):
            ids = seq[:, n - 1 - j:n - 1 - j + t]  # look-back j
            h, l_ = hi_t[k, j][ids], lo_t[k, j][ids]
            hi, lo = (h, l_) if j == 0 else (hi ^ h, lo ^ l_)
            if j:
                heads = layer_primes[(j - 1) * cfg.engram_n_heads:j * cfg.engram_n_heads]
                cols += [_mod(hi, lo, p) for p in heads]
        offsets = np.concatenate([[0], np.cumsum(layer_primes)[:-1]]).astype(np.int32)
        out.append(jnp.stack(cols, -1).astype(jnp.int32) + jnp.asarray(offsets))
    return jnp.stack(out, axis=2)


def inject(cfg, p: dict, table: dict, streams: jax.Array, ids: jax.Array) -> jax.Array:
    """One Engram layer: streams [B, S, N, H] plus a gated value, from hash rows ``ids`` [B, S, cols]
    of ``table`` (rows [R, d], scale [R, d / 32]); ``p``: this layer's wkv, q_weight, k_weight.
    gate = sigmoid(signed sqrt of the per-stream normalised product stream . key)."""
    h = cfg.hidden_size
    rows = table["rows"][ids].astype(jnp.float32)                     # [B, S, cols, d]
    scale = table["scale"][ids].astype(jnp.float32)
    rows = (rows.reshape(*rows.shape[:-1], scale.shape[-1], -1) * scale[..., None]).reshape(rows.shape)
    kv = rows.reshape(*rows.shape[:-2], -1).astype(p["wkv"].dtype) @ p["wkv"]
    key = kv[..., :cfg.hc_mult * h].astype(jnp.float32).reshape(*kv.shape[:-1], cfg.hc_mult, h)
    value = kv[..., cfg.hc_mult * h:].astype(jnp.float32)
    weight = p["q_weight"].astype(jnp.float32) * p["k_weight"].astype(jnp.float32)
    x = streams.astype(jnp.float32)
    eps = cfg.rms_norm_eps
    rstd = jax.lax.rsqrt((x * x).mean(-1) + eps) * jax.lax.rsqrt((key * key).mean(-1) + eps)
    dot = (x * weight * key).sum(-1) * rstd * h ** -0.5
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
    return (x + gate[..., None] * value[..., None, :]).astype(streams.dtype)


def read_token_map(cfg, directory: Path):
    """``cfg`` with its Engram token map read from ``directory``/tokenizer.json (unchanged when
    the model has no Engram layer or already holds one)."""
    import dataclasses

    from dspark_jax.target.deepseek_v41.config import TokenMap
    if not cfg.engram_layer_ids or cfg.engram_token_map is not None:
        return cfg
    ids = token_map(Path(directory) / "tokenizer.json", cfg.vocab_size, cfg.engram_compressed_vocab_size,
                    cfg.engram_pad_token_id)
    return dataclasses.replace(cfg, engram_token_map=TokenMap(ids))



