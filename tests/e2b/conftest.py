"""Fixtures of the E2B front's tests: a fake-driver cluster whose control plane serves E2B's control API
(and in-sandbox API) beside SPACE's, and the `e2b` SDK pointed at it by environment variables only."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support import cluster as c


@dataclass
class E2bCluster:
    cluster: c.Cluster
    api_url: str
    sandbox_url: str


@pytest.fixture(scope="session")
def e2b_fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2bCluster]:
    """A fake-driver cluster of its own (the E2B ports are the control plane's arguments), one for every
    module of this directory; tests isolate themselves by project."""
    api_port, sandbox_port = c.free_port(), c.free_port()
    args = ("--e2b-api-listen", f"127.0.0.1:{api_port}", "--e2b-sandbox-listen", f"127.0.0.1:{sandbox_port}")
    root: pathlib.Path = tmp_path_factory.mktemp("e2b-fake")
    with c.start_fake_cluster(root, control_plane_args=args, object_store=True) as made:
        yield E2bCluster(made, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{sandbox_port}")
