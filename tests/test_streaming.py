"""Streaming load/export of sharded safetensors checkpoints onto a device mesh."""

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from dspark_jax import sharding
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.convert import mapping, streaming
from dspark_jax.convert.safetensors_io import INDEX_NAME, read_tensors
from dspark_jax.draft import model as draft_model
from dspark_jax.target import qwen3

TARGET = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
DRAFT = DraftConfig.for_target(TARGET, num_hidden_layers=2, target_layer_ids=(0, 2), mask_token_id=255,
                               markov_rank=16, markov_head_type="gated")


def write_checkpoint(path, config, params, shard="40KB"):
    path.mkdir()
    tensors = (mapping.target_to_torch(config, params) if isinstance(config, TargetConfig)
               else mapping.draft_to_torch(config, params))
    streaming.write_tensor_stream(path, iter(tensors.items()), max_shard_size=shard)
    (path / "config.json").write_text(json.dumps(config.to_hf()))
    return tensors


@pytest.mark.parametrize("config", [TARGET, DRAFT], ids=["target", "draft-gated"])
def test_stream_load_equals_plain_load(tmp_path, config):
    rng = jax.random.PRNGKey(0)
    params = (qwen3.init_params(config, rng) if isinstance(config, TargetConfig)
              else draft_model.init_params(config, rng))
    tensors = write_checkpoint(tmp_path / "ckpt", config, params)
    assert (tmp_path / "ckpt" / INDEX_NAME).exists()  # really multi-shard
    mesh = sharding.make_mesh("fsdp=2,tensor=2", jax.devices()[:4])
    stats = {}
    loaded = streaming.stream_load(tmp_path / "ckpt", config, mesh, stats=stats)
    plain = (mapping.target_from_torch(config, read_tensors(tmp_path / "ckpt")) if isinstance(config, TargetConfig)
             else mapping.draft_from_torch(config, read_tensors(tmp_path / "ckpt")))
    flat_loaded = dict(jax.tree_util.tree_leaves_with_path(loaded))
    for path, want in jax.tree_util.tree_leaves_with_path(plain):
        got = flat_loaded[path]
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding.mesh.shape == mesh.shape
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(loaded))
    assert stats["bytes_read"] > 0
    # Export back, tensor by tensor: the same bytes.
    streaming.stream_export(tmp_path / "export", config, loaded, max_shard_size="30KB")
    again = read_tensors(tmp_path / "export")
    assert again.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(again[k], tensors[k])
    with pytest.raises(Exception, match="exists"):
        streaming.stream_export(tmp_path / "export", config, loaded)


def test_stream_load_validates_before_reading(tmp_path):
    params = qwen3.init_params(TARGET, jax.random.PRNGKey(0))
    write_checkpoint(tmp_path / "ckpt", TARGET, params)
    bad = TARGET.__class__(**{**TARGET.__dict__, "intermediate_size": 96})
    mesh = sharding.make_mesh("fsdp=4", jax.devices()[:4])
    with pytest.raises(Exception, match="mlp.gate_proj.weight.*shape"):
        streaming.stream_load(tmp_path / "ckpt", bad, mesh)


PEAK_SCRIPT = textwrap.dedent("""
    import os, resource, sys, json
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, numpy as np
    from dspark_jax import sharding
    from dspark_jax.config import TargetConfig
    from dspark_jax.convert import mapping, streaming
    from dspark_jax.convert.safetensors_io import read_tensors
    cfg = TargetConfig.from_hf(json.load(open(sys.argv[1] + "/config.json")))
    mesh = sharding.make_mesh("fsdp=2,tensor=2")
    jax.device_put(np.zeros(4), jax.devices()[0]).block_until_ready()  # init the backend first
    def rss_mb():  # anonymous resident memory: excludes mmapped (page-cache) checkpoint pages
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    import threading, time
    samples = []
    stop = threading.Event()
    def sample():
        while not stop.is_set():
            samples.append(rss_mb())
            time.sleep(0.002)
    base = rss_mb()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    if sys.argv[2] == "stream":
        params = streaming.stream_load(sys.argv[1], cfg, mesh)
    else:
        params = mapping.target_from_torch(cfg, read_tensors(sys.argv[1]))
        axes = __import__("dspark_jax.target.qwen3", fromlist=["x"]).param_axes(cfg)
        params = sharding.shard_params(params, axes, mesh)
    jax.block_until_ready(params)
    stop.set(); thread.join()
    peak = max(samples + [rss_mb()])
    held = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
    print(json.dumps({"base_mb": base, "peak_mb": peak, "arrays_mb": held}))
""")


def peak_memory(ckpt, mode):
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(ckpt), mode], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_streaming_peak_host_memory(tmp_path):
    """Transient host memory beyond the loaded arrays: ~one slice streaming, ~the model plain.

    Measured as anonymous RSS (sampled during the load) in a fresh subprocess;
    on CPU the "device" arrays themselves live in host memory and are subtracted.
    """
    cfg = TargetConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    params = jax.tree.map(lambda x: np.asarray(x), qwen3.init_params(cfg, jax.random.PRNGKey(0)))
    write_checkpoint(tmp_path / "big", cfg, params, shard="16MB")
    size_mb = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
    del params
    stream = peak_memory(tmp_path / "big", "stream")
    plain = peak_memory(tmp_path / "big", "plain")
    extra = lambda r: r["peak_mb"] - r["base_mb"] - r["arrays_mb"]
    print(f"checkpoint {size_mb:.0f} MB; transient extra: stream {extra(stream):.0f} MB, "
          f"plain {extra(plain):.0f} MB")
    assert extra(stream) < 0.35 * size_mb
    assert extra(plain) > 0.7 * size_mb
