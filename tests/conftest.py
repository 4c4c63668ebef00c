"""Shared fixtures. `node` is one real node (root helper + runsc + btrfs image) for the whole session;
its finalizer destroys everything and then checks the host for leaks (mounts, loop devices, processes,
cgroups), so a leak fails the run instead of breaking the next one.

Every test that uses a fixture needing root (ROOT_FIXTURES) must carry the `root` mark; collection fails
otherwise, so `pytest -m "not root"` (make test-unit) selects only tests that run without root.

A test that runs a SPACE entry point in-process (which sets the owner-only umask, ADR 0022) must not
change the files later tests create: the process umask is restored after every test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from space.node.local import LocalNode
from tests.support.loop import BackgroundLoop
from tests.support.realnode import RealNode, assert_no_leaks, make_data_dir, require_root, sandbox_ids_in
from tests.support.s3server import s3_server  # noqa: F401 - session fixture: S3+KMS server on loopback

# (module, name) of the fixtures that start a node's root helper, runsc or btrfs.
ROOT_FIXTURES = {
    ("tests.conftest", "node"),
    ("tests.support.cluster", "real_cluster"),
    ("tests.support.realcluster", "two_nodes"),
    ("tests.e2e.conftest", "cli"),
}


def root_fixtures_of(item: pytest.Item) -> list[str]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [
        name
        for name, defs in info.name2fixturedefs.items()
        if defs and (defs[-1].func.__module__, defs[-1].func.__name__) in ROOT_FIXTURES
    ]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = {
        item.nodeid: used
        for item in items
        if item.get_closest_marker("root") is None and (used := root_fixtures_of(item))
    }
    if unmarked:
        listing = "\n".join(f"  {nodeid} (uses {', '.join(used)})" for nodeid, used in unmarked.items())
        raise pytest.UsageError(f"tests that need root lack the `root` mark:\n{listing}")


@pytest.fixture(autouse=True)
def _process_umask_restored() -> Iterator[None]:
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


@pytest.fixture(scope="session")
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop()
    yield background
    background.close()


@pytest.fixture(scope="session")
def node(loop: BackgroundLoop) -> Iterator[RealNode]:
    require_root()
    data_dir = make_data_dir("node")
    # SPACE_TEST_NETWORK=sandbox|none overrides NodeSettings.network for the session's node.
    local = LocalNode(data_dir, network=os.environ.get("SPACE_TEST_NETWORK") or None)
    agent = loop.run(local.start(progress=lambda line: None), timeout=1800)
    real = RealNode(local, agent, loop)
    try:
        yield real
    finally:
        sandbox_ids = sandbox_ids_in(data_dir) | set(agent.sandboxes)
        loop.run(agent.delete_all(), timeout=300)
        loop.run(local.stop(purge=True), timeout=300)
        assert_no_leaks(data_dir, sandbox_ids)
