"""Byte consumers of a compiled XLA program, from its dump (``XLA_FLAGS="--xla_dump_to=DIR
--xla_dump_hlo_as_text"``, file ``*after_optimizations.txt``).

Each instruction outside fusion bodies (a kernel or library call) is charged its output plus
its operands: a fusion operand that the fusion body only slices (dynamic-slice, slice, gather:
one layer of a stacked cache, embedding rows) at the slices' sizes, any other operand whole. Prints the total, the instructions grouped by (op, name stem, output shape), and the
largest single ones with their operands' shapes and JAX op names. A while loop's body counts once.

    python benchmarks/results/gpu_copies/hlo_bytes.py FILE [--top N]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)")
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call"}


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in ``text`` (a shape or a tuple of them)."""
    total = 0
    for dtype, dims in ARRAY.findall(text):
        n = DTYPE_BYTES[dtype]
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n
    return total


def operand_names(rest: str) -> list[str]:
    """The %names inside the call's outer parentheses (``rest`` starts after the '(')."""
    depth, end = 0, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        if ch == ")":
            if depth == 0:
                end = i
                break
            depth -= 1
    return re.findall(r"%([\w.\-]+)", rest[:end])


SLICING = ("dynamic-slice", "slice", "gather")


def computations(text: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name."""
    comps, cur = {}, None
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            cur = comps.setdefault(head.group(1), [])
        elif cur is not None:
            cur.append(line)
    return comps


def operand_bytes(body: list[str], shapes: dict, operands: list[str]) -> int:
    """Bytes a fusion reads of its ``operands``: parameter i at the sizes of the slices the
    ``body`` takes of it when it only slices it, else whole."""
    params, users = {}, collections.defaultdict(list)
    for m in filter(None, map(INSTR.match, body)):
        name, out, op, rest = m.groups()
        if op == "parameter":
            params[int(rest.split(")")[0])] = name
        for i, o in enumerate(operand_names(rest)):
            users[o].append((op, i, out))
    total = 0
    for i, o in enumerate(operands):
        use = users.get(params.get(i), [])
        if use and all(op in SLICING and j == 0 for op, j, _ in use):
            total += sum(shape_bytes(out) for _, _, out in use)
        else:
            total += shape_bytes(shapes.get(o, ""))
    return total


def consumers(text: str) -> list[dict]:
    """One row per kernel-level instruction: bytes, name, op, output shape, operand shapes, op_name."""
    bodies = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", text))
    shapes = {m.group(1): m.group(2) for m in map(INSTR.match, text.splitlines()) if m}
    comps = computations(text)
    rows, inside = [], False
    for line in text.splitlines():
        head = re.match(r"(ENTRY )?%([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            inside = bool(head.group(1)) or head.group(2) not in bodies
            continue
        m = INSTR.match(line) if inside else None
        if not m or m.group(3) in NO_KERNEL:
            continue
        name, out, op, rest = m.groups()
        ops = operand_names(rest)
        meta = re.search(r'op_name="([^"]*)"', line)
        called = re.search(r"calls=%([\w.\-]+)", line) if op == "fusion" else None
        read = (operand_bytes(comps.get(called.group(1), []), shapes, ops) if called
                else sum(shape_bytes(shapes.get(o, "")) for o in ops))
        rows.append({"bytes": shape_bytes(out) + read,
                     "name": name, "op": op, "out": out.split("{")[0] if not out.startswith("(") else out,
                     "operands": [shapes.get(o, "?").split("{")[0] for o in ops],
                     "op_name": meta.group(1) if meta else ""})
    return sorted(rows, key=lambda r: -r["bytes"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo", help="an *after_optimizations.txt file of an XLA dump")
    ap.add_argument("--top", type=int, default=25, help="groups and single instructions to print (default 25)")
    args = ap.parse_args(argv)
    try:
        text = open(args.hlo).read()
    except OSError as e:
        print(f"{args.hlo}: cannot read ({e.strerror})", file=sys.stderr)
        return 2
    rows = consumers(text)
    print(f"total {sum(r['bytes'] for r in rows) / 1e9:.2f} GB over {len(rows)} kernels")
    groups, counts = collections.Counter(), collections.Counter()
    for r in rows:
        key = (r["op"], re.sub(r"\.\d+$", "", r["name"]), re.sub(r"\{[^}]*\}", "", r["out"])[:60])
        groups[key] += r["bytes"]
        counts[key] += 1
    for (op, stem, out), b in groups.most_common(args.top):
        print(f"{b / 1e9:8.3f} GB x{counts[op, stem, out]:<4} {op:<12} {stem:<30} {out}")
    print("largest single:")
    for r in rows[:args.top]:
        print(f"{r['bytes'] / 1e6:9.1f} MB {r['name']:<34} <- {', '.join(r['operands'][:3])} | {r['op_name'][-80:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
