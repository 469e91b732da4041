"""Eagle3 drafters in DeepSpec's format, one family per target family.

``config`` (``Qwen3Eagle3Config`` / ``Gemma4Eagle3Config``: config.json both ways), ``model``
(declaration, the one decoder layer), ``ttt`` (test-time training forward and loss), ``chain``
(the module as the chain round drives it). Each family's runtime record is the chain kind's
``runtime.Proposer`` carrying the trainer's objective (``runtime.TrainObjective``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.draft import chain as chain_kind
from dspark_jax.draft.eagle3 import chain as eagle3_chain
from dspark_jax.draft.eagle3 import model, ttt
from dspark_jax.draft.eagle3.config import KIND, Gemma4Eagle3Config, Qwen3Eagle3Config


def _sums(params, cfg, input_ids, features, last_hidden, loss_mask, *, remat=False):
    return ttt.loss_sums(params, cfg, input_ids, features, last_hidden, loss_mask, remat=remat)


def _denominator(cfg, input_ids, loss_mask):
    """DeepSpec divides each step's summed loss by the batch's B * S positions (padding included)."""
    return jnp.asarray(input_ids.size, jnp.float32)


OBJECTIVE = runtime.TrainObjective(denominator=_denominator, sums=_sums, finalize=ttt.finalize)


# decoding: the chain kind's record of the module (draft 1 from the last committed output, then
# k - 1 module steps; ``--draft-steps`` sets k, default ttt_length); training: the TTT objective
RUNTIME = dataclasses.replace(
    chain_kind.proposer(eagle3_chain.MODULE, hidden_width=lambda cfg: cfg.hidden_size), objective=OBJECTIVE)

QWEN3_FAMILY = params_lib.Family(
    name="qwen3_eagle3", kind="draft", architectures=(Qwen3Eagle3Config.ARCHITECTURE,), model_types=(),
    config_cls=Qwen3Eagle3Config, declare=model.declare, forward=model.__name__, pairs_with="qwen3",
    runtime=RUNTIME, draft_kind=KIND)

GEMMA4_FAMILY = params_lib.Family(
    name="gemma4_eagle3", kind="draft", architectures=(Gemma4Eagle3Config.ARCHITECTURE,), model_types=(),
    config_cls=Gemma4Eagle3Config, declare=model.declare, forward=model.__name__, pairs_with="gemma4",
    runtime=RUNTIME, draft_kind=KIND)
