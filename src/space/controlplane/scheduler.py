"""Node choice for a new sandbox: free capacity first, template locality as the tie-breaker.

Invariants:
- Only nodes in status `ready` whose free capacity fits the sandbox's limits (and, for a restore or a
  recovery, whose runtime can restore its checkpoint: space.controlplane.restore_targets) are candidates;
  no candidate is a ResourceExhausted error, which the reconciler retries with back-off (a node may come
  back).
- A candidate is also FRESH (docs/adr/0032-lost-nodes-and-incarnations.md): its last heartbeat is younger
  than `freshness_bound` (3 heartbeat intervals, or node_lost_after_s when that is shorter), so a node
  that died and is not yet marked lost is not chosen; `lost`, `offline` and `draining` nodes never are.
- Disk admission (docs/adr/0027-disk-budgets.md): on a node that reports its disk, the `disk_mb` of every
  sandbox placed on it (from the store, so two placements between heartbeats cannot both take the last
  room) plus the new one's, plus the node's reserve, fit in its disk; a node already below its reserve
  takes no new sandbox. Nodes that report no disk (older agents) are not judged on disk.
- `check_admissible` refuses at once (StorageExhausted, 507) a `disk_mb` larger than any ready node can
  ever hold, instead of letting the create wait for a node that will never have room.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Final

from space.controlplane import restore_targets
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.records import NodeRecord, SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors
from space.core.lifecycle import State
from space.core.settings import SandboxLimits
from space.node.agent.settings import NodeAgentSettings

#: Heartbeats a ready node may miss before the scheduler stops choosing it (it is marked lost later).
MISSED_HEARTBEATS: Final = 3
_DEFAULT_HEARTBEAT_S: Final[float] = NodeAgentSettings.model_fields["heartbeat_interval_s"].default
_DEFAULT_LOST_AFTER_S: Final[float] = ControlPlaneSettings.model_fields["node_lost_after_s"].default


def freshness_bound(
    node_lost_after_s: float = _DEFAULT_LOST_AFTER_S, heartbeat_interval_s: float = _DEFAULT_HEARTBEAT_S
) -> float:
    """How young a node's last heartbeat must be for the scheduler to choose it: MISSED_HEARTBEATS
    intervals, or node_lost_after_s when that is shorter (a node is never fresh after it is lost)."""
    return min(node_lost_after_s, MISSED_HEARTBEATS * heartbeat_interval_s)


#: The bound with the default settings (2 s heartbeats, lost after 15 s): 6 s.
DEFAULT_FRESH_S: Final = freshness_bound()


def free_capacity(node: NodeRecord) -> tuple[float, float, float]:
    capacity, used = node.capacity or {}, node.used or {}
    return (
        float(capacity.get("memory_mb", 0)) - float(used.get("memory_mb", 0)),
        float(capacity.get("sandboxes", 0)) - float(used.get("sandboxes", 0)),
        float(capacity.get("cpus", 0)) * 4 - float(used.get("cpus", 0)),  # CPUs are overcommitted 4x
    )


def disk_room_mb(node: NodeRecord) -> int | None:
    """The most `disk_mb` the node can hand out in total (its disk less its reserve); None: not reported."""
    capacity = node.capacity or {}
    disk_mb = capacity.get("disk_mb")
    if not isinstance(disk_mb, int):
        return None
    reserve = capacity.get("disk_reserve_mb")
    return max(0, disk_mb - (reserve if isinstance(reserve, int) else 0))


def below_reserve(node: NodeRecord) -> bool:
    capacity = node.capacity or {}
    free, reserve = capacity.get("disk_free_mb"), capacity.get("disk_reserve_mb")
    return isinstance(free, int) and isinstance(reserve, int) and free < reserve


def score(node: NodeRecord, sandbox: SandboxRecord, placed_disk_mb: int = 0) -> tuple[int, float] | None:
    """None when the node cannot take the sandbox; else (holds its template, free memory), larger better.
    `placed_disk_mb`: the disk_mb of the sandboxes already placed on the node (without this one)."""
    memory_free, slots_free, cpu_free = free_capacity(node)
    if memory_free < sandbox.limits.memory_mb or slots_free < 1 or cpu_free < sandbox.limits.cpus:
        return None
    room = disk_room_mb(node)
    if room is not None and (placed_disk_mb + sandbox.limits.disk_mb > room or below_reserve(node)):
        return None
    has_template = 1 if sandbox.template in (node.templates or []) else 0
    return has_template, memory_free


def placed_disk_mb(store: Store, node_id: str, *, besides: str | None = None) -> int:
    """The disk_mb the store has placed on a node (every sandbox recorded there, whatever its state: a
    stopped or paused sandbox keeps its disk), leaving out `besides`."""
    return sum(
        sb.limits.disk_mb
        for sb in store.list_sandboxes_on_node(node_id)
        if sb.id != besides and sb.state != State.DELETED
    )


def schedulable_nodes(store: Store, fresh_within_s: float | None) -> list[NodeRecord]:
    """Ready nodes whose last heartbeat is younger than `fresh_within_s` (None: every ready node)."""
    nodes = store.list_nodes("ready")
    if fresh_within_s is None:
        return nodes
    cutoff = store.now() - timedelta(seconds=fresh_within_s)
    return [node for node in nodes if node.last_heartbeat_at >= cutoff]


def choose_node(store: Store, sandbox: SandboxRecord, *, fresh_within_s: float | None = None) -> str:
    candidates = []
    ready = schedulable_nodes(store, fresh_within_s)
    # A restore or recovery goes only to nodes whose runtime can restore its checkpoint (ADR 0035).
    for node in restore_targets.able_nodes(store, sandbox, ready):
        placed = placed_disk_mb(store, node.id, besides=sandbox.id) if disk_room_mb(node) is not None else 0
        value = score(node, sandbox, placed)
        if value is not None:
            candidates.append((value, node.id))
    if not candidates:
        raise errors.ResourceExhausted(
            f"no ready node with a fresh heartbeat has room for sandbox {sandbox.id}"
        )
    candidates.sort(reverse=True)
    return candidates[0][1]


def check_admissible(store: Store, limits: SandboxLimits) -> None:
    """StorageExhausted when no ready node that reports its disk could ever hold `limits.disk_mb` (even
    empty). Silent when no node reports a disk: nothing is known yet, the create waits for a node."""
    rooms = [room for node in store.list_nodes("ready") if (room := disk_room_mb(node)) is not None]
    if rooms and limits.disk_mb > max(rooms):
        raise errors.StorageExhausted(
            f"disk_mb {limits.disk_mb} is more than any node can hold: the largest takes {max(rooms)} MB "
            "(its disk less its free-space reserve); ask for less disk",
            reason="no_node_disk", field="limits.disk_mb", disk_mb=limits.disk_mb,
            largest_node_disk_mb=max(rooms),
        )  # fmt: skip
