"""Which nodes may take a restore: placement of a sandbox that comes back from a full checkpoint considers
only nodes whose runtime can restore that checkpoint (ADR 0035; the rules are space.core.runtimes').

Invariants:
- A sandbox being restored (`restoring`: its suspended checkpoint), recovered (`recovering`: the
  checkpoint it recovers from) or created from a checkpoint (`creating` with `fork_snapshot_id`: placed
  only when that checkpoint lives in object storage, ADR 0060) needs the runtime its checkpoint's row
  records; any other placement needs nothing and every node stays a candidate.
- A node that has not reported its runtime stays a candidate (it refuses an incompatible restore itself);
  a checkpoint of unknown runtime (older rows) fits every node.
- When nodes are ready but none can restore the checkpoint, the answer is ResourceExhausted naming each
  node's reason (bounded), so the reconciler retries with back-off until a fitting node is there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from space.controlplane.store.records import NodeRecord, SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors, runtimes
from space.core.lifecycle import State

REASONS_SHOWN: Final = 3


def checkpoint_of(sandbox: SandboxRecord) -> str | None:
    """The checkpoint a placement of `sandbox` restores now, if any."""
    if sandbox.state == State.RESTORING:
        return sandbox.suspended_snapshot_id
    if sandbox.state == State.RECOVERING:
        return sandbox.recovered_from
    if sandbox.state == State.CREATING:
        return sandbox.fork_snapshot_id
    return None


def needed_runtime(store: Store, sandbox: SandboxRecord) -> tuple[str, dict[str, Any]] | None:
    """(checkpoint id, the runtime it needs) for a placement that restores one of known runtime."""
    snapshot_id = checkpoint_of(sandbox)
    if snapshot_id is None:
        return None
    snap = store.get_snapshot(snapshot_id)
    if snap is None or snap.runtime is None:
        return None
    return snapshot_id, snap.runtime


def able_nodes(store: Store, sandbox: SandboxRecord, nodes: Sequence[NodeRecord]) -> list[NodeRecord]:
    """The nodes of `nodes` that can restore what `sandbox`'s placement restores (all of them when it
    restores nothing); ResourceExhausted when there are nodes but none can."""
    needed = needed_runtime(store, sandbox)
    if needed is None:
        return list(nodes)
    snapshot_id, runtime = needed
    able = [node for node in nodes if runtimes.placeable(node.runtime, runtime)]
    if nodes and not able:
        reasons = "; ".join(
            f"{node.id}: {runtimes.restore_problem(node.runtime, runtime)}" for node in nodes[:REASONS_SHOWN]
        )
        raise errors.ResourceExhausted(
            f"no ready node can restore checkpoint {snapshot_id} of sandbox {sandbox.id} ({reasons})",
            reason="no_compatible_runtime", snapshot_id=snapshot_id,
        )  # fmt: skip
    return able
