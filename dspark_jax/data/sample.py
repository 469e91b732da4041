"""Sample training sequences from a target LM (KV-cached, jitted), e.g. for learning checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax import families


@functools.partial(jax.jit, static_argnames=("config", "length", "temperature"))
def _sample(params, config: TargetConfig, first: jax.Array, rng: jax.Array, length: int, temperature: float):
    b = first.shape[0]
    module = families.for_config(config).module()  # any target family
    cache = module.init_cache(config, b, length)

    def body(carry, key):
        cache, tok = carry
        hidden, _, cache = module.forward(params, config, tok[:, None], cache)
        logits = families.compute_logits(config, params, hidden[:, -1])
        nxt = jax.random.categorical(key, logits / temperature).astype(jnp.int32)
        return (cache, nxt), nxt

    _, toks = jax.lax.scan(body, (cache, first), jax.random.split(rng, length - 1))
    return jnp.concatenate([first[:, None], toks.T], axis=1)


def sample_sequences(params: dict, config: TargetConfig, num: int, length: int, seed: int = 0,
                     temperature: float = 1.0, batch: int = 64) -> np.ndarray:
    """[num, length] int32 token sequences: a random first token, then target samples."""
    rng = jax.random.PRNGKey(seed)
    out = []
    for start in range(0, num, batch):
        rng, k_first, k_seq = jax.random.split(rng, 3)
        b = min(batch, num - start)
        first = jax.random.randint(k_first, (batch,), 0, config.vocab_size, jnp.int32)
        out.append(np.asarray(_sample(params, config, first, k_seq, length, float(temperature)))[:b])
    return np.concatenate(out, axis=0)


def write_jsonl(path, sequences: np.ndarray, loss_from: int = 1) -> None:
    """Write ``{"input_ids", "loss_mask"}`` lines (loss_mask 0 on the first ``loss_from`` tokens)."""
    import json

    from dspark_jax.fileio import atomic_open
    with atomic_open(path) as f:
        for seq in sequences:
            mask = [0] * loss_from + [1] * (len(seq) - loss_from)
            f.write(json.dumps({"input_ids": [int(t) for t in seq], "loss_mask": mask}) + "\n")


def main(argv=None) -> int:
    """``python -m dspark_jax.data.sample --target DIR --out FILE.jsonl [--num N --length S]``."""
    import argparse
    from dspark_jax.convert.checkpoint import load_target
    ap = argparse.ArgumentParser(description="Sample token sequences from a target LM into a JSONL "
                                             "training file ({'input_ids', 'loss_mask'} per line).")
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=256)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)
    cfg, params = load_target(args.target)
    write_jsonl(args.out, sample_sequences(params, cfg, args.num, args.length, args.seed, args.temperature))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
