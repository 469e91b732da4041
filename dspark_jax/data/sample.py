"""Sample training sequences from a target LM (KV-cached, jitted), e.g. for learning checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax import families, runtime


@functools.partial(jax.jit, static_argnames=("config", "length", "temperature"))
def _sample(params, config: TargetConfig, first: jax.Array, rng: jax.Array, length: int, temperature: float):
    b = first.shape[0]
    rt = families.target_runtime(config)  # any target family
    cache = rt.init_cache(config, b, length, jnp.float32, None)  # None: no extend bound

    def body(carry, key):
        cache, tok = carry
        hidden, _, delta = rt.forward(params, config, tok[:, None], cache, ctx=runtime.LOCAL,
                                      taps=(), span=None)
        cache = cache.commit(delta, jnp.ones((b,), jnp.int32))
        logits = rt.logits(params, config, hidden[:, -1])
        if temperature == 0:  # greedy
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            nxt = jax.random.categorical(key, logits / temperature).astype(jnp.int32)
        return (cache, nxt), nxt

    _, toks = jax.lax.scan(body, (cache, first), jax.random.split(rng, length - 1))
    return jnp.concatenate([first[:, None], toks.T], axis=1)


def sample_sequences(params: dict, config: TargetConfig, num: int, length: int, seed: int = 0,
                     temperature: float = 1.0, batch: int = 64) -> np.ndarray:
    """[num, length] int32 token sequences: a random first token, then target samples
    (``temperature`` 0: greedy)."""
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


def _check_args(args, cfg: TargetConfig | None = None) -> None:
    """InputError naming the flag for values ``sample_sequences`` cannot honour."""
    from dspark_jax.errors import InputError
    if args.num < 1:
        raise InputError(f"--num must be >= 1, got {args.num}")
    if args.length < 2:
        raise InputError(f"--length must be >= 2 (a first token and one sample), got {args.length}")
    if not args.temperature >= 0:
        raise InputError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if cfg is not None and args.length > cfg.max_position_embeddings:
        raise InputError(f"--length {args.length} exceeds the target's context "
                         f"(max_position_embeddings={cfg.max_position_embeddings})")


def main(argv=None) -> int:
    """``python -m dspark_jax.data.sample --target DIR --out FILE.jsonl [--num N --length S]``.

    Bad input is one line on stderr and exit code 2, like ``dspark-jax``.
    """
    import argparse
    import sys

    from dspark_jax.convert.checkpoint import load_target
    from dspark_jax.errors import DSparkError
    from dspark_jax.fileio import check_output
    ap = argparse.ArgumentParser(prog="python -m dspark_jax.data.sample",
                                 description="Sample token sequences from a target LM into a JSONL "
                                             "training file ({'input_ids', 'loss_mask'} per line).")
    ap.add_argument("--target", required=True, help="target checkpoint directory")
    ap.add_argument("--out", required=True, help="output JSONL file (refused if it exists)")
    ap.add_argument("--force", action="store_true", help="overwrite --out")
    ap.add_argument("--num", type=int, default=256, help="sequences (default 256)")
    ap.add_argument("--length", type=int, default=64, help="tokens per sequence (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy")
    args = ap.parse_args(argv)
    try:
        _check_args(args)
        check_output(args.out, force=args.force, inputs={"--target": args.target})
        cfg, params = load_target(args.target)
        _check_args(args, cfg)
        seqs = sample_sequences(params, cfg, args.num, args.length, args.seed, args.temperature)
        write_jsonl(args.out, seqs)
    except DSparkError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
