"""Ahead-of-time planning: lower and compile full-size programs on an abstract mesh.

Nothing full-size is materialised: params, optimizer state and batches are
``jax.ShapeDtypeStruct`` trees (``jax.eval_shape``) carrying NamedShardings;
``jit(...).lower(...).compile()`` then gives per-device memory
(``compiled.memory_analysis()``) and the collectives XLA inserted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dspark_jax import families
from dspark_jax.costs import hardware, hlo_cost
from dspark_jax import params as params_lib
from dspark_jax import sharding as shard_lib
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.convert import mapping
from dspark_jax.train.config import TrainConfig
from dspark_jax.train.program import abstract, build_program, compute_dtype

def _shape_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO array type ``dtype[dims]`` (0 for types not in ``_DTYPE_BYTES``)."""
    return _DTYPE_BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = hardware.DTYPE_BYTES


@dataclasses.dataclass
class ProgramPlan:
    """Per-device memory (bytes) and collectives of one compiled program."""

    name: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    code_bytes: int
    collectives: dict[str, dict[str, int]]
    compile_seconds: float
    upcast_bytes: int = 0
    platform: str = "cpu"
    flops: float = 0.0  # the compiler's cost analysis (a while loop's body counted once)
    bytes_accessed: float = 0.0
    step_flops: float = 0.0  # per run, every loop body x its trip count (``hlo_cost.step_cost``)
    step_bytes: float = 0.0
    largest: list = dataclasses.field(default_factory=list)  # largest_values of the compiled HLO

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries, less donated (aliased) buffers."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["peak_bytes"] = self.peak_bytes
        return d


def count_params(shapes_tree) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(shapes_tree)))


def reference_param_count(cfg) -> int:
    """Parameter count from the PyTorch checkpoint's tensor shapes (every tensor, incl. the frozen
    embedding and LM head copies), for a drafter of any family."""
    return int(sum(math.prod(s) for s in mapping.tensor_shapes(cfg).values()))


def param_report(draft_cfg, target_cfg) -> dict:
    """Parameter counts of the target and the drafter (all, trainable = not declared frozen, and
    from the reference's tensor shapes) and the drafter's HF config, for any model family."""
    specs = families.declare(draft_cfg)
    n = count_params(params_lib.abstract_params(specs))
    frozen = int(sum(math.prod(specs[p].shape) for p in params_lib.frozen_paths(specs)))
    target = count_params(params_lib.abstract_params(families.declare(target_cfg)))
    return {"draft": draft_cfg.to_hf(), "target_params": target, "draft_params": n,
            "draft_trainable_params": n - frozen,
            "draft_params_from_reference_shapes": reference_param_count(draft_cfg)}


def target_param_report(target_cfg) -> dict:
    """Parameter counts of a target alone: all, and active per token (a mixture-of-experts
    family's routed-expert leaves, declared with an ``expert`` axis, counted at
    ``num_experts_per_tok / n_routed_experts``; everything else counts whole)."""
    specs = families.declare(target_cfg)
    total = count_params(params_lib.abstract_params(specs))
    experts = sum(math.prod(s.shape) for s in specs.values() if "expert" in (s.axes or ()))
    k, e = (getattr(target_cfg, f, 1) for f in ("num_experts_per_tok", "n_routed_experts"))
    return {"target_params": total, "target_active_params": total - experts + experts * k // e}


def tree_bytes_per_device(tree) -> int:
    """Bytes a single device holds for a ShapeDtypeStruct tree with shardings."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shard) * np.dtype(x.dtype).itemsize
    return int(total)


def collectives_in(hlo_text: str) -> dict[str, dict[str, int]]:
    """Count and result bytes of each collective op in compiled HLO text."""
    out: dict[str, dict[str, int]] = {}
    for line in hlo_text.splitlines():
        line = line.strip()
        for op in COLLECTIVES:
            m = re.search(rf"=\s*(.*?)\s{op}(-start)?\(", line)
            if not m:
                continue
            nbytes = sum(_shape_bytes(dt, dims)
                         for dt, dims in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", m.group(1)))
            entry = out.setdefault(op, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += nbytes
            break
    return out


_NOT_A_BUFFER = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional",
                 "call", "after-all", "partition-id", "replica-id", "opt-barrier")


def largest_values(hlo_text: str, n: int = 5) -> list[dict]:
    """The ``n`` largest array values the compiled program computes outside fusion bodies (what
    gets an HBM buffer: copies, transposes, slices the backend materialises), largest first:
    {"bytes", "shape", "op", "name"}. Parameters, tuples and bitcasts (no new buffer) are left out."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo_text))
    out, skip = [], False
    for line in hlo_text.splitlines():
        head = re.match(r"(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            skip = head.group(1) in fused
            continue
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = ([a-z]+[0-9]*)\[([0-9,]*)\]\S* ([\w\-]+)\(", line)
        if skip or not m or m.group(4) in _NOT_A_BUFFER:
            continue
        kind = re.search(r"kind=(\w+)", line) if m.group(4) == "fusion" else None
        out.append({"bytes": _shape_bytes(m.group(2), m.group(3)), "shape": f"{m.group(2)}[{m.group(3)}]",
                    "op": m.group(4) + (f":{kind.group(1)}" if kind else ""), "name": m.group(1)})
    return sorted(out, key=lambda v: -v["bytes"])[:n]


def upcast_bytes(hlo_text: str) -> int:
    """Bytes of the float32 copies the backend made of bfloat16 *arguments* (weights, KV caches).

    XLA:CPU runs many bf16 ops in f32 (dots inside the layer loops, cache scatters,
    collectives): it converts each bf16 entry parameter that feeds one to f32 once, in the entry
    computation (hoisted out of the loops), and those copies live in the temporaries. A GPU/TPU compile of the same program keeps them
    bf16. This is the sum of the copies' sizes, not their peak: copies used in different phases
    of a program (the draft layers' weights, then the target's) may share one buffer, so the
    sum can exceed the temporaries. Counted: entry-computation ``convert`` ops (plain or wrapped
    in a loop fusion) from a bf16 parameter to an f32 result.
    """
    entry = hlo_text[hlo_text.find("\nENTRY"):] if "\nENTRY" in hlo_text else ""
    if not entry:
        return 0
    header, _, body = entry.partition("{\n")
    bf16_params = {name for name, dt in re.findall(r"([\w.\-]+): (\w+)\[", header) if dt == "bf16"}
    total = 0
    for line in body.splitlines():
        m = re.match(r"\s*%\S+ = f32\[([0-9,]*)\]\S* (convert|fusion)\(%([\w.\-]+)\)(.*)", line)
        if m and m.group(3) in bf16_params and (m.group(2) == "convert" or "calls=%wrapped_convert" in m.group(4)):
            total += _shape_bytes("f32", m.group(1))
    return total


def compile_plan(name: str, fn: Callable, *abstract_args, platform: str | None = None,
                 **jit_kwargs) -> ProgramPlan:
    """Lower + compile ``fn`` (jitted with ``jit_kwargs`` unless it is jitted already) on
    abstract args for ``platform`` (default: the default backend's; the args' shardings choose
    the devices); return its ProgramPlan. XLA:CPU's bf16->f32 copies are counted on CPU only."""
    import time
    platform = platform or jax.default_backend()
    start = time.perf_counter()
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn, **jit_kwargs)
    compiled = jitted.lower(*abstract_args).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    get = lambda attr: int(getattr(mem, attr, 0) or 0) if mem is not None else 0
    text = compiled.as_text()
    cost = hardware.program_cost(compiled)
    step = hlo_cost.step_cost(text)
    return ProgramPlan(name, get("argument_size_in_bytes"), get("output_size_in_bytes"),
                       get("temp_size_in_bytes"), get("alias_size_in_bytes"),
                       get("generated_code_size_in_bytes"), collectives_in(text), seconds,
                       upcast_bytes(text) if platform == "cpu" else 0, platform, cost["flops"],
                       cost["bytes"], step["flops"], step["bytes"], largest_values(text, 32))


def projected(plan: ProgramPlan, chip, *, tokens: float = 0.0, model_flops: float = 0.0) -> dict:
    """Roofline of one run of a compiled program on ``chip`` from its own per-run cost
    (``step_flops`` / ``step_bytes``: loop bodies x trip counts; collectives not charged):
    seconds = max(flops / peak, bytes / bandwidth). For a train step, ``tokens`` trained per chip
    per step and the analytic ``model_flops`` per chip (``flops.model_flops``) add tokens/s per
    chip and MFU = model flops / (seconds x peak)."""
    out = hardware.project(plan.step_flops, plan.step_bytes, chip)
    if tokens:
        out.update(tokens=tokens, tokens_per_s=tokens / out["seconds"], model_flops=model_flops,
                   mfu=model_flops / (out["seconds"] * chip.peak_flops),
                   compiled_over_model_flops=plan.step_flops / model_flops if model_flops else None)
    return out


def plan_train_step(draft_cfg: DraftConfig, target_cfg: TargetConfig, train_cfg: TrainConfig,
                    mesh: Mesh, *, total_steps: int = 1000) -> tuple[ProgramPlan, dict]:
    """Compile the sharded train step of ``train_cfg`` (its features mode, batch, compute dtype,
    loss, optimizer and memory options) on ``mesh`` for abstract inputs; the frozen drafter and
    target weights are in the compute dtype.

    Returns the plan and a dict of per-device bytes (params, optimizer, frozen, target, batch).
    """
    dtype = compute_dtype(train_cfg)
    program = build_program(draft_cfg, target_cfg, train_cfg, mesh, total_steps=total_steps,
                            weights_dtype=dtype, feature_dtype=dtype)
    plan = compile_plan(f"train_step[{train_cfg.features}]", program.step, *program.abstract_args,
                        platform=shard_lib.platform_of(mesh))
    sizes = {"params_bytes": tree_bytes_per_device(program.state.params),
             "optimizer_bytes": tree_bytes_per_device(program.state.opt_state),
             "frozen_bytes": tree_bytes_per_device(program.frozen),
             "target_bytes": tree_bytes_per_device(program.target) if program.online else 0,
             "batch_bytes": tree_bytes_per_device(program.batch)}
    return plan, sizes


def _target_forward(target_cfg) -> Callable:
    """The target's protocol forward (``families.target_runtime``), or, for a family with no
    runtime record yet, its module's ``forward`` (same signature)."""
    from dspark_jax.errors import ConfigError
    try:
        return families.target_runtime(target_cfg).forward
    except ConfigError:
        return families.for_config(target_cfg).module().forward


def plan_target_forward(target_cfg, mesh: Mesh, *, batch: int, seq_len: int, taps: tuple[int, ...],
                        dtype=jnp.bfloat16) -> tuple[ProgramPlan, dict]:
    """Compile the frozen target's forward as the online trainer runs it (``make_features``:
    tokens [batch, seq_len] -> features of layers ``taps`` and the last hidden, one pass, no
    cache) on ``mesh`` for abstract params in ``dtype`` placed by their declared axes (an
    ``expert`` mesh axis carries the routed experts) and batch-sharded tokens.

    Returns the plan and per-device bytes of the params and the tokens."""
    from dspark_jax import runtime

    rules = shard_lib.DEFAULT_RULES
    t_abs, _ = families.abstract_params(target_cfg, mesh, dtype, rules)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=NamedSharding(
        mesh, shard_lib.logical_to_spec(("batch", None), rules, (batch, seq_len), mesh)))
    ctx = runtime.Context.make(mesh, rules, dtype)
    forward = _target_forward(target_cfg)

    def features(params, ids):
        hidden, feats, _ = forward(params, target_cfg, ids, None, ctx=ctx, taps=tuple(taps), span=None)
        return feats, hidden

    plan = compile_plan("target_forward", features, t_abs, tokens, platform=shard_lib.platform_of(mesh))
    return plan, {"target_bytes": tree_bytes_per_device(t_abs), "batch_bytes": tree_bytes_per_device(tokens)}


def sharding_summary(tree) -> dict[str, str]:
    """keystr -> PartitionSpec string for a tree of ShapeDtypeStructs / arrays with shardings."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding):
            out[jax.tree_util.keystr(path)] = str(s.spec)
    return out


def plan_decode_round(draft_cfg: DraftConfig | None, target_cfg: TargetConfig, mesh: Mesh, *, batch: int,
                      max_len: int, dtype=jnp.bfloat16, max_new_tokens: int = 1024,
                      spans: tuple[int, ...] | None = None, per_layer: bool | None = None) -> tuple[ProgramPlan, dict]:
    """Compile one speculative decode round (draft, Markov sampling, verify, commit) on ``mesh``
    for abstract state: the very jitted round (``spec.step``) of ``decode.build_decode(mesh)`` that
    ``generate --mesh`` runs, with params and state placed by their declared logical axes.
    ``draft_cfg=None``: the autoregressive step (``ar.step``) instead. ``spans``: the compiled
    cache spans (default: the shipped ones; ``(max_len,)``: attention over the whole cache).
    ``per_layer``: the target's layer weights as separate per-layer buffers
    (``params.unstack_layers``; the target forward then loops over layers unrolled), or stacked
    (False); default: as ``generate`` places them on the mesh's platform (per-layer on GPUs,
    ``DecodeProgram.platform_layers``)."""
    import types

    from dspark_jax.decode import programs, shapes
    from dspark_jax.decode.state import DecodeStatic
    from dspark_jax.decode import sharded
    from dspark_jax.decode.policies import FullPolicy

    sharded.check_mesh(mesh, target_cfg, draft_cfg, batch)
    prog = programs.build_decode(mesh, sharded.decode_rules(target_cfg))
    t_abs, _ = families.abstract_params(target_cfg, mesh, dtype, prog.rules)
    if per_layer is None:
        t_abs = prog.platform_layers(t_abs, target_cfg)
    elif per_layer:
        t_abs = params_lib.unstack_layers(t_abs, families.target_runtime(target_cfg).stacks)
    rep = shard_lib.replicated(mesh)
    temp_stop = (jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
                 jax.ShapeDtypeStruct((shapes.MAX_STOP_IDS,), jnp.int32, sharding=rep))
    if draft_cfg is None:
        static = DecodeStatic(target_cfg, None, None, False, max_new_tokens, spans=spans)
        state_shapes = jax.eval_shape(
            lambda tp: prog.ar.prefill(tp, None, jnp.zeros((batch, 64), jnp.int32),
                                       jnp.full((batch,), 64, jnp.int32), jnp.ones((batch,), bool),
                                       jax.random.PRNGKey(0), jnp.float32(1.0),
                                       jnp.full((shapes.MAX_STOP_IDS,), -1, jnp.int32), static=static,
                                       max_len=max_len), t_abs)
        args = (t_abs, None, abstract(state_shapes, prog.state_sharding(state_shapes)), *temp_stop, None)
        program = types.SimpleNamespace(lower=lambda *a: prog.ar.step.lower(*a, static=static))
        plan = compile_plan("ar_step", program, *args, platform=shard_lib.platform_of(mesh))
        sizes = {"target_bytes": tree_bytes_per_device(t_abs), "draft_bytes": 0}
    else:
        d_abs, _ = families.abstract_params(draft_cfg, mesh, dtype, prog.rules)
        if per_layer is None:
            d_abs = prog.platform_layers(d_abs, draft_cfg)  # per-layer drafter layers on GPUs
        static = DecodeStatic(target_cfg, draft_cfg, FullPolicy(), False, max_new_tokens, spans=spans)
        state_shapes = programs.abstract_decode_state(t_abs, d_abs, static, batch, max_len)
        args = (t_abs, d_abs, abstract(state_shapes, prog.state_sharding(state_shapes)), *temp_stop,
                jax.ShapeDtypeStruct((draft_cfg.block_size,), jnp.float32, sharding=rep))
        program = types.SimpleNamespace(lower=lambda *a: prog.spec.step.lower(*a, static=static))
        plan = compile_plan("decode_round", program, *args, platform=shard_lib.platform_of(mesh))
        sizes = {"target_bytes": tree_bytes_per_device(t_abs), "draft_bytes": tree_bytes_per_device(d_abs),
                 "draft_context_cache_bytes": tree_bytes_per_device(args[2].ctx)}
    state = args[2]
    sizes.update(state_bytes=tree_bytes_per_device(state), kv_cache_bytes=tree_bytes_per_device(state.cache))
    return plan, sizes
