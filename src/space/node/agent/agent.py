"""The node agent's sandbox manager: lifecycle per sandbox on this node, driven through a Driver.

`NodeAgent` is assembled from layers, one concern each, every layer building on the one below:

    sandbox_registry.SandboxRegistry    the registry, the step runner, the disk bounds
    sandbox_lifecycle.SandboxLifecycle  adopt after a restart, create, pause/resume/stop/start, delete
    sandbox_snapshots.SandboxSnapshots  disk snapshots, checkpoints, rollback, fork, recovery
    template_prep.TemplatePreparation   node and template preparation, template bases, warm starts
    suspend_restore.SuspendRestore      suspend, upload and restore through object storage

Invariants (each layer's docstring holds the details of its own):
- Every state change goes through space.core.lifecycle.transition: the in-progress state is recorded
  before the side effect starts, the completion (or `fail`) event after it; a request the table does not
  allow raises InvalidState naming the current state, before anything is touched.
- Operations on one sandbox are serialised by its lock; different sandboxes proceed in parallel.
- The node is the source of truth for what runs on it: `recover()` rebuilds the registry from the driver
  (runtime state + channel) after an agent restart, reconnecting to running sandboxes without touching them.
- A restored or forked sandbox is reseeded before it is handed out, so copies of one checkpoint never
  share random state.
- Suspend keeps the source: the sandbox stays on the node, paused (state `suspended`), until the caller
  deletes it after it recorded the upload as verified. Restore from object storage downloads and verifies
  every part before the driver touches anything; a failed restore leaves nothing of the sandbox behind.
- Suspend, upload and restore are repeatable: a repeat after a crash (of the agent, at any point) finds what
  is already done (the checkpoint on disk, the staged export, the manifest in the store) and finishes.
- Disk is bounded (space.core.disk, docs/adr/0027-disk-budgets.md): a snapshot or checkpoint starts only if
  the sandbox stays within its storage budget and the node above its free-space reserve, and one that
  turns out to exceed either is deleted again before the error is raised (nothing half-made stays); creates,
  forks and imports are refused below the reserve before anything is written. Suspend and recovery are
  exempt: they are how a node gets its disk back.
"""

from __future__ import annotations

from space.node.agent.sandbox_handle import SandboxHandle, SnapshotRecord
from space.node.agent.suspend_restore import SuspendRestore

__all__ = ["NodeAgent", "SandboxHandle", "SnapshotRecord"]


class NodeAgent(SuspendRestore):
    """The sandboxes of one node: `NodeAgent(driver, store=..., disk_reserve=...)`."""
