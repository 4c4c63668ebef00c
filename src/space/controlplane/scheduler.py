"""Node choice for a new sandbox: free capacity first, template locality as the tie-breaker.

Invariant: only nodes in status `ready` whose free capacity fits the sandbox's limits are candidates; no
candidate is a ResourceExhausted error, which the reconciler retries with back-off (a node may come back).
"""

from __future__ import annotations

from space.controlplane.store.records import NodeRecord, SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors


def free_capacity(node: NodeRecord) -> tuple[float, float, float]:
    capacity, used = node.capacity or {}, node.used or {}
    return (
        float(capacity.get("memory_mb", 0)) - float(used.get("memory_mb", 0)),
        float(capacity.get("sandboxes", 0)) - float(used.get("sandboxes", 0)),
        float(capacity.get("cpus", 0)) * 4 - float(used.get("cpus", 0)),  # CPUs are overcommitted 4x
    )


def score(node: NodeRecord, sandbox: SandboxRecord) -> tuple[int, float] | None:
    memory_free, slots_free, cpu_free = free_capacity(node)
    if memory_free < sandbox.limits.memory_mb or slots_free < 1 or cpu_free < sandbox.limits.cpus:
        return None
    has_template = 1 if sandbox.template in (node.templates or []) else 0
    return has_template, memory_free


def choose_node(store: Store, sandbox: SandboxRecord) -> str:
    candidates = []
    for node in store.list_nodes("ready"):
        value = score(node, sandbox)
        if value is not None:
            candidates.append((value, node.id))
    if not candidates:
        raise errors.ResourceExhausted(f"no ready node has room for sandbox {sandbox.id}")
    candidates.sort(reverse=True)
    return candidates[0][1]
