"""The package's imports go one way: no module of dspark_jax imports, directly or through others, a
module that imports it back.

The graph is read from the source with `ast` (no jax import, well under a second): every `import`
and `from ... import ...`, at module level or inside a function, absolute or relative. `from a
import b` where `a/b.py` exists is an edge to `a.b` (the submodule), otherwise to `a`. A strongly
connected component of more than one module is a cycle; the test prints each.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dspark_jax"


def module_names(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every .py under `root` (a package: `x/__init__.py` is `x`)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from` import names (relative levels resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `source` (module `module`) imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` runs a, a.b and a.b.c; the deepest known one is the dependency
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: modules it imports} for every module under the package `root`."""
    names = module_names(root)
    known = set(names)
    return {
        name: imports_of(path.read_text(), name, path.name == "__init__.py", known)
        for name, path in names.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_cycle_finder_on_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_are_read_at_every_level(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from ..top import g\n    return g\n")
    (pkg / "top.py").write_text("import pkg.sub.leaf\n\ndef g():\n    from pkg import other\n")
    (pkg / "other.py").write_text("from .sub import leaf\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub"] == {"pkg.sub.leaf"}
    assert graph["pkg.sub.leaf"] == {"pkg.top"}  # function-level, relative
    assert graph["pkg.top"] == {"pkg.sub.leaf", "pkg.other"}  # submodule via `from pkg import other`
    assert graph["pkg.other"] == {"pkg.sub.leaf"}
    assert cycles(graph) == [["pkg.other", "pkg.sub.leaf", "pkg.top"]]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "dspark_jax.nn" in graph
    found = cycles(graph)
    assert not found, "import cycles in dspark_jax:\n" + "\n".join(" <-> ".join(c) for c in found)
