"""Snapshot retention by decaying tiers, and the per-sandbox snapshot policy (pure: no I/O).

A tier says "one snapshot per `every_s` seconds for snapshots up to `for_s` seconds old". The default is one
per 5 minutes for the last hour, one per hour for the last day, one per day for the last week. Buckets are
aligned to the epoch (floor(timestamp / every_s)), not to the age, so a snapshot does not hop between
buckets as time passes; in each bucket the NEWEST snapshot is kept.

Invariants (tests/core/test_core_retention.py checks them, partly with hypothesis):
- `keep` never drops the newest usable full checkpoint (the one crash recovery and suspend rely on), nor a
  snapshot it cannot date sensibly (created in the future: clock skew keeps it, it is "age 0").
- Tiers are applied per kind (disk snapshots and full checkpoints thin out independently), so a frequent
  disk snapshot never crowds a checkpoint out of its bucket.
- Pruning is stable: a snapshot is kept when it is the newest of its bucket among ALL snapshots of that
  bucket (not only among those of the tier's age range) and younger than the tier's horizon; both only
  get harder to satisfy as time passes, so applying `keep` at every moment and deleting the rest keeps
  exactly what applying it once at the end to the whole history keeps. The scheduler may prune as often
  as it likes without losing a snapshot a coarser tier wants later.
- Snapshots older than the last tier's horizon are dropped (unless protected above).
- A policy cannot ask for disk snapshots more often than every `minimum_intervals().disk_s` seconds (60)
  nor full checkpoints more often than every `.full_s` (300), nor keep more than `max_retained`
  scheduled snapshots (docs/adr/0027-disk-budgets.md). A policy stored before those bounds existed is
  clamped to them when read (`SnapshotPolicy.from_stored`), never refused.
- `plan_prune_to_fit` frees bytes oldest-first among prunable snapshots only; it never picks a protected
  one, and answers None (prune nothing) when even all of them would not free enough.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from space.core.errors import InvalidArgument

SnapshotKind = Literal["disk", "full"]


class Instant(Protocol):
    """A point in time (an aware datetime in practice); core reads no clock, callers pass `now`."""

    def timestamp(self) -> float: ...


class Tier(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    every_s: int = Field(gt=0, le=366 * 86400)
    for_s: int = Field(gt=0, le=10 * 366 * 86400)


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier(every_s=300, for_s=3600),
    Tier(every_s=3600, for_s=86400),
    Tier(every_s=86400, for_s=7 * 86400),
)


MAX_TIERS = 16


def check_tiers(tiers: Sequence[Tier]) -> None:
    """InvalidArgument unless there are 1 to MAX_TIERS tiers."""
    if not 1 <= len(tiers) <= MAX_TIERS:
        raise InvalidArgument(f"a retention policy needs 1 to {MAX_TIERS} tiers", field="tiers")


@dataclass(frozen=True, slots=True)
class MinimumIntervals:
    """How often a policy may ask for snapshots at most. Each disk snapshot is a commit and pins what the
    sandbox overwrites; each full checkpoint pauses the sandbox and writes its memory to disk."""

    disk_s: int = 60
    full_s: int = 300


_minimums = MinimumIntervals()
MAX_RETAINED = 256  # scheduled snapshots one sandbox may keep, at most (also the node's cap on snapshots)
DEFAULT_MAX_RETAINED = 100  # the default tiers keep at most 12 + 24 + 7 of each kind


def minimum_intervals() -> MinimumIntervals:
    return _minimums


def set_minimum_intervals(disk_s: int, full_s: int) -> None:
    """Operator setting of a control plane (`--snapshot-min-intervals`); a test cluster lowers them to run
    the scheduler in seconds. Both at least 1."""
    global _minimums
    if disk_s < 1 or full_s < 1:
        raise InvalidArgument(
            "minimum snapshot intervals must be at least 1 s", field="snapshot_min_intervals"
        )
    _minimums = MinimumIntervals(disk_s, full_s)


class SnapshotPolicy(BaseModel):
    """What the snapshot scheduler does for one sandbox (given at create or by PATCH)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    disk_every_s: int | None = Field(default=None, ge=1, le=366 * 86400)  # None: no scheduled disk snapshots
    full_every_s: int | None = Field(default=None, ge=1, le=366 * 86400)  # None: no scheduled checkpoints
    upload_full: bool = False  # upload each scheduled full checkpoint to object storage (recovery anywhere)
    tiers: tuple[Tier, ...] = DEFAULT_TIERS
    # Scheduled snapshots kept at most, whatever the tiers say (the oldest prunable ones go first).
    max_retained: int = Field(default=DEFAULT_MAX_RETAINED, ge=1, le=MAX_RETAINED)

    @field_validator("disk_every_s")
    @classmethod
    def _disk_often_enough(cls, value: int | None) -> int | None:
        floor = _minimums.disk_s
        if value is not None and value < floor:
            raise ValueError(
                f"disk snapshots may be scheduled no more often than every {floor} s (got {value})"
            )
        return value

    @field_validator("full_every_s")
    @classmethod
    def _full_often_enough(cls, value: int | None) -> int | None:
        floor = _minimums.full_s
        if value is not None and value < floor:
            raise ValueError(
                f"full checkpoints may be scheduled no more often than every {floor} s (got {value})"
            )
        return value

    @model_validator(mode="after")
    def _tiers(self) -> SnapshotPolicy:
        try:
            check_tiers(self.tiers)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
        return self

    @classmethod
    def from_stored(cls, data: Any) -> SnapshotPolicy:
        """A policy as stored on a sandbox row: one written before the minimum intervals (or with lower
        minimums in force) runs at the minimum instead of failing the scheduler."""
        if isinstance(data, dict):
            data = dict(data)
            for field, floor in (("disk_every_s", _minimums.disk_s), ("full_every_s", _minimums.full_s)):
                value = data.get(field)
                if isinstance(value, int) and not isinstance(value, bool) and value < floor:
                    data[field] = floor
        return cls.model_validate(data)


@dataclass(frozen=True, slots=True)
class Item:
    """What retention needs to know about one snapshot."""

    id: str
    created_at: Instant
    kind: SnapshotKind
    usable: bool = True  # complete and restorable (a full checkpoint recovery could use)


def _bucket(ts: float, every_s: int) -> int:
    return math.floor(ts / every_s)


def keep(snapshots: Iterable[Item], tiers: Sequence[Tier], now: Instant) -> set[str]:
    """The ids to keep among `snapshots` at time `now`; everything else may be deleted.

    A snapshot is kept when, for some tier, it is younger than the tier's horizon and the newest snapshot
    of its kind in its bucket of that tier (newest among ALL snapshots of the bucket, whatever their age)."""
    check_tiers(tiers)
    items = list(snapshots)
    kept: set[str] = set()
    usable_full = [s for s in items if s.kind == "full" and s.usable]
    if usable_full:
        kept.add(max(usable_full, key=_order).id)
    now_ts = now.timestamp()
    for kind in ("disk", "full"):
        newest: dict[tuple[int, int], Item] = {}
        of_kind = [s for s in items if s.kind == kind]
        for item in of_kind:
            for index, tier in enumerate(tiers):
                bucket = (index, _bucket(item.created_at.timestamp(), tier.every_s))
                held = newest.get(bucket)
                if held is None or _order(item) > _order(held):
                    newest[bucket] = item
        for item in of_kind:
            ts = item.created_at.timestamp()
            age = now_ts - ts
            if age < 0:
                kept.add(item.id)  # from the future (clock skew): never judged
                continue
            for index, tier in enumerate(tiers):
                if age < tier.for_s and newest[(index, _bucket(ts, tier.every_s))] is item:
                    kept.add(item.id)
                    break
    return kept


def _order(item: Item) -> tuple[float, str]:
    return item.created_at.timestamp(), item.id


def due(last: Instant | None, every_s: int | None, now: Instant) -> bool:
    """Whether a scheduled snapshot with period `every_s` is due, the last one having been at `last`."""
    if every_s is None:
        return False
    return last is None or now.timestamp() - last.timestamp() >= every_s


@dataclass(frozen=True, slots=True)
class Sized:
    """A snapshot as pruning-to-fit sees it: how many bytes deleting it frees, and whether it may go."""

    id: str
    created_at: Instant
    bytes: int
    prunable: bool  # taken by the platform, not the newest usable checkpoint, not suspended/recovered from


def plan_prune_to_fit(snapshots: Iterable[Sized], excess_bytes: int) -> list[str] | None:
    """The oldest prunable snapshots whose bytes add up to at least `excess_bytes` (oldest first); [] when
    nothing is in excess; None when even every prunable snapshot would not free enough (prune nothing:
    failing to fit after deleting history would lose it for nothing)."""
    if excess_bytes <= 0:
        return []
    chosen: list[str] = []
    freed = 0
    for snap in sorted((s for s in snapshots if s.prunable), key=lambda s: (s.created_at.timestamp(), s.id)):
        chosen.append(snap.id)
        freed += max(0, snap.bytes)
        if freed >= excess_bytes:
            return chosen
    return None


def over_count(snapshots: Iterable[Sized], limit: int) -> list[str]:
    """The oldest prunable snapshots to drop so that at most `limit` prunable ones remain."""
    prunable = sorted((s for s in snapshots if s.prunable), key=lambda s: (s.created_at.timestamp(), s.id))
    return [s.id for s in prunable[: max(0, len(prunable) - limit)]]
