"""A fake-driver cluster whose control plane also serves the E2B front (tests/e2b's `e2b_fake`), and an E2B
SDK sandbox on a real cluster's front (`e2b_sandbox`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from e2b import Sandbox

from tests.support import cluster as c


@dataclass
class E2bCluster:
    cluster: c.Cluster
    api_url: str
    sandbox_url: str


@contextlib.contextmanager
def e2b_sandbox(real: c.RealCluster) -> Iterator[Sandbox]:
    """A sandbox of E2B's default template, made by the `e2b` SDK through `real`'s E2B front; killed after."""
    made = Sandbox.create(
        api_key=real.api_key,
        api_url=real.e2b_api_url,
        sandbox_url=real.e2b_sandbox_url,
        domain="space.invalid",
    )
    try:
        yield made
    finally:
        made.kill()
