"""Cluster nodes in the SDK, without I/O: the Node record an organisation admin key sees
(docs/api.md#nodes, ADR 0065)."""

from __future__ import annotations

from space.sdk.models import Record

__all__ = ["Node"]


class Node(Record):
    """A cluster node: `.status` (ready, lost, offline), `.admin` (active, cordoned, draining, drained),
    `.sandboxes` (recorded on it), `.moving` (a drain is still moving), capacity, used, pools, version."""

    @property
    def admin(self) -> str:
        return str(self.data.get("admin", "active"))
