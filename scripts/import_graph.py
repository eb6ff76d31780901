"""The import graph of the meshfold package, read from the source (no imports run).

    python scripts/import_graph.py        # cycles and function-local meshfold imports
    python scripts/import_graph.py -v     # ... and every function-local import

Top-level imports (including those under ``try``/``if`` at module level) are edges; imports
inside ``if TYPE_CHECKING:`` are annotations only and are left out; imports inside a
function or method are "local". ``tests/test_architecture.py`` uses ``graph()`` to fail on any
cycle and on any local meshfold import that is not in its allow-list.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "meshfold").rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _targets(mods: dict[str, Path], current: str, node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = current.split(".")
            is_pkg = mods[current].name == "__init__.py"
            base = base[: len(base) - node.level + (1 if is_pkg else 0)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        out = []
        for alias in node.names:
            if f"{module}.{alias.name}" in mods:
                out.append(f"{module}.{alias.name}")
            elif module in mods:
                out.append(module)
        return out
    return [alias.name for alias in node.names if alias.name in mods]


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[tuple[str, int]]]]:
    """(top-level edges, local imports as (target, line)) between meshfold modules."""
    mods = modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    local: dict[str, set[tuple[str, int]]] = defaultdict(set)

    def walk(name: str, node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:  # the else branch runs
                    walk(name, sub, in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(mods, name, child):
                    if target != name:
                        if in_function:
                            local[name].add((target, child.lineno))
                        else:
                            edges[name].add(target)
            walk(name, child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    for name, path in mods.items():
        walk(name, ast.parse(path.read_text()), False)
        edges.setdefault(name, set())
    return dict(edges), dict(local)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    edges, local = graph()
    both = {m: edges[m] | {t for t, _ in local.get(m, ())} for m in edges}
    for component in cycles(edges):
        print(f"cycle of {len(component)} (top-level imports): {component}")
    for component in cycles(both):
        print(f"cycle of {len(component)} (counting function-local imports): {component}")
    print("function-local meshfold imports:", sum(len(v) for v in local.values()))
    if "-v" in sys.argv:
        for name in sorted(local):
            for target, line in sorted(local[name], key=lambda x: x[1]):
                print(f"  {name}:{line} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
