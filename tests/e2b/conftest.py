"""Fixtures of the E2B front's tests: a fake-driver cluster whose control plane serves E2B's control API
(and in-sandbox API) beside SPACE's, and the `e2b` SDK pointed at it by environment variables only."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from space.sdk import Sandbox
from tests.support import cluster as c
from tests.support.cluster import real_cluster  # noqa: F401 - the session fixture, for `sandbox`
from tests.support.e2b_cluster import E2bCluster


@pytest.fixture(scope="session")
def e2b_fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2bCluster]:
    """A fake-driver cluster of its own (the E2B ports are the control plane's arguments), one for every
    module of this directory; tests isolate themselves by project."""
    api_port, sandbox_port = c.free_port(), c.free_port()
    args = ("--e2b-api-listen", f"127.0.0.1:{api_port}", "--e2b-sandbox-listen", f"127.0.0.1:{sandbox_port}")
    root: pathlib.Path = tmp_path_factory.mktemp("e2b-fake")
    with c.start_fake_cluster(root, control_plane_args=args, object_store=True) as made:
        yield E2bCluster(made, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{sandbox_port}")


@pytest.fixture(scope="module")
def sandbox(real_cluster: c.RealCluster) -> Iterator[Sandbox]:  # noqa: F811
    """One real runsc sandbox for a module of in-sandbox API tests."""
    sb = real_cluster.sdk().sandboxes.create(template="python")
    try:
        yield sb
    finally:
        sb.delete()
