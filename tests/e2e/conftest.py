"""Fixtures of the whole-system tests. `cli`: `space up` in a private data directory under /var/tmp with a
private HOME; its finalizer runs `space down --purge` and fails the test if anything is left on the host
(mounts, loop devices, processes, cgroups, network traces) or in the data directory."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.support.cluster import host_leftovers, sandbox_ids_in
from tests.support.space_up import Cli


@pytest.fixture
def cli(tmp_path: pathlib.Path) -> Iterator[Cli]:
    if os.geteuid() != 0:
        pytest.fail("`space up` starts the node's root helper: run the tests as root")
    home = tmp_path / "home"
    home.mkdir()
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-up-", dir="/var/tmp"))
    made = Cli(home, data_dir)
    try:
        yield made
    finally:
        seen = sandbox_ids_in(data_dir)
        down = made.run("down", "--data-dir", str(data_dir), "--purge", timeout=600, check=False)
        logs = made.logs()
        left = host_leftovers(data_dir, seen)
        remains = (
            sorted(str(p.relative_to(data_dir)) for p in data_dir.rglob("*")) if data_dir.exists() else []
        )
        if not left["mounts"]:  # never recurse into a mount left behind: leave it for a post-mortem
            shutil.rmtree(data_dir, ignore_errors=True)
        assert down.returncode == 0, down.stderr.decode(errors="replace") + logs
        assert {k: v for k, v in left.items() if v} == {}, f"left behind by `space down --purge`: {left}"
        assert remains == [], f"files left in the data directory after --purge: {remains[:20]}"
