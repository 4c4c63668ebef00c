"""The shape of the test suite itself: test modules are grouped by topic (tests/<topic>/test_*.py) with
unique basenames, and no module under tests/ imports a test module or a conftest. What tests share lives
in tests/support (helpers, fakes, fixtures registered by a conftest) or in a topic's conftest.py, so a
test module can be moved, renamed or run alone without breaking another."""

from __future__ import annotations

import ast
import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def python_files() -> list[pathlib.Path]:
    return sorted(TESTS.rglob("*.py"))


def is_test_module_name(dotted: str) -> bool:
    """`tests.x.test_y`, `test_y`, `tests.conftest`, `conftest`: what no module may import."""
    last = dotted.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imported_test_modules(path: pathlib.Path) -> list[str]:
    found = []
    for statement in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(statement, ast.Import):
            found += [alias.name for alias in statement.names if is_test_module_name(alias.name)]
        elif isinstance(statement, ast.ImportFrom):
            base = "." * statement.level + (statement.module or "")
            if statement.module and is_test_module_name(statement.module):
                found.append(base)
            # `from tests.x import test_y` imports the module test_y
            found += [f"{base}.{alias.name}" for alias in statement.names if alias.name.startswith("test_")]
    return found


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    offenders = {
        str(path.relative_to(TESTS.parent)): names
        for path in python_files()
        if (names := imported_test_modules(path))
    }
    assert offenders == {}, "move what they share to tests/support or a conftest.py"


def test_test_modules_live_in_a_topic_directory_with_unique_names() -> None:
    modules = [p for p in python_files() if p.name.startswith("test_")]
    outside = [str(p.relative_to(TESTS)) for p in modules if len(p.relative_to(TESTS).parts) != 2]
    assert outside == [], "a test module belongs in tests/<topic>/"
    assert "support" not in {p.parent.name for p in modules}, "tests/support holds helpers, not tests"
    names = collections.Counter(p.name for p in modules)
    assert [name for name, count in names.items() if count > 1] == []


def test_the_check_sees_each_form_of_import(tmp_path: pathlib.Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import tests.node.test_node_rpc\n"
        "from tests.node.test_node_rpc import TOKEN\n"
        "from tests.sdk import test_cli\n"
        "from tests.conftest import RealNode\n"
        "from .test_store import x\n"
        "from tests.support.node_rpc import TOKEN\n"
        "import pytest\n"
    )
    assert imported_test_modules(sample) == [
        "tests.node.test_node_rpc",
        "tests.node.test_node_rpc",
        "tests.sdk.test_cli",
        "tests.conftest",
        ".test_store",
    ]
