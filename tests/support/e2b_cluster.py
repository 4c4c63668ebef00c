"""A fake-driver cluster whose control plane also serves the E2B front (tests/e2b's `e2b_fake`)."""

from __future__ import annotations

from dataclasses import dataclass

from tests.support import cluster as c


@dataclass
class E2bCluster:
    cluster: c.Cluster
    api_url: str
    sandbox_url: str
