"""One declaration per parameter: shape, logical axes, initializer, PyTorch name and layout.

A model family declares its parameters once, as ``declare(config) -> {path: ParamSpec}``
(``path`` is the key tuple of the leaf in our params tree). Initialisation, sharding axes,
abstract params for the planner, conversion to and from PyTorch state dicts and streaming
are all derived from that table.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One leaf of a params tree.

    shape:     our layout (kernels ``[in, out]``; stacked per-layer leaves have a leading
               layer axis of length ``len(layer_ids)``).
    axes:      logical axis names, one per dim (``None`` = replicated), mapped to mesh
               axes by ``sharding`` rules.
    torch:     the PyTorch state-dict name; ``{i}`` marks a stacked leaf holding one torch
               tensor per entry of ``layer_ids``.
    transpose: torch stores the transpose (``nn.Linear.weight`` is ``[out, in]``).
    init:      ``"normal"`` (std ``init_std``), ``"zeros"`` or ``"ones"``.
    layer_ids: the torch layer indices the leading axis stacks, in order (``None``: not stacked).
    frozen:    never trained (embedding and LM head shared with the target).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    torch: str
    transpose: bool = False
    init: str = "normal"
    init_std: float = 0.02
    layer_ids: tuple[int, ...] | None = None
    frozen: bool = False

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"{self.torch}: shape {self.shape} and axes {self.axes} differ in rank")
        if self.init not in ("normal", "zeros", "ones"):
            raise ValueError(f"{self.torch}: unknown init {self.init!r}")
        if (self.layer_ids is None) != ("{i}" not in self.torch):
            raise ValueError(f"{self.torch}: '{{i}}' in the torch name iff layer_ids is given")
        if self.layer_ids is not None and self.shape[0] != len(self.layer_ids):
            raise ValueError(f"{self.torch}: leading dim {self.shape[0]} != {len(self.layer_ids)} layers")
