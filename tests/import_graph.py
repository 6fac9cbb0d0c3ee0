"""The import graph of ``src/flatshard`` (every ``from ... import``, inside functions too)
and its circles: strongly connected components of more than one module."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_files(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in (src / "flatshard").rglob("*.py"):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_edges(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports (a name imported from a package counts as its
    submodule when there is one, so ``from . import agree`` is an edge to ``...agree``)."""
    edges: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in files]
            edges[name].update(t for t in (subs or [target]) if t in files and t != name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while component[-1:] != [node]:
                        component.append(stack.pop())
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return out
