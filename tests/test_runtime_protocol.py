"""A family defined only here plugs into the decode engine through ``dspark_jax.runtime`` alone.

The toy target's cache is a running sum over the accepted tokens (``SumCache.total``): state that
folds tokens in, so a cache that took every verified token and was then rolled back by its
``lengths`` would hold a wrong sum, and the next tokens (a function of that sum) would differ.
Speculative decoding (static with a narrow verification width, continuous with a threshold
policy; both with rejections) must give exactly the toy's autoregressive output, which must equal a plain Python
loop over the same rule. The drafter is the Qwen3 drafter registered for the toy target, its
final norm zeroed so that it always drafts token 0, which the target accepts for a few tokens
and then rejects.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import pytest

from dspark_jax import families, params as params_lib, runtime
from dspark_jax.config import DraftConfig
from dspark_jax.decode import FixedPolicy, ThresholdPolicy, autoregressive_generate, engine, speculative_generate
from dspark_jax.draft import model as draft_model

V, H, PERIOD = 12, 16, 4


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = V
    hidden_size: int = H
    num_hidden_layers: int = 2
    max_position_embeddings: int = 256


@dataclasses.dataclass(frozen=True)
class ToyDraftConfig(DraftConfig):
    """The Qwen3 drafter, as the drafter family of toy targets."""


@flax.struct.dataclass
class SumCache:
    """total [B]: sum of (token + 1) over the committed tokens; lengths [B]."""

    total: jax.Array
    lengths: jax.Array
    capacity: int = flax.struct.field(pytree_node=False, default=0)

    def axes(self):
        return SumCache((runtime.BATCH,), (runtime.BATCH,), self.capacity)

    def delta_axes(self):
        return (runtime.BATCH, runtime.STEP)

    def commit(self, delta, n_new):
        keep = runtime.step_mask(n_new, delta.shape[1])
        return SumCache(self.total + jnp.sum(jnp.where(keep, delta, 0), axis=1),
                        self.lengths + n_new.astype(jnp.int32), self.capacity)


def next_token(running_sum):
    """The toy's greedy rule: 0 until the running sum hits a multiple of PERIOD, then 1..V-1."""
    return jnp.where(running_sum % PERIOD != 0, 0, (running_sum // PERIOD) % (V - 1) + 1)


def init_cache(cfg, batch, capacity, dtype, max_extend):
    zeros = jnp.zeros((batch,), jnp.int32)
    return SumCache(zeros, zeros, capacity)


def forward(params, cfg, tokens, cache, *, ctx, taps, span):
    contrib = tokens.astype(jnp.int32) + 1                                       # [B, T]
    base = jnp.zeros(tokens.shape[:1], jnp.int32) if cache is None else cache.total
    running = base[:, None] + jnp.cumsum(contrib, axis=1)
    dtype = ctx.dtype or params["embed_tokens"].dtype
    hidden = jax.nn.one_hot(next_token(running), cfg.hidden_size, dtype=dtype)  # [B, T, H]
    features = jnp.concatenate([hidden] * len(taps), axis=-1) if taps else None
    return hidden, features, (None if cache is None else contrib)


def logits(params, cfg, hidden):
    return 10.0 * hidden[..., :cfg.vocab_size].astype(jnp.float32)


def declare(cfg):
    return {("embed_tokens",): params_lib.ParamSpec((cfg.vocab_size, cfg.hidden_size),
                                                    ("vocab", "embed"), "embed.weight")}


TOY = params_lib.Family(
    name="toy_sum", kind="target", architectures=("ToySumForCausalLM",), model_types=("toy_sum",),
    config_cls=ToyConfig, declare=declare, forward=__name__,
    runtime=runtime.TargetRuntime(init_cache=init_cache, forward=forward, logits=logits,
                                  feature_dim=lambda cfg, taps: runtime.concat_features(cfg.hidden_size, taps)))
TOY_DRAFT = dataclasses.replace(draft_model.FAMILY, name="toy_sum_dspark", architectures=("ToySumDSpark",),
                                model_types=(), config_cls=ToyDraftConfig, pairs_with="toy_sum")


@pytest.fixture(scope="module")
def toy():
    for fam in (TOY, TOY_DRAFT):
        families.register(fam)
    tcfg = ToyConfig()
    tparams = {"embed_tokens": jnp.zeros((V, H), jnp.float32)}
    dcfg = ToyDraftConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_target_layers=2,
                          target_layer_ids=(0,), block_size=4, markov_rank=0,
                          confidence_head_with_markov=False, max_position_embeddings=256)
    dparams = draft_model.init_params(dcfg, jax.random.PRNGKey(0))
    dparams["norm"] = jnp.zeros_like(dparams["norm"])  # hidden 0 -> logits 0 -> always drafts token 0
    yield tcfg, tparams, dcfg, dparams
    for fam in (TOY, TOY_DRAFT):
        families.FAMILIES.pop(fam.name)


def python_reference(prompt, n):
    """The toy's greedy continuation of ``prompt`` by a plain loop (no jax, no decode/)."""
    total = sum(t + 1 for t in prompt)
    out = []
    for _ in range(n):
        t = 0 if total % PERIOD else (total // PERIOD) % (V - 1) + 1
        out.append(t)
        total += t + 1
    return out


PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6], [5], [3, 5, 8, 9, 7, 9, 3]]
N = 20


def test_toy_family_decodes_exactly_through_the_engine(toy):
    tcfg, tparams, dcfg, dparams = toy
    want = [python_reference(p, N) for p in PROMPTS]
    ar = autoregressive_generate(tcfg, tparams, PROMPTS, max_new_tokens=N, batch_size=2)
    assert [r.output_ids for r in ar] == want
    runs = {
        "static/fixed:2": speculative_generate(tcfg, tparams, dcfg, dparams, PROMPTS, max_new_tokens=N,
                                               batch_size=2, policy=FixedPolicy(2)),
        "continuous/threshold": engine.serve(tcfg, tparams, dcfg, dparams, PROMPTS, max_new_tokens=N,
                                             slots=3, policy=ThresholdPolicy(0.5), order=[2, 0, 3, 1]),
        "continuous/ar": engine.serve(tcfg, tparams, None, None, PROMPTS, max_new_tokens=N, slots=3),
    }
    for name, res in runs.items():
        assert [r.output_ids for r in res] == want, name
    for name, width in (("static/fixed:2", 2), ("continuous/threshold", dcfg.block_size)):
        rounds = [(p, d) for r in runs[name] for p, d in zip(r.proposal_lengths, r.accepted_drafts)]
        assert {p for p, _ in rounds} == {width}, name  # fixed:2 verifies a narrow width, padded
        assert any(d < p for p, d in rounds), f"{name}: no round rejected a draft"
        assert any(d >= 2 for p, d in rounds), f"{name}: no round accepted several drafts"
