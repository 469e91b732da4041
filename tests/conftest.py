"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision, shared fixtures."""

import gc
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "dspark_qwen3_tiny"


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The reference fixture (copied from shared/golden): target/, draft/, train_forward.npz, decode_greedy.json."""
    return TINY


@pytest.fixture(scope="session")
def tiny_reference(tiny_dir):
    """(target_cfg, target_params, draft_cfg, draft_params, decode_greedy.json) of the reference fixture."""
    import json

    from dspark_jax.convert.checkpoint import load_draft, load_target
    tc, tp = load_target(tiny_dir / "target")
    dc, dp = load_draft(tiny_dir / "draft")
    return tc, tp, dc, dp, json.loads((tiny_dir / "decode_greedy.json").read_text())


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def _max_memory_maps() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Free compiled executables between test modules once they hold many memory mappings.

    Every XLA:CPU executable keeps a handful of mmap'd code/data regions alive for as long as a
    jit cache holds it; the whole suite in one process compiles thousands of programs and crossed
    Linux's ``vm.max_map_count`` (65530), after which the next compile segfaulted inside XLA.
    Clearing at half the limit keeps the suite's own cache reuse within a module.
    """
    yield
    if _memory_maps() > _max_memory_maps() // 2:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def quick_demo_run(tmp_path_factory):
    """One quick demo per session, shared by tests/test_demo.py and the README test: (cfg, info, logs)."""
    from dspark_jax.pipelines.demo import quick_config, run_demo

    cfg = quick_config(str(tmp_path_factory.mktemp("demo") / "quick"))
    logs = []
    info = run_demo(cfg, progress=False, log=logs.append)
    return cfg, info, logs
