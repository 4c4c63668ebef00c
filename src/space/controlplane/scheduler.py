"""Node choice for a new sandbox: a node with a pooled sandbox of its template first, then one that holds the
template, then the rest; free memory breaks ties within a tier.

Invariants:
- Only nodes in status `ready` whose free capacity fits the sandbox's limits (and, for a restore or a
  recovery, whose runtime can restore its checkpoint: space.controlplane.restore_targets) are candidates;
  no candidate is a ResourceExhausted error, which the reconciler retries with back-off (a node may come
  back).
- A candidate is also FRESH (docs/adr/0032-lost-nodes-and-incarnations.md): its last heartbeat is younger
  than `freshness_bound` (3 heartbeat intervals, or node_lost_after_s when that is shorter), so a node
  that died and is not yet marked lost is not chosen; `lost`, `offline` and `draining` nodes never are,
  nor is a node an operator cordoned, drains or drained (space.core.node_states, ADR 0065).
- Disk admission (docs/adr/0027-disk-budgets.md): on a node that reports its disk, the `disk_mb` of every
  sandbox placed on it (from the store, so two placements between heartbeats cannot both take the last
  room) plus the new one's, plus the node's reserve, fit in its disk; a node already below its reserve
  takes no new sandbox. Nodes that report no disk (older agents) are not judged on disk.
- Warm pools (issue 12, docs/adr/0046-direct-create-path.md): a create (`pools` given) prefers a node whose
  believed count of ready pooled sandboxes of its template is > 0. The belief is the count of the node's
  last heartbeat (`nodes.pools`) less the creates this process placed there since that heartbeat
  (`PoolLedger.take`, under one lock with the choice), so concurrent creates spread over the pools instead
  of all going to a node whose last heartbeat said 1. The belief orders candidates; it never admits.
- Pooled sandboxes are not in a node's reported `used` (docs/adr/0047-warm-pools.md): they hold room only
  while no placement needs it (the node refills only within its capacity and destroys pooled sandboxes
  when its sandboxes need the room), so every placement, pooled or not, is judged on the same room.
- `check_admissible` refuses at once (StorageExhausted, 507) a `disk_mb` larger than any ready node can
  ever hold, instead of letting the create wait for a node that will never have room.
- Isolation (docs/adr/0076-isolation-per-sandbox.md): a sandbox is placed only on nodes whose reported
  driver provides its isolation (space.core.isolation: runsc and fake -> gvisor, qemu -> microvm), for
  every placement (create, restore, recovery), before any other judgement. Ready nodes of which none
  provides it: placement is ResourceExhausted (retried: such a node may join), and `check_admissible`
  refuses the create at once (Unavailable, 503, naming the isolation) instead of letting it wait.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final

from space.controlplane import restore_targets
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.records import NodeRecord, SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors, isolation, node_states
from space.core.settings import CPU_OVERCOMMIT, SandboxLimits
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
        float(capacity.get("cpus", 0)) * CPU_OVERCOMMIT - float(used.get("cpus", 0)),
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


#: Tiers of a candidate node for a sandbox, best last: nothing of it, its template, a pooled sandbox of it.
TIER_NONE, TIER_TEMPLATE, TIER_POOL = 0, 1, 2


def score(
    node: NodeRecord, sandbox: SandboxRecord, placed_disk_mb: int = 0, *, pooled: int = 0
) -> tuple[int, float] | None:
    """None when the node cannot take the sandbox; else (tier, free memory), larger better.
    `placed_disk_mb`: the disk_mb of the sandboxes already placed on the node (without this one);
    `pooled`: how many ready pooled sandboxes of its template the node is believed to have."""
    memory_free, slots_free, cpu_free = free_capacity(node)
    fits = memory_free >= sandbox.limits.memory_mb and slots_free >= 1 and cpu_free >= sandbox.limits.cpus
    if not fits:
        return None
    room = disk_room_mb(node)
    if room is not None and (placed_disk_mb + sandbox.limits.disk_mb > room or below_reserve(node)):
        return None
    if pooled > 0:
        return TIER_POOL, memory_free
    return (TIER_TEMPLATE if sandbox.template in (node.templates or []) else TIER_NONE), memory_free


@dataclass
class PoolLedger:
    """This process's belief of each node's pool: the last heartbeat's counts less the creates placed there
    since (see the module invariants). Thread-safe: `choose_node` runs in worker threads."""

    #: node id -> (the heartbeat the placements are counted against, template -> creates placed since).
    taken: dict[str, tuple[datetime, dict[str, int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def believed(self, node: NodeRecord, template: str) -> int:
        reported = (node.pools or {}).get(template, 0)
        since = self.taken.get(node.id)
        if since is None or since[0] != node.last_heartbeat_at:
            return max(0, reported)  # a newer heartbeat already counts what was placed before it
        return max(0, reported - since[1].get(template, 0))

    def take(self, node: NodeRecord, template: str) -> None:
        """A create of `template` was placed on `node`: one fewer pooled sandbox there until it reports."""
        since = self.taken.get(node.id)
        if since is None or since[0] != node.last_heartbeat_at:
            since = (node.last_heartbeat_at, {})
            self.taken[node.id] = since
        since[1][template] = since[1].get(template, 0) + 1


def placeable(nodes: list[NodeRecord]) -> list[NodeRecord]:
    """The nodes no operator holds out of placement (cordoned, draining, drained)."""
    return [node for node in nodes if node_states.of_labels(node.labels) in node_states.PLACEABLE]


def schedulable_nodes(store: Store, fresh_within_s: float | None) -> list[NodeRecord]:
    """Ready, uncordoned nodes whose last heartbeat is younger than `fresh_within_s` (None: any age)."""
    nodes = placeable(store.list_nodes("ready"))
    if fresh_within_s is None:
        return nodes
    cutoff = store.now() - timedelta(seconds=fresh_within_s)
    return [node for node in nodes if node.last_heartbeat_at >= cutoff]


def choose_node(
    store: Store,
    sandbox: SandboxRecord,
    *,
    fresh_within_s: float | None = None,
    pools: PoolLedger | None = None,
) -> str:
    """The best candidate node for `sandbox` (ResourceExhausted when none). With `pools` (a create), nodes
    with a believed pooled sandbox of its template come first, and the one chosen is charged one."""
    if pools is None:
        return _best(store, sandbox, fresh_within_s, {})[0].id
    with pools.lock:
        ready = schedulable_nodes(store, fresh_within_s)
        believed = {node.id: pools.believed(node, sandbox.template) for node in ready}
        node, tier = _best(store, sandbox, fresh_within_s, believed, ready)
        if tier == TIER_POOL:
            pools.take(node, sandbox.template)
        return node.id


def _best(
    store: Store,
    sandbox: SandboxRecord,
    fresh_within_s: float | None,
    believed: Mapping[str, int],
    ready: list[NodeRecord] | None = None,
) -> tuple[NodeRecord, int]:
    candidates: list[tuple[tuple[int, float], str, NodeRecord]] = []
    ready = schedulable_nodes(store, fresh_within_s) if ready is None else ready
    ready = offering(ready, sandbox.isolation, what=f"sandbox {sandbox.id}")
    # A restore or recovery goes only to nodes whose runtime can restore its checkpoint (ADR 0035).
    for node in restore_targets.able_nodes(store, sandbox, ready):
        placed = store.placed_disk_mb(node.id, besides=sandbox.id) if disk_room_mb(node) is not None else 0
        value = score(node, sandbox, placed, pooled=believed.get(node.id, 0))
        if value is not None:
            candidates.append((value, node.id, node))
    if not candidates:
        raise errors.ResourceExhausted(
            f"no ready node with a fresh heartbeat has room for sandbox {sandbox.id}"
        )
    value, _id, best = max(candidates, key=lambda c: (c[0], c[1]))
    return best, value[0]


def offering(nodes: list[NodeRecord], wanted: str, *, what: str) -> list[NodeRecord]:
    """The nodes of `nodes` whose driver provides isolation `wanted`; ResourceExhausted (naming the
    isolation and what the nodes run) when there are nodes but none does."""
    able = [node for node in nodes if isolation.of_node(node.runtime) == wanted]
    if nodes and not able:
        raise errors.ResourceExhausted(
            f"no ready node runs {wanted} sandboxes, so {what} waits for one ({_offered(nodes)})",
            reason="no_node_for_isolation", isolation=wanted,
        )  # fmt: skip
    return able


def _offered(nodes: list[NodeRecord]) -> str:
    found = sorted({isolation.of_node(node.runtime) or "nothing known" for node in nodes})
    return f"the ready nodes run {', '.join(found)}"


def check_admissible(store: Store, limits: SandboxLimits, wanted: str = isolation.DEFAULT) -> None:
    """Before a create is recorded: Unavailable when ready nodes exist but none runs isolation `wanted`;
    StorageExhausted when no ready node of that isolation that reports its disk could ever hold
    `limits.disk_mb` (even empty). Silent when no node is ready or none reports a disk: nothing is known
    yet, the create waits for a node."""
    ready = placeable(store.list_nodes("ready"))
    able = [node for node in ready if isolation.of_node(node.runtime) == wanted]
    if ready and not able:
        raise errors.Unavailable(
            f"no node runs {wanted} sandboxes ({_offered(ready)}); create it with another isolation, or "
            f"ask the operator for a node whose driver provides {wanted}",
            reason="no_node_for_isolation", field="isolation", isolation=wanted,
        )  # fmt: skip
    rooms = [room for node in able if (room := disk_room_mb(node)) is not None]
    if rooms and limits.disk_mb > max(rooms):
        raise errors.StorageExhausted(
            f"disk_mb {limits.disk_mb} is more than any node can hold: the largest takes {max(rooms)} MB "
            "(its disk less its free-space reserve); ask for less disk",
            reason="no_node_disk", field="limits.disk_mb", disk_mb=limits.disk_mb,
            largest_node_disk_mb=max(rooms),
        )  # fmt: skip
