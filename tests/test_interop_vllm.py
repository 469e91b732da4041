"""vLLM's own DSpark loader over our exports (the interop environment, .ci/interop).

vLLM (pinned in .ci/interop-requirements.txt) builds its ``Qwen3DSparkForCausalLM`` on CPU after
``init_distributed_environment`` over gloo (world size 1); its own ``load_weights`` is driven over
``export --engine vllm`` output and every parameter it fills must equal the tensor it came from
(q/k/v and gate/up fused as vLLM fuses them). Then each head type (and layer id -1) goes through
the same loader, and whether it loads must be what our rule table (convert/engines.py) says.

Outside the interop environment the module is skipped with a reason; under DSPARK_INTEROP=1
(what .ci/interop sets) a missing vLLM is an import error, so CI fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

if os.environ.get("DSPARK_INTEROP") != "1":
    pytest.importorskip("vllm", reason="interop test: run by .ci/interop (DSPARK_INTEROP=1)")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from vllm.config import (DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig,  # noqa: E402
                         VllmConfig, set_current_vllm_config)

from dspark_jax.cli import main as cli_main  # noqa: E402
from dspark_jax.config import DraftConfig  # noqa: E402
from dspark_jax.convert import checkpoint, engines, export, mapping, safetensors_io  # noqa: E402
from dspark_jax.draft import model as draft_model  # noqa: E402

TINY = Path(__file__).parent / "fixtures" / "dspark_qwen3_tiny"
TARGET = TINY / "target"


def test_pinned_version():
    """The rules say which vLLM they were checked against: the one installed here."""
    assert engines.CHECKED["vllm"] == f"vllm {vllm.__version__}"


@pytest.fixture(scope="module")
def vllm_env():
    """vLLM's distributed state (gloo, world size 1) and the target's ModelConfig."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    target = ModelConfig(model=str(TARGET), dtype="float32", skip_tokenizer_init=True)
    with set_current_vllm_config(VllmConfig(model_config=target, device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
    return target


def spec_config(target, draft: Path, block_size: int) -> SpeculativeConfig:
    return SpeculativeConfig(model=str(draft), method="dspark", num_speculative_tokens=block_size,
                             target_model_config=target, target_parallel_config=ParallelConfig())


def vllm_load(target, draft: Path):
    """Build vLLM's Qwen3 DSpark drafter for ``draft`` and drive its own load_weights over the
    export's tensors; returns the model (raises what vLLM raises)."""
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    hf = json.loads((draft / "config.json").read_text())
    vc = VllmConfig(model_config=target, device_config=DeviceConfig(device="cpu"))
    # VllmConfig's validator refuses dspark with the V1 runner it picks without Triton (CPU);
    # the drafter's build and load_weights do not depend on the runner.
    vc.speculative_config = spec_config(target, draft, hf["block_size"])
    with set_current_vllm_config(vc), torch.device("cpu"):
        m = Qwen3DSparkForCausalLM(vllm_config=vc)
        tensors = load_file(str(draft / "model.safetensors"))
        m.load_weights((k, torch.from_numpy(v)) for k, v in tensors.items())
    return m


def expected_params(tensors: dict, n_layers: int) -> dict:
    """Our export's tensors under vLLM's parameter names (its q/k/v and gate/up fusion)."""
    out = {}
    for k, v in tensors.items():
        out[k if k.startswith("lm_head") else "model." + k] = v
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [out.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"], 0)
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [out.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")], 0)
    return out


def test_load_weights_every_tensor_lands(vllm_env, tmp_path):
    dst = tmp_path / "vllm"
    assert cli_main(["export", str(TINY / "draft"), str(dst), "--engine", "vllm"]) == 0
    tensors = load_file(str(dst / "model.safetensors"))
    m = vllm_load(vllm_env, dst)
    got = {k: p.detach().numpy() for k, p in m.named_parameters() if k != "model.mask_embedding"}
    want = expected_params(tensors, json.loads((dst / "config.json").read_text())["num_hidden_layers"])
    assert len(tensors) == 31 and len(want) == 25
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert m.model.confidence_head is not None and m.model.confidence_head.with_markov


def test_layer_id_minus_1_is_served(vllm_env, tmp_path):
    """vLLM resolves ids [-1, 2, 4] to capture points (0, 3, 5) and point 0, taken before the
    first layer with no residual yet, is the embedding output itself."""
    from vllm.model_executor.models.interfaces import EagleModelMixin
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    base = DraftConfig.from_hf(json.loads((TINY / "draft" / "config.json").read_text()))
    cfg = base.replace(target_layer_ids=(-1, 2, 4))
    assert engines.check(cfg, "vllm") is None
    src = checkpoint.save_draft(tmp_path / "src", cfg, draft_model.init_params(cfg, jax.random.key(1)),
                                format="jax")
    dst = tmp_path / "vllm"
    export.export_draft(src, dst, "vllm")
    assert get_eagle3_aux_layers_from_config(spec_config(vllm_env, dst, cfg.block_size)) == (0, 3, 5)
    m = vllm_load(vllm_env, dst)
    want = load_file(str(dst / "model.safetensors"))["fc.weight"]
    np.testing.assert_array_equal(m.model.fc.weight.detach().numpy(), want)

    class Capture(EagleModelMixin):
        aux_hidden_state_layers = (0, 3, 5)

    emb = torch.randn(3, 8)
    (got,) = Capture()._maybe_add_hidden_state([], 0, emb, None)
    assert got is emb


HEADS = ("vanilla", "gated", "rnn", "dflash", "no_confidence", "tap_minus_1")


def head_config(base: DraftConfig, head: str) -> DraftConfig:
    return {"gated": lambda: base.replace(markov_head_type="gated"),
            "rnn": lambda: base.replace(markov_head_type="rnn"),
            "dflash": lambda: base.replace(markov_rank=0, confidence_head_with_markov=False),
            "no_confidence": lambda: base.replace(enable_confidence_head=False),
            "tap_minus_1": lambda: base.replace(target_layer_ids=(-1, 2, 4)),
            "vanilla": lambda: base}[head]()


@pytest.mark.parametrize("head", HEADS)
def test_rule_table_agrees_with_vllm(vllm_env, tmp_path, head):
    """Whatever our rules say about vLLM for this head, vLLM's own loader does: a drafter the
    rules refuse is written anyway (the engine's config transform, no check) and must fail in
    vLLM; one they accept must load with every tensor in place."""
    base = DraftConfig.from_hf(json.loads((TINY / "draft" / "config.json").read_text()))
    cfg = head_config(base, head)
    params = jax.tree.map(np.asarray, draft_model.init_params(cfg, jax.random.key(2)))
    dst = tmp_path / "naive"
    dst.mkdir()
    tensors = mapping.draft_to_torch(cfg, params)
    safetensors_io.write_tensors(dst, tensors)
    (dst / "config.json").write_text(json.dumps(engines.export_config(cfg.to_hf(), cfg, "vllm")))
    refused = engines.check(cfg, "vllm")
    try:
        m = vllm_load(vllm_env, dst)
    except Exception as e:  # noqa: BLE001 - any refusal by vLLM's loader
        assert refused, f"our rules refuse nothing but vLLM {vllm.__version__} fails: {e!r}"
        assert "markov_head" in str(e), f"vLLM refuses for another reason than our rule's: {e!r}"
        return
    assert refused is None, f"vLLM {vllm.__version__} loads it but our rules refuse: {refused}"
    got = {k: p.detach().numpy() for k, p in m.named_parameters() if k != "model.mask_embedding"}
    want = expected_params(tensors, cfg.num_hidden_layers)
    empty = sorted(k for k, v in got.items() if v.size == 0)  # rank 0: vLLM's Markov head is empty
    assert empty == ([] if cfg.markov_rank else ["model.markov_head.markov_w1.weight",
                                                 "model.markov_head.markov_w2.weight"])
    got = {k: v for k, v in got.items() if k not in empty}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    warned = [r.name for r, _ in engines.violations(cfg, "vllm", "warning")]
    assert (m.model.confidence_head is None) == ("confidence-optional" in warned)
    assert (cfg.markov_rank == 0) == ("markov-rank-0" in warned)


# --------------------------------------------------------------------------- Gemma4

G4 = Path(__file__).parent / "fixtures" / "dspark_gemma4_tiny"


def vllm_load_gemma4(draft: Path):
    """vLLM's Gemma4DSparkForCausalLM for ``draft`` (the Gemma4 fixture target), its own
    load_weights over the export; returns (model, the names it reports loaded)."""
    from vllm.model_executor.models.gemma4_dspark import Gemma4DSparkForCausalLM

    target = ModelConfig(model=str(G4 / "target"), dtype="float32", skip_tokenizer_init=True)
    vc = VllmConfig(model_config=target, device_config=DeviceConfig(device="cpu"))
    vc.speculative_config = spec_config(target, draft, json.loads((draft / "config.json").read_text())["block_size"])
    with set_current_vllm_config(vc), torch.device("cpu"):
        m = Gemma4DSparkForCausalLM(vllm_config=vc)
        tensors = load_file(str(draft / "model.safetensors"))
        loaded = m.load_weights((k, torch.from_numpy(v)) for k, v in tensors.items())
    return m, loaded


def test_gemma4_load_weights_every_tensor_lands(vllm_env, tmp_path):
    """The Gemma4 drafter builds on CPU; every exported tensor lands equal (gate/up fused),
    the confidence head included (vllm 0.33.0 loads it: no 'drops' warning in our rules)."""
    dst = tmp_path / "vllm"
    export.export_draft(G4 / "draft", dst, "vllm")
    cfg, _ = checkpoint.load_draft(G4 / "draft")
    assert engines.violations(cfg, "vllm", "warning") == []
    tensors = load_file(str(dst / "model.safetensors"))
    m, loaded = vllm_load_gemma4(dst)
    state = {**dict(m.named_parameters()), **dict(m.named_buffers())}
    want = {}
    for k, v in tensors.items():
        want[k if k.startswith("lm_head") else "model." + k] = v
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        want[p + "gate_up_proj.weight"] = np.concatenate([want.pop(p + "gate_proj.weight"),
                                                          want.pop(p + "up_proj.weight")], 0)
    assert loaded == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(state[k].detach().numpy().reshape(v.shape), v, err_msg=k)
    assert m.model.confidence_head is not None


def test_gemma4_gated_head_is_silently_dropped(vllm_env, tmp_path):
    """Why our rule refuses a gated Gemma4 head for vLLM: its loader takes the checkpoint but
    leaves markov_head.gate_proj.* unloaded (a vanilla head would draft in its place)."""
    from dspark_jax.draft import gemma4 as g4_draft

    cfg, _ = checkpoint.load_draft(G4 / "draft")
    gated = cfg.replace(markov_head_type="gated")
    assert "silently skips" in engines.check(gated, "vllm")
    host = jax.tree.map(np.asarray, g4_draft.init_params(gated, jax.random.key(4)))
    dst = tmp_path / "naive"
    dst.mkdir()
    tensors = mapping.draft_to_torch(gated, host)
    safetensors_io.write_tensors(dst, tensors)
    (dst / "config.json").write_text(json.dumps(engines.export_config(gated.to_hf(), gated, "vllm")))
    _, loaded = vllm_load_gemma4(dst)
    gate = {k for k in tensors if k.startswith("markov_head.gate_proj")}
    assert gate and not any(k.removeprefix("model.") in gate for k in loaded)
