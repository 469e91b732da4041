"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision, shared fixtures."""

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
