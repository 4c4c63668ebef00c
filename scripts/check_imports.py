"""Enforce the layer rules of DESIGN.md on the source tree (run by `make check`).

- space.protocol imports only the standard library and itself.
- space.guest imports only the standard library and space.protocol / space.guest.
- space.core does no I/O: no subprocess, socket, os-level process or file modules, no upper layers.
- No layer imports a layer above it (see ALLOWED_SPACE_DEPS).
- space.node.agent (the unprivileged agent) never imports space.node.helper or space.node.volumes: every
  privileged step goes through the helper's socket.
"""

from __future__ import annotations

import ast
import pathlib
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "space"
STDLIB = set(sys.stdlib_module_names)
CORE_FORBIDDEN = {"subprocess", "socket", "shutil", "selectors", "asyncio", "urllib", "http", "sqlite3"}
ALLOWED_SPACE_DEPS = {
    "protocol": {"protocol"},
    "faults": {"faults"},  # fault injection (kill points): standard library only, like protocol
    "guest": {"protocol", "guest"},
    "core": {"core"},
    "rest": {"core", "rest"},
    "node": {"faults", "core", "protocol", "node", "objectstore", "crypto", "rest"},
    "objectstore": {"faults", "core", "objectstore", "crypto"},
    "crypto": {"core", "crypto"},
    # mcp: the /mcp endpoint serves the MCP tools (over an SDK client of the caller's key, in process)
    "controlplane": {
        "faults",
        "core",
        "protocol",
        "controlplane",
        "objectstore",
        "crypto",
        "node",
        "rest",
        "mcp",
    },
    "sdk": {"core", "protocol", "sdk"},  # protocol: the standard-library wire descriptions (commands)
    "mcp": {"core", "sdk", "mcp"},  # the MCP tools, over the SDK only (ADR 0049)
    "cli": {"core", "sdk", "cli", "controlplane", "node", "mcp"},
}


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def main() -> int:
    problems: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        layer = rel.parts[0] if len(rel.parts) > 1 else None
        if layer is None:
            continue
        for lineno, module in imported_modules(path):
            top = module.split(".")[0]
            where = f"src/space/{rel}:{lineno}"
            if top == "space":
                if rel.parts[:2] == ("node", "agent") and module.startswith(
                    ("space.node.helper", "space.node.volumes")
                ):
                    problems.append(f"{where}: the unprivileged agent may not import {module}")
                parts = module.split(".")
                target = parts[1] if len(parts) > 1 else ""
                allowed = ALLOWED_SPACE_DEPS.get(layer, set())
                if target and target not in allowed:
                    problems.append(f"{where}: layer '{layer}' may not import space.{target}")
                continue
            if layer in {"protocol", "guest", "faults"} and top not in STDLIB and top != "__future__":
                problems.append(f"{where}: '{layer}' must use the standard library only, not {module}")
            if layer == "core" and top in CORE_FORBIDDEN:
                problems.append(f"{where}: space.core does no I/O, but imports {module}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
