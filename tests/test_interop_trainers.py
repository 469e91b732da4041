"""speculators' and SpecForge's own DSpark classes against our import and export (interop env).

* their checkpoints, built and saved with their own classes, import with `convert --from`;
* our `export --engine speculators|specforge` loads with their own ``from_pretrained`` for every
  head type (Markov vanilla/gated/rnn, none, no confidence head, layer id -1), every tensor lands,
  and their Markov and confidence heads give our block heads' outputs on the same inputs;
* whether each loads is what our rule table says; ours -> theirs -> ours is byte-exact.

Their backbones (flex-attention training forwards that return a loss) are not run here: the
backbone tensors are compared exactly instead. Outside the interop environment the module is
skipped with a reason; under DSPARK_INTEROP=1 (.ci/interop) a missing package fails it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

if os.environ.get("DSPARK_INTEROP") != "1":
    pytest.importorskip("speculators", reason="interop test: run by .ci/interop (DSPARK_INTEROP=1)")
    pytest.importorskip("specforge", reason="interop test: run by .ci/interop (DSPARK_INTEROP=1)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import specforge  # noqa: E402
import speculators  # noqa: E402
import torch  # noqa: E402
from importlib.metadata import version  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from specforge.modeling.draft.dspark import DSparkDraftModel as SpecForgeDSpark  # noqa: E402
from speculators.model import SpeculatorModel  # noqa: E402
from speculators.models.dspark import DSparkDraftModel as SpeculatorsDSpark  # noqa: E402
from transformers import AutoConfig, Qwen3Config  # noqa: E402

from dspark_jax.cli import main as cli_main  # noqa: E402
from dspark_jax.config import DraftConfig  # noqa: E402
from dspark_jax.convert import checkpoint, engines, mapping  # noqa: E402
from dspark_jax.draft import model as draft_model  # noqa: E402

TINY = Path(__file__).parent / "fixtures" / "dspark_qwen3_tiny"
TARGET = TINY / "target"
FORMATS = ("speculators", "specforge")
HEADS = ("vanilla", "gated", "rnn", "dflash", "no_confidence", "tap_minus_1")


@pytest.mark.parametrize("fmt", FORMATS)
def test_pinned_version(fmt):
    assert engines.CHECKED[fmt] == f"{fmt} {version(fmt)}"


def base_config() -> DraftConfig:
    return DraftConfig.from_hf(json.loads((TINY / "draft" / "config.json").read_text()))


def head_config(base: DraftConfig, head: str) -> DraftConfig:
    return {"gated": lambda: base.replace(markov_head_type="gated"),
            "rnn": lambda: base.replace(markov_head_type="rnn"),
            "dflash": lambda: base.replace(markov_rank=0, confidence_head_with_markov=False),
            "no_confidence": lambda: base.replace(enable_confidence_head=False),
            "tap_minus_1": lambda: base.replace(target_layer_ids=(-1, 2, 4)),
            "vanilla": lambda: base}[head]()


def head_inputs(cfg: DraftConfig, seed: int = 0):
    """Backbone outputs [4, G, H] and previous tokens [4, G] (anchor, then ground truth)."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((4, cfg.block_size, cfg.hidden_size)).astype(np.float32)
    prev = rng.integers(0, cfg.vocab_size, (4, cfg.block_size))
    return hidden, prev


def our_heads(cfg: DraftConfig, params, hidden, prev):
    p = draft_model.cast_params(jax.tree.map(jnp.asarray, params), jnp.float32)
    logits, conf, _ = draft_model.block_heads(p, cfg, jnp.asarray(hidden), jnp.asarray(prev))
    return np.asarray(logits), None if conf is None else np.asarray(conf)


@torch.no_grad()
def their_heads(fmt: str, m, lm_head: np.ndarray, hidden, prev):
    """Their own head modules on the same inputs: (logits after the Markov bias, confidence)."""
    h, ids = torch.from_numpy(hidden), torch.from_numpy(prev)
    base = h @ torch.from_numpy(lm_head).T
    if fmt == "speculators":
        logits = base + (m.markov_head.block_bias(prev_token_ids=ids, hidden_states=h)
                         if m.markov_head is not None else 0)
        conf = None
        if m.confidence_head is not None:
            feats = h
            if m.config.confidence_head_with_markov:
                feats = torch.cat([h, m.markov_head.prev_embeddings(ids).to(h.dtype)], -1)
            conf = m.confidence_head(feats)
    else:
        logits = m.apply_logits_head(base, prev_token_ids=ids, hidden_states=h)
        conf = m.predict_confidence(h, prev_token_ids=ids)
    return logits.numpy(), None if conf is None else conf.numpy()


def assert_heads_equal(fmt, cfg, params, m, lm_head):
    hidden, prev = head_inputs(cfg)
    ours, ours_conf = our_heads(cfg, params, hidden, prev)
    theirs, theirs_conf = their_heads(fmt, m, lm_head, hidden, prev)
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (ours_conf is None) == (theirs_conf is None)
    if ours_conf is not None:
        np.testing.assert_allclose(theirs_conf, ours_conf, rtol=1e-5, atol=1e-5)


def their_load(fmt: str, d: Path):
    """Their own from_pretrained; returns the model and the tensor names it did not fill / use."""
    cls = SpeculatorModel if fmt == "speculators" else SpecForgeDSpark
    m, info = cls.from_pretrained(str(d), output_loading_info=True)
    return m, set(info["missing_keys"]), set(info["unexpected_keys"])


def assert_tensors_land(m, tensors: dict, skip=()):
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    for k, v in tensors.items():
        if k in skip:
            continue
        assert k in sd, f"{k} has no place in their model"
        np.testing.assert_array_equal(sd[k], v, err_msg=k)


# --------------------------------------------------------------------------- theirs -> ours

def build_theirs(fmt: str, d: Path, cfg: DraftConfig):
    """A drafter built and saved with the trainer's own classes (random init, seeded)."""
    torch.manual_seed(0)
    if fmt == "speculators":
        vc = AutoConfig.from_pretrained(str(TARGET))
        vc.num_hidden_layers, vc.layer_types = cfg.num_hidden_layers, ["full_attention"] * cfg.num_hidden_layers
        m = SpeculatorsDSpark.from_training_args(
            vc, verifier_name_or_path=str(TARGET), target_layer_ids=[i + 1 for i in cfg.target_layer_ids],
            draft_vocab_size=cfg.vocab_size, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
            markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type)
    else:
        hf = AutoConfig.from_pretrained(str(TARGET)).to_dict()
        hf.update(num_hidden_layers=cfg.num_hidden_layers, layer_types=["full_attention"] * cfg.num_hidden_layers,
                  num_target_layers=cfg.num_target_layers, block_size=cfg.block_size,
                  architectures=["DSparkDraftModel"],
                  dflash_config={"target_layer_ids": list(cfg.target_layer_ids), "projector_type": "dspark",
                                 "mask_token_id": cfg.mask_token_id, "markov_rank": cfg.markov_rank,
                                 "markov_head_type": cfg.markov_head_type, "enable_confidence_head": True,
                                 "confidence_head_with_markov": cfg.confidence_head_with_markov})
        m = SpecForgeDSpark(Qwen3Config(**hf))
    with torch.no_grad():  # their inits leave norms at 1 / biases at 0: make every tensor count
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    m.save_pretrained(str(d))
    return m


@pytest.mark.parametrize("fmt", FORMATS)
def test_their_checkpoint_imports(tmp_path, fmt):
    cfg = base_config()
    theirs = build_theirs(fmt, tmp_path / "theirs", cfg)
    dst = tmp_path / "ours"
    assert cli_main(["convert", str(tmp_path / "theirs"), str(dst), "--from", fmt,
                     "--target", str(TARGET)]) == 0
    got_cfg, params = checkpoint.load_draft(dst)
    assert got_cfg.target_layer_ids == cfg.target_layer_ids and got_cfg.markov_rank == cfg.markov_rank
    assert got_cfg.enable_confidence_head and got_cfg.confidence_head_with_markov
    ours = mapping.draft_to_torch(got_cfg, jax.tree.map(np.asarray, params))
    target = load_file(str(TARGET / "model.safetensors"))
    # SpecForge has no embed_tokens / lm_head (the target's, from --target); speculators keeps
    # the verifier's in memory and does not save them either.
    np.testing.assert_array_equal(ours["embed_tokens.weight"], target["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ours["lm_head.weight"], target["lm_head.weight"])
    assert_tensors_land(theirs, ours, skip=("embed_tokens.weight", "lm_head.weight"))
    assert_heads_equal(fmt, got_cfg, params, theirs, ours["lm_head.weight"])


# --------------------------------------------------------------------------- ours -> theirs

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head", HEADS)
def test_our_export_loads_in_theirs(tmp_path, fmt, head):
    """export --engine FMT loads with their own from_pretrained (nothing missing or unexpected,
    every tensor in place, same head outputs) exactly when our rules say it does."""
    cfg = head_config(base_config(), head)
    params = jax.tree.map(np.asarray, draft_model.init_params(cfg, jax.random.key(3)))
    src = checkpoint.save_draft(tmp_path / "src", cfg, params, format="jax")
    assert engines.check(cfg, fmt) is None  # every Qwen3 head type: the rules accept
    dst = tmp_path / fmt
    assert cli_main(["export", str(src), str(dst), "--engine", fmt]) == 0
    m, missing, unexpected = their_load(fmt, dst)
    tensors = mapping.draft_to_torch(cfg, params)
    # SpecForge has no embed_tokens / lm_head; speculators rebuilds verifier_* from the verifier.
    assert not unexpected, f"{fmt} did not use {sorted(unexpected)}"
    assert missing <= {"verifier_lm_head.weight", "verifier_norm.weight"}, sorted(missing)
    skip = ("embed_tokens.weight", "lm_head.weight") if fmt == "specforge" else ()
    assert_tensors_land(m, tensors, skip=skip)
    assert_heads_equal(fmt, cfg, params, m, tensors["lm_head.weight"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_byte_exact(tmp_path, fmt):
    """ours -> export --engine FMT -> convert --from FMT -> ours: the same bytes."""
    src = TINY / "draft"
    assert cli_main(["export", str(src), str(tmp_path / fmt), "--engine", fmt]) == 0
    back = tmp_path / "back"
    assert cli_main(["convert", str(tmp_path / fmt), str(back), "--from", fmt, "--to", "torch",
                     "--target", str(TARGET)]) == 0
    a, b = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    ca, _ = checkpoint.load_draft(src)
    cb, _ = checkpoint.load_draft(back)
    assert ca.replace(num_anchors=cb.num_anchors) == cb
