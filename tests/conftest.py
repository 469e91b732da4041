"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision, shared fixtures, and the
work units pytest-xdist hands to its workers (pyproject: -n logical --dist loadfile)."""

import gc
import os
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# XLA:CPU compiles take most of the suite's time. LLVM at -O0 (without its expensive passes) and
# XLA:CPU's classic elemental emitters instead of its MLIR fusion emitters compile the tiny
# fixtures' programs 2-3x faster: only how XLA:CPU turns a program into machine code changes,
# not what the tests check (values within their tolerances, exact tokens, compile counts). One
# LLVM module per program (no parallel codegen split): each xdist worker has one CPU, where the
# split only adds work (the V4 AR decode's compiles on one core: 13.4 -> 9.4 s).
# Subprocesses inherit the flags (launch/local.py's children, the benchmarks' smoke runs). An
# unknown XLA flag aborts the process, so the emitter flag goes to the jaxlib it was checked on.
FAST_COMPILE_FLAGS = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
if version("jaxlib").startswith("0.10."):
    FAST_COMPILE_FLAGS += ["--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"]
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] = " ".join([os.environ["XLA_FLAGS"]] + FAST_COMPILE_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = Path(__file__).parent / "fixtures"
# pytest-xdist hands out one test module at a time (its module fixtures and compiled programs are
# built once, on one worker); modules that share a costly session fixture form one work unit
SHARED_UNITS = {"test_demo.py": "quick_demo_run", "test_workflow.py": "quick_demo_run"}
# modules whose tests share nothing costly: each test is a unit of its own (a subprocess each)
SPLIT_UNITS = {"test_benchmarks.py"}
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


def _work_unit(nodeid: str) -> str:
    """The work unit of a test under pytest-xdist: its module's file name, the unit of
    SHARED_UNITS that module belongs to, or the test itself in a SPLIT_UNITS module."""
    module = nodeid.split("::", 1)[0].rpartition("/")[2]
    if module in SPLIT_UNITS:
        return nodeid
    return SHARED_UNITS.get(module, module)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, run by the controller
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with SHARED_UNITS joined into one unit, and the units handed out in the
    order of the workers' collection (pytest_collection_modifyitems: slow units first)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False  # xdist's default order: most tests first
    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(config, items):
    """On a pytest-xdist worker: the work units holding a @pytest.mark.slow test first (a stable
    sort), so that no long test starts last while the other workers idle (longest first). The
    order within a unit is kept. A run without xdist keeps the collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = {_work_unit(it.nodeid) for it in items if it.get_closest_marker("slow")}
    first = {}
    for it in items:
        first.setdefault(_work_unit(it.nodeid), len(first))
    items.sort(key=lambda it: (_work_unit(it.nodeid) not in slow, first[_work_unit(it.nodeid)]))
