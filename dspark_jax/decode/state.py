"""The decode state: per-row progress in static-shape arrays (a pytree, donated each step).

Shapes: B rows, L cache capacity, R round budget (max_new_tokens), G block size.
``DecodeState`` (speculative) and ``ARState`` (autoregressive) hold the tokens, positions and
per-round records; ``cache`` is the target family's ``runtime.Cache`` (committed positions
< ``pos[b]``), ``ctx`` the drafter's context cache. ``DecodeStatic`` is the hashable static
configuration every program takes. ``insert`` writes a one-row state into a batch row (the
continuous engine's refill), leaf by leaf along the declared batch axes (``sharded.state_axes``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import numpy as np

from dspark_jax import runtime
from dspark_jax import sharding as sharding_lib
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.decode import sharded


@flax.struct.dataclass
class DecodeState:
    """Speculative decode state (a pytree; donated to each jitted round).

    seq [B, L] int32 prompt + generated tokens; pos [B] anchor position;
    num_input [B] prompt lengths; max_new [B] per-row output budget (<= R); active [B] bool; key PRNG key; round [] int32;
    rounds [B] rounds run per row; acc_rec / prop_rec / drafts_rec [B, R] int32
    acceptance length (bonus included), proposal length and accepted drafts per
    round; conf_rec [B, R, G] raw confidence logits; cache target KV cache;
    ctx the draft context cache; policy_state pytree.
    """

    seq: jax.Array
    pos: jax.Array
    num_input: jax.Array
    max_new: jax.Array
    active: jax.Array
    key: jax.Array
    round: jax.Array
    rounds: jax.Array
    acc_rec: jax.Array
    prop_rec: jax.Array
    drafts_rec: jax.Array
    conf_rec: jax.Array
    cache: Any  # the target family's ``runtime.Cache``
    ctx: Any  # the drafter kind's state (``runtime.Proposer``), self-declaring (``axes()``)
    policy_state: Any

    def host_view(self) -> dict:
        """What a finished row's ``Result`` reads (``requests.speculative_result``), on the host."""
        return sharding_lib.to_host({"seq": self.seq, "rounds": self.rounds, "acc": self.acc_rec,
                                 "prop": self.prop_rec, "drafts": self.drafts_rec,
                                 "conf": self.conf_rec})



@flax.struct.dataclass
class ARState:
    """Autoregressive state: seq [B, L]; pos [B] position of the newest token (not yet cached)."""

    seq: jax.Array
    pos: jax.Array
    num_input: jax.Array
    max_new: jax.Array
    active: jax.Array
    key: jax.Array
    cache: Any

    def host_view(self) -> dict:
        """What a finished row's ``Result`` reads (``requests.autoregressive_result``)."""
        return sharding_lib.to_host({"seq": self.seq, "pos": self.pos})


@dataclasses.dataclass(frozen=True)
class DecodeStatic:
    """Hashable static configuration of the compiled functions (a jit static argument)."""

    target: TargetConfig
    draft: DraftConfig | None
    policy: Any
    greedy: bool
    max_new_tokens: int
    top_p: float = 1.0       # nucleus sampling of the target (AR only); 1 = off (unchanged program)
    widths: tuple[int, ...] | None = None  # compiled verification widths (``round_widths``)
    spans: tuple[int, ...] | None = None   # compiled cache spans (``compiled_spans``)


def _is_axes(x) -> bool:
    """One leaf's logical axes (a tuple of names / None), not a tuple of them (a per-layer cache's)."""
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def insert(big, one, slot):
    """Write the one-row state ``one`` into row ``slot`` of ``big``: every leaf with a batch axis
    (``sharded.state_axes``: the state's and the caches' declarations) along it; key / round /
    policy state kept, except per-row keys (``big.key`` [B, 2]), whose row is written too."""
    axes = sharded.state_axes(big)
    fields = {}
    for f in dataclasses.fields(big):
        b, o, a = getattr(big, f.name), getattr(one, f.name), getattr(axes, f.name)
        if f.name == "key" and b.ndim == 2:
            fields[f.name] = runtime.put_row(b, o[None], sharded.ROW + (None,), slot)
        elif any(runtime.BATCH in x for x in jax.tree.leaves(a, is_leaf=_is_axes)):
            fields[f.name] = runtime.put_row(b, o, a, slot)
        else:
            fields[f.name] = b
    return big.replace(**fields)


def empty_state(abstract, sharding=None):
    """Zeros of an abstract state (host arrays, device_put: nothing compiles)."""
    leaves, tree = jax.tree.flatten(abstract)
    state = jax.tree.unflatten(tree, [np.zeros(a.shape, a.dtype) for a in leaves])
    return jax.device_put(state) if sharding is None else jax.device_put(state, sharding)
