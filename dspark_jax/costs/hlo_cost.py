"""Per-step flops and HBM bytes of a compiled (TPU / GPU / CPU) HLO module, loops counted per trip.

XLA's cost analysis counts a ``while`` body once whatever its trip count, so a scanned 36-layer
forward costs one layer; unrolling every loop (``hardware.unrolled_loops``) fixes that at 2-10x the
compile time, which rules it out for a full-size train step on a small host. ``step_cost`` reads
the optimised HLO text instead and weights each computation by how often it runs:

- ``while``: its body x the trip count (``known_trip_count`` in the backend config, as XLA:GPU
  writes it, else, as XLA:TPU leaves it, from the condition's ``counter < N``, the body's
  ``counter + step`` and the counter's initial constant); ``call`` / async wrappers once;
  ``conditional`` its costliest branch.
- flops: matrix products only, 2 x output elements x contracted size: ``dot``, ``convolution`` (how
  XLA:TPU writes dots: contracted size = the kernel's input features x the window taps that land
  on input), the cuBLAS gemm custom calls of XLA:GPU, cuDNN's fused attention calls (``fmha_flops``),
  a ``reduce`` of a ``multiply`` (a
  matrix-vector product written elementwise: 2 x the product's elements), inside fusions or not,
  and our Pallas Triton kernels (``__gpu$xla.gpu.triton`` custom calls, known by the ``name`` in
  their backend config): ``flash.KERNEL_NAME``'s two matmuls from its operands' shapes
  (``flash.flops``); another Triton kernel counts no flops. A Pallas TPU kernel (a
  ``tpu_custom_call``) counts the flops and the bytes of the ``pl.CostEstimate`` it was built with
  (``flash_tpu``: what its DMAs move -- one layer's K / V span of the whole stack it takes as an
  operand, q, the mask, its results); one without an estimate, its operands and result.
  Other elementwise flops are left out (a few % of these programs' matmul flops).
- bytes: each top-level instruction (a fusion counts as one) reads its operands and writes its
  result, except where it touches only part of a buffer: an operand consumed only through
  ``dynamic-slice`` / ``slice`` / ``gather`` costs those slices, and an in-place
  ``dynamic-update-slice`` / ``scatter`` writes (and skips reading) only its update; buffer-free
  ops (parameters, tuples, bitcasts, constants) cost 0. An async pair (XLA:TPU's ``copy-start`` /
  ``slice-start`` / collective ``-start`` and their ``-done``) costs what its synchronous op would,
  charged at the ``-done``: the result written plus the operands read (a slice or a copy: the
  result twice); the ``-start``'s tuple type, which repeats its operands, is not charged.
  This is the HBM traffic of an unfused-between-kernels program, the quantity the roofline wants.
"""

from __future__ import annotations

import math
import re

from dspark_jax.kernels import flash
from dspark_jax.costs.hardware import DTYPE_BYTES

_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"\s*(ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_HEAD = re.compile(r"(?:ENTRY )?%([\w.\-]+) ")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency"}
_PARTIAL_READ = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _arrays_bytes(type_text: str) -> int:
    """Bytes of the arrays of an HLO type (a tuple's summed; a cuBLAS call's s8 workspace left out)."""
    arrays = _ARRAY.findall(type_text)
    if len(arrays) > 1 and arrays[-1][0] == "s8":
        arrays = arrays[:-1]
    return sum(DTYPE_BYTES.get(dt, 0) * math.prod(_dims(d)) for dt, d in arrays)


class Instr:
    """One HLO instruction: name, result type text, opcode, operand names, the text inside its
    parentheses (``args``: a constant's value, a parameter's number) and its attributes."""

    __slots__ = ("name", "type", "op", "operands", "args", "attrs", "root")

    def __init__(self, root, name, type_text, op, rest):
        depth, i = 1, 0
        while i < len(rest) and depth:
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            i += 1
        self.root, self.name, self.type, self.op = bool(root), name, type_text, op
        self.args = rest[: i - 1]
        self.operands = re.findall(r"%([\w.\-]+)", self.args)
        self.attrs = rest[i:]

    def callee(self, key: str) -> str | None:
        m = re.search(key + r"=%([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    @property
    def nbytes(self) -> int:
        return _arrays_bytes(self.type)


def parse(hlo_text: str) -> tuple[dict[str, list[Instr]], str, dict[str, Instr]]:
    """Computations (name -> instructions), the entry's name, and every instruction by name."""
    comps: dict[str, list[Instr]] = {}
    by_name: dict[str, Instr] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.endswith("{"):
            head = _HEAD.match(line)
            current = comps.setdefault(head.group(1), []) if head else None
            if head and line.startswith("ENTRY"):
                entry = head.group(1)
            continue
        m = _INSTR.match(line) if current is not None else None
        if m:
            ins = Instr(*m.groups())
            current.append(ins)
            by_name[ins.name] = ins
    return comps, entry, by_name


def _dims_of(by_name, name) -> list[int]:
    m = _ARRAY.search(by_name[name].type) if name in by_name else None
    return _dims(m.group(2)) if m else []


def fmha_flops(ins: Instr) -> float:
    """The matmul flops of a cuDNN fused attention call (``__cudnn$fmha*``): its two products,
    2 x 2 x B*H*Sq*Skv (the backend config's ``intermediate_tensor_shape``, the scores it keeps on
    chip) x D (the first result's last dim); half of it under a causal mask; the backward's five
    products 2.5x the forward's."""
    shape = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', ins.attrs)
    if not shape:
        return 0.0
    scores = math.prod(int(d) for d in re.findall(r"[0-9]+", shape.group(1)))
    flops = 4.0 * scores * _dims(_ARRAY.search(ins.type).group(2))[-1]
    if re.search(r'"mask_type":\s*"CAUSAL"', ins.attrs):
        flops /= 2
    target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    return flops * (2.5 if target and "Backward" in target.group(1) else 1.0)


def tpu_kernel_cost(ins: Instr) -> tuple[float, float] | None:
    """(flops, bytes) of a Pallas TPU kernel from the cost estimate in its backend config
    (``pl.CostEstimate``); None for another instruction or a kernel without one."""
    if ins.op != "custom-call" or 'custom_call_target="tpu_custom_call"' not in ins.attrs:
        return None
    est = re.search(r'"cost_estimate":\{"flops":"([0-9]+)","transcendentals":"[0-9]+","bytes_accessed":"([0-9]+)"',
                    ins.attrs)
    return (float(est.group(1)), float(est.group(2))) if est else None


def matmul_flops(ins: Instr, by_name) -> float:
    """2 x output elements x contracted size of a dot / convolution / cuBLAS gemm; a cuDNN fused
    attention's products (``fmha_flops``); a flash kernel's two matmuls (CUDA) or its cost
    estimate (``tpu_kernel_cost``); else 0."""
    if (kernel := tpu_kernel_cost(ins)) is not None:
        return kernel[0]
    if ins.op == "custom-call" and "__cudnn$fmha" in ins.attrs:
        return fmha_flops(ins)
    if ins.op == "dot" or (ins.op == "custom-call" and "__cublas$" in ins.attrs):
        contract = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}|"lhs_contracting_dimensions":\[([0-9",]*)\]',
                             ins.attrs)
        if not contract or not ins.operands:
            return 0.0
        out = _dims(_ARRAY.search(ins.type).group(2))
        lhs = _dims_of(by_name, ins.operands[0])
        idx = [int(i) for i in (contract.group(1) or contract.group(2)).replace('"', "").split(",") if i]
        return 2.0 * math.prod(out) * math.prod(lhs[i] for i in idx)
    if ins.op == "custom-call" and "__gpu$xla.gpu.triton" in ins.attrs:
        name = re.search(r'\bname = "([^"]*)"', ins.attrs)
        if name and name.group(1) == flash.KERNEL_NAME and len(ins.operands) == 4:  # q, k, v, visible
            return flash.flops(_dims_of(by_name, ins.operands[0]), _dims_of(by_name, ins.operands[3]))
        return 0.0
    if ins.op == "reduce" and ins.operands:  # a product written as multiply + reduce (matrix-vector, GPU scores)
        src = ins.operands[0]
        while src in by_name and by_name[src].op in ("convert", "bitcast", "copy"):
            src = by_name[src].operands[0]
        return 2.0 * math.prod(_dims_of(by_name, src)) if src in by_name and by_name[src].op == "multiply" else 0.0
    if ins.op == "convolution" and len(ins.operands) > 1:
        labels = re.search(r"dim_labels=(\w+)_(\w+)->", ins.attrs)
        lhs, kernel = _dims_of(by_name, ins.operands[0]), _dims_of(by_name, ins.operands[1])
        if not labels or len(labels.group(2)) != len(kernel) or len(labels.group(1)) != len(lhs):
            return 0.0
        lhs_spatial = {int(c): n for c, n in zip(labels.group(1), lhs) if c.isdigit()}
        window = re.search(r"window=\{([^}]*)\}", ins.attrs)
        field = lambda key: [int(v) for v in re.search(key + r"=([0-9x]+)", window.group(1)).group(1).split("x")] \
            if window and key + "=" in window.group(1) else None
        dilate = field("lhs_dilate")
        k = 1.0
        for dim, label in zip(kernel, labels.group(2)):
            if label == "i":
                k *= dim
            elif label.isdigit():  # a window dim: the taps that land on input, not on padding or dilation holes
                d = int(label)   # (XLA:TPU writes batched dots as dilated / padded windows)
                k *= min(dim / (dilate[d] if dilate and d < len(dilate) else 1), lhs_spatial.get(d, dim))
        k = max(k, 1.0)
        groups = re.search(r"feature_group_count=([0-9]+)", ins.attrs)
        return 2.0 * math.prod(_dims_of(by_name, ins.name)) * k / (int(groups.group(1)) if groups else 1)
    return 0.0


def trip_count(ins: Instr, comps, by_name) -> int:
    """A while loop's trip count: XLA:GPU's ``known_trip_count``, else read from the loop as XLA:TPU
    leaves it: the condition's ``counter < N`` (a tuple element, a constant), the body's
    ``counter + step`` and the counter's initial constant (0 when not a constant); else 1."""
    m = re.search(r'"known_trip_count":\{"n":"([0-9]+)"', ins.attrs)
    if m:
        return int(m.group(1))
    const = lambda name: int(by_name[name].args) if name in by_name and by_name[name].op == "constant" \
        and re.fullmatch(r"-?[0-9]+", by_name[name].args) else None
    index = lambda i: int(re.search(r"index=([0-9]+)", i.attrs).group(1)) if i and i.op == "get-tuple-element" else None
    for c in comps.get(ins.callee("condition") or "", []):
        if c.op != "compare" or "direction=LT" not in c.attrs or len(c.operands) != 2:
            continue
        k, limit = index(by_name.get(c.operands[0])), const(c.operands[1])
        if k is None or limit is None:
            continue
        step, start = 1, 0
        root = next((i for i in comps.get(ins.callee("body") or "", []) if i.root), None)
        nxt = by_name.get(root.operands[k]) if root is not None and root.op == "tuple" and k < len(root.operands) else None
        if nxt is not None and nxt.op == "add":
            step = next((const(o) for o in nxt.operands if const(o) is not None), 1) or 1
        init = by_name.get(ins.operands[0]) if ins.operands else None
        if init is not None and init.op == "tuple" and k < len(init.operands):
            start = const(init.operands[k]) or 0
        return max(-(-(limit - start) // step), 1)
    return 1


def _strip_bitcasts(name: str, by_name) -> str:
    while name in by_name and by_name[name].op == "bitcast" and by_name[name].operands:
        name = by_name[name].operands[0]
    return name


def fusion_bytes(ins: Instr, comps, by_name) -> float:
    """HBM bytes of one fusion: its result written and its operands read, except an operand read
    only through slices (counted at the slices' size) and the buffer of an in-place
    dynamic-update-slice / scatter root (not read; only the update is written)."""
    body = comps.get(ins.callee("calls") or "", [])
    params = {c.name: int(c.args) for c in body if c.op == "parameter" and c.args.isdigit()}
    root = next((c for c in body if c.root), None)
    roots = [by_name[o] for o in root.operands if o in by_name] if root is not None and root.op == "tuple" else [root]
    written, in_place = float(ins.nbytes), set()
    for r in roots:
        r = by_name.get(_strip_bitcasts(r.name, by_name)) if r is not None else None
        if r is None or r.op not in _IN_PLACE or len(r.operands) < 2:
            continue
        buf = _strip_bitcasts(r.operands[0], by_name)
        update = r.operands[1] if r.op == "dynamic-update-slice" else r.operands[-1]
        if buf in params and update in by_name:
            in_place.add(params[buf])
            written -= r.nbytes - by_name[update].nbytes
    read = 0.0
    for pname, idx in params.items():
        if idx in in_place or idx >= len(ins.operands) or ins.operands[idx] not in by_name:
            continue
        full = by_name[ins.operands[idx]].nbytes
        part = _sliced_read(pname, body, comps)
        read += full if part is None else min(full, part)
    return max(written, 0.0) + read


def _sliced_read(param: str, body: list[Instr], comps) -> float | None:
    """Bytes a fusion reads of parameter ``param`` when every use of it (through bitcasts and
    nested fusions) is a slice: the slices' sizes; None when some use reads all of it."""
    users: dict[str, list[Instr]] = {}
    for c in body:
        for o in c.operands:
            users.setdefault(o, []).append(c)
    total, stack = 0.0, [param]
    while stack:
        name = stack.pop()
        if name not in users:
            return None  # the fusion's result itself, or unused
        for u in users[name]:
            if u.op == "bitcast":
                stack.append(u.name)
            elif u.op in _PARTIAL_READ and u.operands[0] == name:
                total += u.nbytes
            elif u.op == "fusion":
                inner = comps.get(u.callee("calls") or "", [])
                inner_params = {int(c.args): c.name for c in inner if c.op == "parameter" and c.args.isdigit()}
                for idx, o in enumerate(u.operands):
                    if o != name:
                        continue
                    part = _sliced_read(inner_params.get(idx, ""), inner, comps)
                    if part is None:
                        return None
                    total += part
            else:
                return None
    return total


def _fused_flops(comp: str, comps, by_name, memo) -> float:
    if comp not in memo:
        memo[comp] = sum(matmul_flops(c, by_name) + (_fused_flops(c.callee("calls"), comps, by_name, memo)
                                                     if c.op == "fusion" and c.callee("calls") else 0.0)
                         for c in comps.get(comp, []))
    return memo[comp]


def instr_bytes(ins: Instr, comps, by_name) -> float | None:
    """HBM bytes ``step_cost`` charges one instruction that is not a loop, call or conditional
    (the module docstring's rules): a fusion's, an async pair's at its ``-done``, a Pallas TPU
    kernel's estimate, a slice's, an in-place update's, else result + operands. None for what is
    not charged (buffer-free ops, a ``-start``, the ``-done`` of an async computation)."""
    op = ins.op
    if op in _FREE or (op.endswith("-start") and not ins.callee("calls")):
        return None
    if op.endswith("-done"):
        start = by_name.get(ins.operands[0]) if ins.operands else None
        if start is None or not start.op.endswith("-start") or start.callee("calls"):
            return None  # the -done of an async computation (charged at its -start) or unknown
        if start.op in ("copy-start", "slice-start"):
            return 2.0 * ins.nbytes
        return float(ins.nbytes + sum(by_name[o].nbytes for o in start.operands if o in by_name))
    if op == "fusion":
        return fusion_bytes(ins, comps, by_name)
    if (kernel := tpu_kernel_cost(ins)) is not None:
        return kernel[1]
    if op in _PARTIAL_READ:
        return 2.0 * ins.nbytes
    if op in _IN_PLACE and len(ins.operands) > 1 and ins.operands[-1] in by_name:
        return 2.0 * by_name[ins.operands[1 if op == "dynamic-update-slice" else -1]].nbytes
    return float(ins.nbytes + sum(by_name[o].nbytes for o in ins.operands if o in by_name))


def branches_of(ins: Instr) -> list[str]:
    """A conditional's branch computations."""
    if "branch_computations" in ins.attrs:
        return re.findall(r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", ins.attrs).group(1))
    return [b for b in (ins.callee("true_computation"), ins.callee("false_computation")) if b]


def computation_cost(comp: str, comps, by_name, memo=None) -> tuple[float, float]:
    """(flops, bytes) of one run of computation ``comp``, its loops counted per trip."""
    memo = {} if memo is None else memo
    key = ("cost", comp)
    if key in memo:
        return memo[key]
    flops = nbytes = 0.0
    for ins in comps.get(comp, []):
        op = ins.op
        if op == "while":
            n = trip_count(ins, comps, by_name)
            f, b = computation_cost(ins.callee("body"), comps, by_name, memo)
            flops, nbytes = flops + n * f, nbytes + n * b
        elif op == "conditional":
            costs = [computation_cost(b, comps, by_name, memo) for b in branches_of(ins)]
            f, b = max(costs, key=lambda c: c[1], default=(0.0, 0.0))
            flops, nbytes = flops + f, nbytes + b
        elif op == "call" or (op.endswith("-start") and ins.callee("calls")):
            f, b = computation_cost(ins.callee("to_apply") or ins.callee("calls"), comps, by_name, memo)
            flops, nbytes = flops + f, nbytes + b
        elif (b := instr_bytes(ins, comps, by_name)) is not None:
            nbytes += b
            flops += _fused_flops(ins.callee("calls"), comps, by_name, memo) if op == "fusion" \
                else matmul_flops(ins, by_name)
    memo[key] = (flops, nbytes)
    return memo[key]


def step_cost(hlo_text: str) -> dict:
    """Matmul flops and HBM bytes of one run of a compiled module's entry computation, every
    loop body counted per trip (see the module docstring for what is counted)."""
    comps, entry, by_name = parse(hlo_text)
    flops, nbytes = computation_cost(entry, comps, by_name)
    return {"flops": flops, "bytes": nbytes}
