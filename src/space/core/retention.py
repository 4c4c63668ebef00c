"""Snapshot retention by decaying tiers, and the per-sandbox snapshot policy (pure: no I/O).

A tier says "one snapshot per `every_s` seconds for snapshots up to `for_s` seconds old". The default is one
per 5 minutes for the last hour, one per hour for the last day, one per day for the last week. Buckets are
aligned to the epoch (floor(timestamp / every_s)), not to the age, so a snapshot does not hop between
buckets as time passes; in each bucket the NEWEST snapshot is kept.

Invariants (tests/unit/test_core_retention.py checks them, partly with hypothesis):
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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class SnapshotPolicy(BaseModel):
    """What the snapshot scheduler does for one sandbox (given at create or by PATCH)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    disk_every_s: int | None = Field(default=None, ge=1)  # None: no scheduled disk snapshots
    full_every_s: int | None = Field(default=None, ge=1)  # None: no scheduled full checkpoints
    upload_full: bool = False  # upload each scheduled full checkpoint to object storage (recovery anywhere)
    tiers: tuple[Tier, ...] = DEFAULT_TIERS

    @model_validator(mode="after")
    def _tiers(self) -> SnapshotPolicy:
        try:
            check_tiers(self.tiers)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
        return self


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
