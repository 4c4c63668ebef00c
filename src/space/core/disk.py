"""Disk bounds (pure: no I/O): a sandbox's storage budget, a node's free-space reserve, node admission.

Invariants (docs/adr/0027-disk-budgets.md):
- A sandbox's storage is everything it keeps on its node: its files, what its snapshots pin and its
  checkpoint images. Nothing that adds to it (a snapshot, a checkpoint) starts when `used + needed` would
  exceed `limits.storage_mb`, and the node removes what it just made if the measured result does.
- A node keeps `DiskReserve.bytes_for(total)` free: a create, snapshot, checkpoint or import that would
  leave less is refused before anything is written. Suspend is exempt: it is how a node gets disk back.
- Admission: the `disk_mb` of every sandbox placed on a node plus the reserve fit in the node's disk.
- Every refusal is a StorageExhausted (HTTP 507) naming the numbers, in bytes, and what to do.
"""

from __future__ import annotations

from typing import Final

from space.core.errors import StorageExhausted
from space.core.settings import DiskReserve

MiB: Final = 1 << 20
#: Snapshots (disk or full) one sandbox may hold on a node, whoever took them: each is a subvolume, and
#: btrfs slows down with thousands of them.
MAX_SNAPSHOTS_PER_SANDBOX: Final = 256


def _mib(value: int) -> str:
    return f"{value / MiB:.1f} MiB"


def check_budget(
    sandbox_id: str, *, used_bytes: int, needed_bytes: int, budget_bytes: int, what: str
) -> None:
    """StorageExhausted when `what` (needing about `needed_bytes`) would take the sandbox over its budget."""
    if used_bytes + needed_bytes > budget_bytes:
        raise StorageExhausted(
            f"{what} refused: sandbox {sandbox_id} keeps {_mib(used_bytes)} on its node (files, snapshots, "
            f"checkpoint images){f' and this needs about {_mib(needed_bytes)}' if needed_bytes else ''}, "
            f"over its storage budget of {_mib(budget_bytes)} (limits.storage_mb); delete snapshots or "
            "create the sandbox with a larger storage_mb",
            reason="storage_budget", sandbox_id=sandbox_id, used_bytes=used_bytes,
            needed_bytes=needed_bytes, budget_bytes=budget_bytes,
        )  # fmt: skip


def check_snapshot_count(sandbox_id: str, count: int) -> None:
    if count >= MAX_SNAPSHOTS_PER_SANDBOX:
        raise StorageExhausted(
            f"snapshot refused: sandbox {sandbox_id} already has {count} snapshots on its node, the most a "
            "sandbox may keep; delete some first",
            reason="snapshot_count", sandbox_id=sandbox_id, count=count, limit=MAX_SNAPSHOTS_PER_SANDBOX,
        )  # fmt: skip


def check_reserve(
    *, free_bytes: int, total_bytes: int, needed_bytes: int, reserve: DiskReserve, what: str
) -> None:
    """StorageExhausted when `what` would leave the node less free space than its reserve."""
    reserve_bytes = reserve.bytes_for(total_bytes)
    if free_bytes - needed_bytes < reserve_bytes:
        raise StorageExhausted(
            f"{what} refused: the node has {_mib(free_bytes)} free"
            f"{f', this needs about {_mib(needed_bytes)}' if needed_bytes else ''} and it keeps "
            f"{_mib(reserve_bytes)} in reserve",
            reason="node_reserve", free_bytes=free_bytes, reserve_bytes=reserve_bytes,
            needed_bytes=needed_bytes, total_bytes=total_bytes,
        )  # fmt: skip


def admissible_disk_mb(capacity_mb: int, reserve: DiskReserve) -> int:
    """The most `disk_mb` a node of `capacity_mb` can hand out in total (its reserve kept aside)."""
    return max(0, capacity_mb - reserve.bytes_for(capacity_mb * MiB) // MiB)
