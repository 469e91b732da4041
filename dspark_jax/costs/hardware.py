"""Compile-only accelerator targets: ``--hardware tpu-v5e:2x4 | tpu-v5p:2x2x4 | h200:8 | ...``.

JAX compiles ahead of time for TPUs and NVIDIA GPUs on a host that has neither:
``jax.experimental.topologies.get_topology_desc`` gives *compile-only* devices (TPU through
libtpu, the ``tpu`` extra; CUDA through the jax CUDA plugin, the ``cuda`` extra, no driver
needed) and ``jit(...).lower(...).compile()`` on a mesh of them runs the real TPU / GPU compiler:
``memory_analysis()`` is that compiler's buffer assignment, ``as_text()`` its HLO.

One table (``CHIPS``) holds each chip's facts: HBM bytes, peak dense bf16 FLOP/s, HBM bandwidth,
and how to describe it to the compiler. ``parse`` reads a spec, ``compile_devices`` gives the
devices, ``program_cost`` the flops / bytes of a compiled program, ``project`` the roofline time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import math
import os
import re

from dspark_jax.errors import InputError
from dspark_jax.kernels.plugins import EXTRAS, has_extra

GiB = 2**30
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip: its facts and how the compiler names it.

    ``platform``: "tpu" or "cuda". TPU: ``topology`` prefix (``<prefix>:<dims>``) and
    ``chip_config`` (megacore chips fuse two TensorCores). CUDA: the ``GpuTargetConfigProto``
    fields of the SM90 device description (``core_count`` SMs, ``clock_ghz``)."""

    name: str
    platform: str
    hbm_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    bandwidth: float  # HBM bytes/s
    topology: str = ""
    chip_config: str = "default"
    dims: int = 2  # TPU torus rank
    description: str = ""


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("tpu-v4", "tpu", 32 * GiB, 275e12, 1228e9, "v4", "megacore", 3),
    Chip("tpu-v5e", "tpu", 16 * GiB, 197e12, 819e9, "v5e", "default", 2),
    Chip("tpu-v5p", "tpu", 95 * GiB, 459e12, 2765e9, "v5p", "megacore", 3),
    Chip("tpu-v6e", "tpu", 32 * GiB, 918e12, 1640e9, "v6e", "default", 2),
    Chip("h100", "cuda", 80 * GiB, 989e12, 3.35e12, description="NVIDIA H100 80GB HBM3"),
    Chip("h200", "cuda", 143771 * 2**20, 989e12, 4.8e12, description="NVIDIA H200"),
)}



@dataclasses.dataclass(frozen=True)
class Hardware:
    """A parsed ``--hardware`` spec: a chip and its device grid (TPU torus dims; GPU hosts x chips)."""

    spec: str
    chip: Chip
    shape: tuple[int, ...]

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        c = self.chip
        return {"spec": self.spec, "chip": c.name, "platform": c.platform, "devices": self.num_devices,
                "hbm_bytes": c.hbm_bytes, "peak_flops": c.peak_flops, "bandwidth": c.bandwidth}


def parse(spec: str) -> Hardware:
    """``"tpu-v5e:2x4"`` -> Hardware. TPU dims are the torus (2 for v5e/v6e, 3 for v4/v5p); GPU
    ``h200:8`` is one host of 8, ``h200:2x8`` two hosts of 8."""
    name, _, dims = spec.strip().partition(":")
    chip = CHIPS.get(name.lower())
    if chip is None:
        raise InputError(f"--hardware {spec!r}: unknown chip {name!r} (known: {', '.join(CHIPS)})")
    if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)*", dims):
        raise InputError(f"--hardware {spec!r}: give the chip grid after ':', e.g. "
                         f"{'h200:8' if chip.platform == 'cuda' else chip.name + ':' + 'x'.join(['2'] * chip.dims)}")
    shape = tuple(int(d) for d in dims.split("x"))
    want = (1, 2) if chip.platform == "cuda" else (chip.dims,)
    if len(shape) not in want:
        raise InputError(f"--hardware {spec!r}: {chip.name} takes {' or '.join(map(str, want))} dims, got {len(shape)}")
    return Hardware(spec, chip, shape)


def _require_extra(hw: Hardware) -> None:
    module, install = EXTRAS[hw.chip.platform]
    if not has_extra(hw.chip.platform):
        raise InputError(f"--hardware {hw.spec} needs {module}, which is not installed: {install}")


def gpu_target_config(chip: Chip) -> str:
    """GpuTargetConfigProto text of an SM90 (Hopper) chip with ``chip``'s memory and bandwidth."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.bandwidth)}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {chip.hbm_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{chip.description}"
"""


def _quiet_libtpu(hw: Hardware) -> None:
    """libtpu asks the cloud metadata server and TPU_* variables what host it is on, and locks the
    host's chips; a compile-only topology needs none of it: name the host here so it neither
    queries the network nor warns, and let several compiling processes load libtpu."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip to lock: several compilers may run
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{hw.chip.topology}-{hw.num_devices}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_WORKER_ID", "0")


def compile_devices(hw: Hardware) -> list:
    """The compile-only devices of ``hw`` (``jax.experimental.topologies``), in topology order.

    InputError naming the extra to install when libtpu / the CUDA plugin is missing."""
    _require_extra(hw)
    from jax.experimental import topologies

    if hw.chip.platform == "tpu":
        _quiet_libtpu(hw)
        dims3 = tuple(hw.shape) + (1,) * (3 - len(hw.shape))
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{hw.chip.topology}:{'x'.join(map(str, hw.shape))}",
            chip_config_name=hw.chip.chip_config, chips_per_host_bounds=tuple(min(2, d) for d in dims3),
            num_slices=1, wrap=(False, False, False))
    else:
        # XLA:GPU's Triton gemm emitter fails on some small dots of these programs when compiling
        # without a device ("Couldn't find output tile sizes"): gemms go to cuBLAS. Read by XLA
        # once per process, so this holds where no XLA flag was parsed yet (the CLI, benchmarks).
        set_gpu_flags(("--xla_gpu_enable_triton_gemm=false",))
        hosts, per_host = (1, *hw.shape) if len(hw.shape) == 1 else hw.shape
        topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(hw.chip),
                                            topology=f"1x{hosts}x{per_host}")
    devices = list(topo.devices)
    if len(devices) != hw.num_devices:  # megacore or a topology the compiler reads differently
        raise InputError(f"--hardware {hw.spec}: the compiler made {len(devices)} devices, not {hw.num_devices}")
    return devices


# XLA:GPU flags every program of this project is compiled with (``set_gpu_flags``):
# - the dot merger joins the q / k / v projections of one layer into one gemm by concatenating
#   their kernels, a copy of 3/8 of the layer's attention weights on every call (48 MiB per
#   Qwen3-8B layer per decode step); three gemms read the kernels where they lie.
GPU_XLA_FLAGS = ("--xla_gpu_dot_merger_threshold_mb=0",)


def set_gpu_flags(extra: tuple[str, ...] = ()) -> None:
    """Append ``GPU_XLA_FLAGS`` (and ``extra``) to ``XLA_FLAGS``, each unless the user set that
    flag already. XLA reads XLA_FLAGS once per process, at its first backend: call this before
    (the CLI's entry point, ``compile_devices``); xla_gpu flags do nothing on other platforms."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in GPU_XLA_FLAGS + tuple(extra):
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def quiet_cpu_host() -> None:
    """Keep a CPU host's JAX processes off libtpu's TPU probe: with the ``tpu`` extra installed and
    no TPU attached, default ``JAX_PLATFORMS`` to the attached platforms (compile-only devices
    come from ``compile_devices`` whatever JAX_PLATFORMS says)."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):  # a TPU VM
        return
    gpu = os.path.exists("/dev/nvidiactl") and has_extra("cuda")
    os.environ["JAX_PLATFORMS"] = "cuda,cpu" if gpu else "cpu"


# --------------------------------------------------------------------------- costs


@contextlib.contextmanager
def unrolled_loops():
    """Lower with every ``lax.scan`` / ``lax.map`` fully unrolled, for per-step costs.

    XLA's cost analysis counts a while loop's body once, whatever its trip count: the 36-layer
    scan of a Qwen3-8B forward would count as one layer. Inside this context ``jax.lax.scan``
    (and ``lax.map``, written as a scan) unroll completely, so the lowered program holds every
    layer (loop bodies x trip counts) and its cost analysis counts all of them. Values are
    unchanged. JAX's trace caches are cleared on entry and exit (a jitted function traced
    outside would otherwise be reused with its loops).
    """
    import jax

    scan, lmap = jax.lax.scan, jax.lax.map

    def scan_unrolled(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
        return scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)

    def map_unrolled(f, xs, **kw):
        return scan(lambda c, x: (c, f(x)), None, xs, unroll=True)[1]

    jax.clear_caches()
    jax.lax.scan, jax.lax.map = scan_unrolled, map_unrolled
    try:
        yield
    finally:
        jax.lax.scan, jax.lax.map = scan, lmap
        jax.clear_caches()


def _gpu_gemm_cost(hlo_text: str) -> dict:
    """FLOPs and HBM bytes of the cuBLAS / cuBLASLt gemm custom calls of compiled GPU HLO (which
    XLA's generic cost analysis counts as 0): flops 2 x output elements x contracted size, from
    the shapes of the call's result and first operand (looked up by name) and its dot dimension
    numbers; bytes the operands read plus the result written (the cuBLAS workspace left out)."""
    shape_re = r"([a-z]+[0-9]*)\[([0-9,]*)\]"
    dims = lambda text: [int(d) for d in text.split(",") if d]
    nbytes = lambda dt, d: DTYPE_BYTES.get(dt, 0) * math.prod(d)
    shapes = {m.group(1): (m.group(2), dims(m.group(3))) for m in
              re.finditer(r"(%[\w.\-]+) = " + shape_re, hlo_text)}
    flops = total_bytes = 0.0
    for line in hlo_text.splitlines():
        if 'custom_call_target="__cublas$' not in line:
            continue
        m = re.search(r"=\s*\(?\s*" + shape_re + r".*?custom-call\(([^)]*)\)", line)
        contract = re.search(r'"lhs_contracting_dimensions":\[([0-9",]*)\]', line)
        if not m or not contract:
            continue
        operands = [(o.group(1), dims(o.group(2))) if o.group(1) else shapes.get(o.group(3))  # shape inline or by name
                    for o in re.finditer(r"(?:" + shape_re + r"\S*\s+)?(%[\w.\-]+)", m.group(3))]
        if not operands or operands[0] is None:
            continue
        out = dims(m.group(2))
        k = math.prod(operands[0][1][int(i)] for i in contract.group(1).replace('"', "").split(",") if i)
        flops += 2.0 * math.prod(out) * k
        total_bytes += nbytes(m.group(1), out) + sum(nbytes(*o) for o in operands if o is not None)
    return {"flops": flops, "bytes": total_bytes}


def program_cost(compiled) -> dict:
    """Flops and HBM bytes of a compiled program from its own compiler's cost analysis.

    TPU: ``compiled.cost_analysis()``. GPU (where that is None): XLA's HLO cost analysis over the
    compiled HLO modules (bytes and fused flops) plus the cuBLAS gemm calls' flops and bytes
    (``_gpu_gemm_cost``). A while loop's body is counted once: lower with loops unrolled for
    per-step totals."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    if ca:
        return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0))}
    import jax
    from jax._src.lib import _jax

    client = jax.devices("cpu")[0].client
    flops = nbytes = 0.0
    for module in compiled.runtime_executable().hlo_modules():
        c = _jax.hlo_module_cost_analysis(client, module)
        gemm = _gpu_gemm_cost(module.to_string())
        flops += float(c.get("flops", 0.0)) + gemm["flops"]
        nbytes += float(c.get("bytes accessed", 0.0)) + gemm["bytes"]
    return {"flops": flops, "bytes": nbytes}


def project(flops: float, nbytes: float, chip: Chip) -> dict:
    """Roofline seconds on one ``chip``: max(flops / peak, bytes / bandwidth) and the bound."""
    tc, tm = flops / chip.peak_flops, nbytes / chip.bandwidth
    return {"seconds": max(tc, tm), "compute_s": tc, "memory_s": tm, "bound": "compute" if tc >= tm else "memory"}


def fits(peak_bytes: int, chip: Chip) -> bool:
    return peak_bytes <= chip.hbm_bytes
