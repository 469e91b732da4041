"""Grain pipeline: deterministic shuffle by seed, per-epoch reshuffle, per-process rows.

The GLOBAL example order is ``source.shuffle(seed).repeat(epochs)``; optimizer
step t consumes global examples [t*B, (t+1)*B), split into A micro-batches of
Bm = B/A rows. A process reads only its own rows of each micro-batch
(``row_start``, ``row_count``: the rows its devices hold), so the global batch
is the same for any number of processes or devices, and the iterator state
(``get_state``/``set_state``, saved with grain's orbax handler) is one counter.
"""

from __future__ import annotations

import grain
import numpy as np

from dspark_jax.errors import InputError


def steps_per_epoch(num_examples: int, global_batch: int) -> int:
    return num_examples // global_batch


def make_dataset(source, *, global_batch: int, grad_accum: int, seed: int, epochs: int,
                 row_start: int = 0, row_count: int | None = None) -> grain.IterDataset:
    """IterDataset of this process's batches: dict of arrays [A * row_count, ...] per step."""
    n = len(source)
    if n == 0:
        raise InputError("the training dataset is empty")
    if n < global_batch:
        raise InputError(f"the training dataset has {n} sequences, fewer than one global batch "
                         f"(batch_size={global_batch})")
    micro = global_batch // grad_accum
    row_count = micro if row_count is None else row_count
    steps = steps_per_epoch(n, global_batch) * epochs
    shuffled = grain.MapDataset.source(source).shuffle(seed=seed)
    # an epoch is n examples; drop the tail that does not fill a global batch
    per_epoch = steps_per_epoch(n, global_batch) * global_batch
    local_per_step = grad_accum * row_count

    def global_index(i: int) -> int:
        step, rem = divmod(int(i), local_per_step)
        a, j = divmod(rem, row_count)
        g = step * global_batch + a * micro + row_start + j   # position in the epoch-concatenated stream
        epoch, pos = divmod(g, per_epoch)
        return epoch * n + pos   # index into shuffle(...).repeat(): reshuffled per epoch

    repeated = shuffled.repeat(epochs)
    ds = grain.MapDataset.range(steps * local_per_step).map(lambda i: repeated[global_index(i)])
    ds = ds.batch(local_per_step, drop_remainder=True, batch_fn=_stack)
    return ds.to_iter_dataset()


def _stack(records):
    return {k: np.stack([r[k] for r in records]) for k in records[0]}
