"""Enforce the shape of the source tree (run by `make check`).

- Module size: every module under src/space has at most MAX_LINES lines, except the few listed in
  SIZE_EXCEPTIONS with the reason they stay whole.
- No import cycles: the graph of imports between space modules has no strongly connected component larger
  than one module. Every import counts: module level, inside functions, and under `if TYPE_CHECKING:` (a
  cycle hidden there still means shared types live in the wrong module). A package's `__init__` counts as
  its own module, so `from space.x import name` depends on space.x.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
MAX_LINES = 500
#: Modules allowed past MAX_LINES, each with its reason. Keep this short; prefer splitting by concern.
SIZE_EXCEPTIONS: dict[str, str] = {}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The space modules `path` imports anywhere in its text (resolving relative imports)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {target for target in found if target in modules and target != name}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is small, but recursion limits are not worth the risk)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                components.append(sorted(component))
    return components


def main() -> int:
    paths = sorted((SRC / "space").rglob("*.py"))
    modules = {module_name(path) for path in paths}
    problems: list[str] = []
    for path in paths:
        lines = len(path.read_text().splitlines())
        rel = str(path.relative_to(SRC.parent))
        if lines > MAX_LINES and rel not in SIZE_EXCEPTIONS:
            problems.append(f"{rel}: {lines} lines (budget {MAX_LINES}); split it by concern")
    graph = {module_name(path): imports_of(path, modules) for path in paths}
    for component in strongly_connected(graph):
        if len(component) > 1:
            problems.append("import cycle: " + " <-> ".join(component))
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
