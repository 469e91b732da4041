"""Decode-program costs from declared parameter shapes, where no compiled program's count is
usable: a round table's roofline for a mixture-of-experts target on an expert-parallel mesh.

Why: XLA:CPU's cost analysis of a compiled V4-Flash AR step (8 simulated devices, expert=8)
charges 3.8 TB per device per step, 45x the weights the device holds (each per-expert slice of
the stacked expert weights is charged as the whole stack, plus bf16->f32 copies), and no
compiler plugin for the GPU is installed here. This model counts what a decode step must move
and compute per device, from ``families.declare`` alone (nothing allocated, nothing compiled):

- weights without an ``expert`` axis are read once per program (bf16, or the leaf's fixed
  dtype) and every matmul leaf (>= 2 dims) costs 2 x params x tokens FLOPs; a table indexed by
  token (first axis ``vocab``: the embedding, a Markov head's W1) reads only the tokens' rows;
- routed experts (leaves with an ``expert`` axis, E per layer, top-k) are sharded over the
  ``expert`` mesh axis (X devices): a device reads each of its E / X experts that at least one
  of the program's T tokens routes to, expected 1 - (1 - k / E)^T of them (uniform routing),
  and computes its share 2 x (expert params / E) x k x T / X;
- the KV cache (``decode.memory.decode_bytes``: the target's cache and the drafter's context
  state for B rows) is read once per program;
- not charged: attention FLOPs, activations, collectives (the expert all-to-all), kernel
  launch and host time. Each is small against the weights at decode batch sizes, or is not a
  property of the shapes; the label says the table is analytic.
"""

from __future__ import annotations

import math

import numpy as np

from dspark_jax import families

BF16 = 2


def _leaf_bytes(spec, n: float) -> float:
    return n * (np.dtype(spec.dtype).itemsize if spec.dtype else BF16)


def weights_cost(specs: dict, tokens: int, *, experts: int, top_k: int,
                 expert_shards: int) -> tuple[float, float]:
    """(flops, bytes) per device of one pass of ``tokens`` tokens through the weights ``specs``
    (``{path: ParamSpec}``) on a mesh whose ``expert`` axis has ``expert_shards`` devices."""
    flops = nbytes = 0.0
    touched = 1.0 - (1.0 - top_k / experts) ** tokens if experts else 0.0
    for path, spec in specs.items():
        n = float(math.prod(spec.shape))
        axes = spec.axes or ()
        if "expert" in axes:
            nbytes += _leaf_bytes(spec, n) / expert_shards * touched
            flops += 2.0 * n / experts * top_k * tokens / expert_shards
        elif axes[:1] == ("vocab",):
            nbytes += _leaf_bytes(spec, min(tokens, spec.shape[0]) * n / spec.shape[0])
        else:
            nbytes += _leaf_bytes(spec, n)
            if len(spec.shape) >= 2:
                flops += 2.0 * n * tokens
    return flops, nbytes


def resident_bytes(specs: dict, expert_shards: int, *, skip_frozen: bool = False) -> float:
    """Bytes of ``specs`` one device holds (routed experts split over ``expert_shards``, the rest
    replicated); ``skip_frozen``: leave out a drafter's frozen leaves (the target's own embedding
    and head, held once)."""
    return sum(_leaf_bytes(s, math.prod(s.shape)) / (expert_shards if "expert" in (s.axes or ()) else 1)
               for s in specs.values() if not (skip_frozen and s.frozen))


def _moe(cfg) -> tuple[int, int]:
    """(routed experts per layer, experts per token) of ``cfg`` (0, 0 without experts)."""
    return int(getattr(cfg, "n_routed_experts", 0) or 0), int(getattr(cfg, "num_experts_per_tok", 0) or 0)


def program_cost(target_cfg, draft_cfg, *, batch: int, width: int, max_len: int,
                 expert_shards: int) -> dict:
    """Per-device flops and bytes of one decode program at ``batch`` rows: the AR step
    (``draft_cfg`` None, ``width`` 1) or a speculative round verifying ``width`` tokens per row,
    its drafter making one pass over ``batch`` x max(G, width) tokens (a block drafter's G
    positions; a one-step chain drafter's pass over the verified positions)."""
    import jax.numpy as jnp

    from dspark_jax import params as params_lib
    from dspark_jax.decode.memory import decode_bytes

    e, k = _moe(target_cfg)
    t_specs = families.declare(target_cfg)
    flops, nbytes = weights_cost(t_specs, batch * width, experts=e, top_k=k, expert_shards=expert_shards)
    d_abs = None
    if draft_cfg is not None:
        d_specs = families.declare(draft_cfg)
        de, dk = _moe(getattr(draft_cfg, "target", draft_cfg))
        f, b = weights_cost(d_specs, batch * max(draft_cfg.block_size, width), experts=de,
                            top_k=dk, expert_shards=expert_shards)
        flops, nbytes = flops + f, nbytes + b
        d_abs = params_lib.abstract_params(d_specs, jnp.bfloat16)
    t_abs = params_lib.abstract_params(t_specs, jnp.bfloat16)
    parts = decode_bytes(target_cfg, t_abs, draft_cfg, d_abs, batch, max_len)
    cache = parts["target KV cache"] + parts.get("drafter context", 0)
    resident = cache + resident_bytes(t_specs, expert_shards) + (
        resident_bytes(d_specs, expert_shards, skip_frozen=True) if draft_cfg is not None else 0)
    return {"step_flops": flops, "step_bytes": nbytes + cache, "cache_bytes": cache,
            "resident_bytes_per_device": resident}
