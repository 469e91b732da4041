"""The drafter kind's record the decode round calls (``runtime.Proposer``).

A chain family (DeepSeek-V4's MTP module, Eagle3) declares its ``runtime.Proposer`` as its
family's runtime record; every ``runtime.DraftRuntime`` family (DSpark / DFlash backbones)
drafts blocks through ``draft.decode.PROPOSER``. This module sits above both the registry
(``families``) and the block kind (``draft.decode``, which reads the registry), so neither
imports the other back.
"""

from __future__ import annotations

from dspark_jax import families, runtime
from dspark_jax.draft import decode as block


def proposer(draft_config) -> runtime.Proposer:
    """The drafter kind's record: the family's own when its runtime is one (a chain kind), else
    the block kind's (``draft.decode.PROPOSER``)."""
    rt = families.draft_ops(draft_config)
    return rt if isinstance(rt, runtime.Proposer) else block.PROPOSER
