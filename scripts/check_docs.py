"""Keep the documentation true to the tree (run by `make check`).

- Every ADR in docs/adr has a `Status:` line.
- Every file a document names in backticks (`node/agent/agent.py`, `tests/<topic>/test_x.py`, `setup.sh`)
  exists: as written from the repository root, as the tail of a path in the tree, or (a bare file name)
  anywhere in the tree.
- Every module a document names (`space.node.agent.server`, `space.core.errors.SpaceError`) exists: its
  longest module prefix is a module of the tree and the rest, if any, is a name defined in it.
- Every test file the source names in a docstring or comment (`tests/<topic>/test_x.py`) exists.
- Examples, tests and documents name only reserved hosts in URLs (RFC 2606/6761: example.com/net/org,
  *.example, *.test, *.invalid, *.localhost, loopback and private addresses), never a real service.
"""

from __future__ import annotations

import ast
import ipaddress
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FILE_REF = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|md|sh|toml))`")
MODULE_REF = re.compile(r"\bspace(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
URL_HOST = re.compile(r"\b(?:https?|wss?)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])")
RESERVED_SUFFIXES = (".example", ".test", ".invalid", ".localhost")
NUMERIC_HOST = re.compile(r"[0-9a-fx.]+")
RESERVED_NAMES = {"example.com", "example.net", "example.org", "localhost"}
#: Names shaped like modules that are files SPACE writes (`space.log` is the supervisor's log).
FILE_LIKE_REFS = {"space.log"}
HOST_SCANNED = ("examples", "tests", "docs", "bench")


def tree_files() -> list[pathlib.Path]:
    skip = {".git", ".venv", "__pycache__", "node_modules", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
    return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def module_names() -> dict[str, pathlib.Path]:
    found: dict[str, pathlib.Path] = {}
    for path in (ROOT / "src").rglob("*.py"):
        parts = list(path.relative_to(ROOT / "src").with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def defined_names(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            names.update(t.attr for t in targets if isinstance(t, ast.Attribute))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def module_problem(ref: str, modules: dict[str, pathlib.Path]) -> str | None:
    parts = ref.split(".")
    for cut in range(len(parts), 1, -1):
        module = ".".join(parts[:cut])
        if module in modules:
            rest = parts[cut:]
            if not rest or rest[0] in defined_names(modules[module]):
                return None
            return f"`{ref}`: {module} defines no {rest[0]}"
    return f"`{ref}`: no such module"


def host_is_reserved(host: str) -> bool:
    host = host.strip("[]").rstrip(".").lower()
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if NUMERIC_HOST.fullmatch(host):
            return True  # an address in another notation (0x7f.1, 0177.0.0.1): attack inputs, not services
        return (
            "." not in host
            or host.endswith(RESERVED_SUFFIXES)
            or any(host == name or host.endswith(f".{name}") for name in RESERVED_NAMES)
        )
    return address.is_private or address.is_loopback or address.is_unspecified or address.is_link_local


def adr_problems() -> list[str]:
    return [
        f"{adr.relative_to(ROOT)}: no `Status:` line"
        for adr in sorted((ROOT / "docs" / "adr").glob("*.md"))
        if not re.search(r"^Status: ", adr.read_text(), re.MULTILINE)
    ]


def reference_problems(files: list[pathlib.Path]) -> list[str]:
    problems: list[str] = []
    names = {p.name for p in files}
    rels = {str(p.relative_to(ROOT)) for p in files}
    modules = module_names()
    for doc in DOCS:
        text = doc.read_text()
        where = doc.relative_to(ROOT)
        for ref in sorted(set(FILE_REF.findall(text))):
            known = (
                ref in rels
                or ("/" not in ref and ref in names)
                or any(rel == ref or rel.endswith(f"/{ref}") for rel in rels)
            )
            if not known:
                problems.append(f"{where}: names `{ref}`, which does not exist")
        for ref in sorted(set(MODULE_REF.findall(text)) - FILE_LIKE_REFS):
            if (problem := module_problem(ref, modules)) is not None:
                problems.append(f"{where}: {problem}")
    return problems


TEST_PATH = re.compile(r"\btests/[a-z_]+/(?:[a-z_]+/)*test_[a-z0-9_]+\.py")


def source_test_path_problems(files: list[pathlib.Path]) -> list[str]:
    """Docstrings and comments that name a test file (`tests/<topic>/test_x.py`) name one that exists."""
    rels = {str(p.relative_to(ROOT)) for p in files}
    return [
        f"{path.relative_to(ROOT)}: names {ref}, which does not exist"
        for path in files
        if path.suffix == ".py" and path.relative_to(ROOT).parts[0] in {"src", "scripts", "bench"}
        for ref in sorted(set(TEST_PATH.findall(path.read_text())))
        if ref not in rels
    ]


def host_problems(files: list[pathlib.Path]) -> list[str]:
    problems: list[str] = []
    for path in files:
        rel = path.relative_to(ROOT)
        scanned = rel.parts[0] in HOST_SCANNED or path.name == "README.md"
        if not scanned or path.suffix not in {".py", ".md", ".sh", ".toml", ".txt"}:
            continue
        for host in sorted(set(URL_HOST.findall(path.read_text(errors="replace")))):
            if not host_is_reserved(host):
                problems.append(f"{rel}: names the host {host}; use a reserved example domain")
    return problems


def main() -> int:
    files = tree_files()
    problems = [
        *adr_problems(),
        *reference_problems(files),
        *source_test_path_problems(files),
        *host_problems(files),
    ]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
