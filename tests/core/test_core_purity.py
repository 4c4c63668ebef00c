"""space.core does no I/O: its modules import nothing that reaches files, sockets, processes or clocks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import space.core

CORE_DIR = Path(space.core.__file__).parent
FORBIDDEN = {
    "asyncio", "datetime", "glob", "http", "io", "os", "random", "shutil", "socket", "sqlalchemy",
    "subprocess", "sys", "tempfile", "time", "urllib",
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(CORE_DIR.glob("*.py")), ids=lambda p: p.name)
def test_core_modules_import_no_io_modules(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN, imported & FORBIDDEN


def test_core_package_has_the_expected_modules() -> None:
    # Guards the test above against silently scanning nothing.
    assert {p.stem for p in CORE_DIR.glob("*.py")} >= {"__init__", "errors", "ids", "lifecycle", "settings"}
