"""The invariant checker of the crash-injection harness: one sweep over the database, every node and the
object store, returning every violation it finds (an empty list: all invariants hold).

What must hold once a cluster has converged after any crash (docs/adr/0038-crash-injection-harness.md):
- database: no sandbox in an in-progress (-ing) state and every sandbox where it was asked to be (state ==
  desired_state); no snapshot record stuck in `creating`;
- every node (its agent's own listing, btrfs, the host's processes, network namespaces and nftables, its
  run and staging directories): a sandbox is held by exactly the node its record names, and only while
  the record says it lives there; every snapshot subvolume of a sandbox has a record;
  nothing of a deleted or suspended sandbox remains (subvolumes, runsc
  processes, run directory, network slot), no slot is left beyond those recorded and the helper's pool,
  the node has its one nftables table, the staging directory is empty;
- the object store: every snapshot marked restorable has its manifest and every part it lists, with the
  recorded sizes and checksums; every object belongs to the committed artifact of a snapshot record (no
  parts of an upload that never committed, no artifact nothing refers to, no interrupted write).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from space.controlplane.store.records import SandboxRecord, SnapshotRecord
from space.controlplane.store.store import Store
from space.core import errors
from space.core.lifecycle import IN_PROGRESS_STATES, State
from space.node.helper import netns
from space.node.helper.netaddr import SlotNames, node_tag
from space.node.helper.network import POOL_SIZE
from space.node.layout import NodeLayout
from space.objectstore.artifacts import read_manifest, verify
from space.objectstore.base import ObjectStore
from space.objectstore.local import TEMP_MARK
from tests.support.host import processes_mentioning

#: States in which a sandbox has a copy on its node (runtime or not); every other state has none.
ON_A_NODE = frozenset({State.RUNNING, State.PAUSED, State.STOPPED, State.CRASHED, State.FAILED})
#: States in which that copy has a runtime (runsc processes).
WITH_RUNTIME = frozenset({State.RUNNING, State.PAUSED})
SANDBOX_ID = re.compile(r"sb-[0-9a-z]+")
SNAPSHOT_ID = re.compile(r"snap-[0-9a-z]+")


@dataclass(frozen=True)
class NodeView:
    """What the checker needs of one node: its id, its data directory and its agent's listing."""

    node_id: str
    layout: NodeLayout
    listing: dict[str, str]  # sandbox id -> state, from GET /node/v1/sandboxes (the agent is up)


def _ids_in(lines: Iterable[str]) -> set[str]:
    return {found for line in lines for found in SANDBOX_ID.findall(line)}


def subvolume_owners(layout: NodeLayout) -> dict[str, list[str]]:
    """sandbox id -> this node's btrfs subvolumes that belong to it (root filesystem, snapshots, ...)."""
    out = subprocess.run(
        ["btrfs", "subvolume", "list", str(layout.fs)], capture_output=True, text=True, check=True
    ).stdout
    owners: dict[str, list[str]] = {}
    for line in out.splitlines():
        path = line.split(" path ", 1)[-1]
        for sandbox_id in _ids_in([path]):
            owners.setdefault(sandbox_id, []).append(path)
    return owners


def runtime_owners(layout: NodeLayout) -> set[str]:
    """Sandbox ids this node's runsc root has processes for (runsc, sandbox and gofer processes)."""
    root = str(layout.runsc_root)
    return _ids_in(p for p in processes_mentioning(root))


def check_database(sandboxes: list[SandboxRecord], snapshots: list[SnapshotRecord]) -> list[str]:
    problems = []
    for sb in sandboxes:
        if sb.state in IN_PROGRESS_STATES:
            problems.append(f"db: {sb.id} stuck in {sb.state.value} (desired {sb.desired_state.value})")
        elif sb.state != sb.desired_state and sb.state not in (State.FAILED, State.CRASHED):
            problems.append(f"db: {sb.id} is {sb.state.value}, asked to be {sb.desired_state.value}")
        elif sb.state in (State.FAILED, State.CRASHED):
            problems.append(f"db: {sb.id} ended {sb.state.value}: {sb.error_code} {sb.error}")
    problems += [
        f"db: snapshot {s.id} of {s.sandbox_id} stuck creating" for s in snapshots if s.state == "creating"
    ]
    return problems


def check_node(
    node: NodeView, sandboxes: dict[str, SandboxRecord], snapshots: list[SnapshotRecord]
) -> list[str]:
    """Every copy this node holds is the one its record places here, and nothing else of a sandbox stays."""
    problems = []
    where = f"node {node.node_id}"

    def placed_here(sandbox_id: str, states: frozenset[State]) -> bool:
        sb = sandboxes.get(sandbox_id)
        return sb is not None and sb.node_id == node.node_id and sb.state in states

    for sandbox_id, state in sorted(node.listing.items()):
        if not placed_here(sandbox_id, ON_A_NODE):
            sb = sandboxes.get(sandbox_id)
            known = (sb.state.value, sb.node_id) if sb is not None else "no record"
            problems.append(f"{where}: holds {sandbox_id} ({state}) but its record is {known}")
    for sb in sandboxes.values():
        if sb.node_id == node.node_id and sb.state in ON_A_NODE and sb.id not in node.listing:
            problems.append(f"{where}: record places {sb.id} ({sb.state.value}) here, the node has no copy")
    held_snapshots = {s.sandbox_id for s in snapshots if s.node_id == node.node_id and s.state != "deleting"}
    for sandbox_id, paths in sorted(subvolume_owners(node.layout).items()):
        if not placed_here(sandbox_id, ON_A_NODE) and sandbox_id not in held_snapshots:
            problems.append(f"{where}: orphan subvolumes of {sandbox_id}: {paths}")
    recorded = {s.id for s in snapshots}
    for sandbox_id, paths in sorted(subvolume_owners(node.layout).items()):
        unrecorded = [path for path in paths for snap in SNAPSHOT_ID.findall(path) if snap not in recorded]
        if unrecorded and placed_here(sandbox_id, ON_A_NODE):
            problems.append(f"{where}: snapshots of {sandbox_id} without a record: {unrecorded}")
    for sandbox_id in sorted(runtime_owners(node.layout)):
        if not placed_here(sandbox_id, WITH_RUNTIME):
            problems.append(f"{where}: orphan runtime (runsc processes) of {sandbox_id}")
    run_dirs = sorted(p.name for p in node.layout.run.iterdir()) if node.layout.run.is_dir() else []
    for name in run_dirs:
        if SANDBOX_ID.fullmatch(name) and not placed_here(name, ON_A_NODE):
            problems.append(f"{where}: orphan run directory of {name}")
    staging = sorted(p.name for p in node.layout.staging.iterdir()) if node.layout.staging.is_dir() else []
    if staging:
        problems.append(f"{where}: staging directory not empty: {staging}")
    return problems + check_network(node, sandboxes)


def check_network(node: NodeView, sandboxes: dict[str, SandboxRecord]) -> list[str]:
    """Slots: only those of sandboxes living here, plus the helper's pool; the node's one nftables table."""
    names = SlotNames(node_tag(node.layout.data_dir))
    slots = netns.existing_slots(names)
    recorded = {
        p.parent.name for p in node.layout.run.glob("sb-*/network.json")
    } if node.layout.run.is_dir() else set()  # fmt: skip
    live = {sb.id for sb in sandboxes.values() if sb.node_id == node.node_id and sb.state in ON_A_NODE}
    problems = [
        f"node {node.node_id}: network slot recorded for {s}, not living here" for s in recorded - live
    ]
    if len(slots) > len(recorded) + POOL_SIZE:
        problems.append(
            f"node {node.node_id}: {len(slots)} network slots for {len(recorded)} sandboxes and a pool of "
            f"{POOL_SIZE}: orphan slots {sorted(slots)}"
        )
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout
    count = sum(1 for line in tables.splitlines() if line.strip().endswith(names.table))
    if count != 1:
        problems.append(f"node {node.node_id}: {count} nftables tables {names.table} (one expected)")
    return problems


def check_objects(
    objects: ObjectStore, store_root: pathlib.Path | None, sandboxes: list[SandboxRecord],
    snapshots: list[SnapshotRecord],
) -> list[str]:  # fmt: skip
    """Restorable snapshots are complete; every object belongs to a snapshot's committed artifact."""
    problems = []
    referenced: set[str] = set()
    for snap in snapshots:
        if snap.prefix:
            referenced.add(snap.prefix)  # (a `deleting` one's objects go with its record: the collector)
        if not snap.restorable or snap.state == "deleting":  # (a deleting one is never restored again)
            continue
        if not snap.prefix:
            problems.append(f"objects: snapshot {snap.id} is restorable without a prefix")
            continue
        try:
            verify(objects, read_manifest(objects, snap.prefix))
        except errors.SpaceError as exc:
            problems.append(f"objects: restorable snapshot {snap.id} is incomplete: {exc}")
    by_id = {s.id: s for s in snapshots}
    for sb in sandboxes:
        if sb.state == State.SUSPENDED:
            snap = by_id.get(sb.suspended_snapshot_id or "")
            if snap is None or not snap.restorable:
                problems.append(
                    f"objects: suspended {sb.id} has no restorable snapshot ({sb.suspended_snapshot_id})"
                )
    keys = objects.list("sandboxes/")
    committed = {k.rsplit("/", 1)[0] for k in keys if k.endswith("/manifest.json")}
    listed: set[str] = set()
    for prefix in committed:
        manifest = read_manifest(objects, prefix)
        listed |= {part.key for entry in manifest.entries.values() for part in entry.parts}
        if prefix not in referenced:
            problems.append(f"objects: artifact {prefix} belongs to no snapshot record")
    stray = [k for k in keys if not k.endswith("/manifest.json") and k not in listed]
    if stray:
        problems.append(
            f"objects: {len(stray)} parts no manifest lists (uploads that never committed): {stray[:5]}"
        )
    if store_root is not None and (store_root / "sandboxes").is_dir():
        temp = sorted(str(p) for p in (store_root / "sandboxes").rglob(f"*{TEMP_MARK}*"))
        if temp:
            problems.append(f"objects: interrupted writes left: {temp[:5]}")
    return problems


def sweep(
    db: Store, project_id: str, nodes: list[NodeView], objects: ObjectStore, store_root: pathlib.Path | None
) -> list[str]:
    """Every invariant of the module docstring; the violations found (empty: all hold)."""
    sandboxes = db.list_sandboxes(project_id, include_deleted=True)
    snapshots = [snap for sb in sandboxes for snap in db.list_snapshots(sb.id, include_deleting=True)]
    by_id = {sb.id: sb for sb in sandboxes}
    problems = check_database(sandboxes, snapshots)
    for node in nodes:
        problems += check_node(node, by_id, snapshots)
    return problems + check_objects(objects, store_root, sandboxes, snapshots)
