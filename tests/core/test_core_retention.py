"""space.core.retention: decaying tiers, the protected newest checkpoint, stability under repeated pruning."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from space.core.errors import InvalidArgument
from space.core.retention import DEFAULT_TIERS, Item, SnapshotPolicy, Tier, due, keep

T0 = datetime(2026, 11, 30, tzinfo=UTC)  # an epoch-aligned day start, so bucket edges are easy to read
MIN = 60
HOUR = 3600
DAY = 86400


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def disk(name: str, seconds: float) -> Item:
    return Item(name, at(seconds), "disk")


def full(name: str, seconds: float, usable: bool = True) -> Item:
    return Item(name, at(seconds), "full", usable)


def test_nothing_to_keep_from_nothing() -> None:
    assert keep([], DEFAULT_TIERS, at(0)) == set()


def test_newest_per_five_minutes_in_the_first_hour() -> None:
    # One disk snapshot a minute for 30 minutes: 6 five-minute buckets, the newest of each survives.
    items = [disk(f"d{i}", i * MIN) for i in range(30)]
    kept = keep(items, DEFAULT_TIERS, at(30 * MIN))
    assert kept == {f"d{i}" for i in (4, 9, 14, 19, 24, 29)}


def test_hourly_for_a_day_then_daily_for_a_week_then_nothing() -> None:
    # One snapshot every 5 minutes for 10 days.
    items = [disk(f"d{i}", i * 5 * MIN) for i in range(10 * 24 * 12)]
    now = at(10 * DAY)
    kept = keep(items, DEFAULT_TIERS, now)
    ages = sorted(now.timestamp() - item.created_at.timestamp() for item in items if item.id in kept)
    in_hour = [a for a in ages if a < HOUR]
    in_day = [a for a in ages if HOUR <= a < DAY]
    in_week = [a for a in ages if DAY <= a < 7 * DAY]
    assert len(in_hour) == 11  # ages 5, 10, ... 55 minutes: the newest of each 5-minute bucket
    assert 22 <= len(in_day) <= 24
    assert 5 <= len(in_week) <= 7
    assert all(a < 7 * DAY for a in ages), "nothing older than the last tier survives"
    assert len(kept) < 45


def test_the_newest_usable_checkpoint_is_never_dropped() -> None:
    # A single ancient checkpoint, far beyond every tier: still kept (recovery needs it).
    items = [full("old", 0), disk("d", 30 * DAY)]
    assert keep(items, DEFAULT_TIERS, at(30 * DAY)) == {"old", "d"}


def test_an_unusable_checkpoint_does_not_take_the_protection() -> None:
    items = [full("good", 0), full("broken", 10 * DAY, usable=False)]
    kept = keep(items, DEFAULT_TIERS, at(30 * DAY))
    assert kept == {"good"}


def test_kinds_are_thinned_independently() -> None:
    # A disk snapshot newer than a checkpoint in the same bucket does not push the checkpoint out.
    items = [full("f", 10), disk("d", 20)]
    assert keep(items, DEFAULT_TIERS, at(60)) == {"f", "d"}


def test_snapshots_from_the_future_are_kept() -> None:
    items = [disk("future", 100), disk("now", 0)]
    assert "future" in keep(items, DEFAULT_TIERS, at(50))


def test_ties_are_broken_by_id_deterministically() -> None:
    items = [disk("a", 10), disk("b", 10)]
    assert keep(items, DEFAULT_TIERS, at(20)) == {"b"}
    assert keep(list(reversed(items)), DEFAULT_TIERS, at(20)) == {"b"}


def test_custom_single_tier() -> None:
    tiers = [Tier(every_s=10, for_s=60)]
    items = [disk(f"d{i}", i) for i in range(0, 100, 3)]
    kept = keep(items, tiers, at(100))
    # Buckets [40,50) ... [90,100) are within 60 s of now=100 (the bucket [40,50) only partly: d48 is 52 s
    # old): the newest of each.
    assert kept == {"d48", "d57", "d69", "d78", "d87", "d99"}


def test_tiers_are_checked() -> None:
    with pytest.raises(InvalidArgument):
        keep([], [], at(0))
    with pytest.raises(ValidationError):
        SnapshotPolicy(tiers=())
    with pytest.raises(ValidationError):
        Tier(every_s=0, for_s=10)
    with pytest.raises(ValidationError):
        SnapshotPolicy.model_validate({"disk_every_s": 60, "bogus": 1})
    policy = SnapshotPolicy.model_validate({"disk_every_s": 60, "full_every_s": 600, "upload_full": True})
    assert policy.tiers == DEFAULT_TIERS


def test_due() -> None:
    assert not due(None, None, at(0))
    assert due(None, 60, at(0))
    assert not due(at(0), 60, at(59))
    assert due(at(0), 60, at(60))


# -- properties ----------------------------------------------------------------------------------------------
tiers_strategy = st.lists(
    st.builds(Tier, every_s=st.integers(1, 500), for_s=st.integers(1, 5000)), min_size=1, max_size=4
)
times = st.lists(st.integers(0, 20000), min_size=0, max_size=60)


@settings(max_examples=300, deadline=None)
@given(tiers=tiers_strategy, created=times, kinds=st.lists(st.booleans(), min_size=60, max_size=60))
def test_pruning_as_you_go_equals_pruning_once(
    tiers: list[Tier], created: list[int], kinds: list[bool]
) -> None:
    """Snapshots arrive over time; after each arrival everything `keep` does not keep is deleted. The
    survivors at the end are exactly what `keep` keeps from the whole history."""
    history = [Item(f"s{i}", at(t), "full" if kinds[i] else "disk") for i, t in enumerate(sorted(created))]
    alive: list[Item] = []
    for item in history:
        alive.append(item)
        kept = keep(alive, tiers, item.created_at)
        alive = [s for s in alive if s.id in kept]
    end = at(max(created, default=0))
    assert {s.id for s in alive} & keep(history, tiers, end) == keep(history, tiers, end)
    assert keep(alive, tiers, end) == keep(history, tiers, end)


@settings(max_examples=300, deadline=None)
@given(tiers=tiers_strategy, created=times, now=st.integers(0, 40000), future=st.integers(0, 3))
def test_invariants(tiers: list[Tier], created: list[int], now: int, future: int) -> None:
    past = [t for t in created if t <= now]
    items = [Item(f"s{i}", at(t), "full" if i % 3 == 0 else "disk") for i, t in enumerate(past)]
    ahead = [Item(f"f{i}", at(now + 100_000 + i), "disk") for i in range(future)]  # clock skew
    kept = keep(items + ahead, tiers, at(now))
    assert {s.id for s in ahead} <= kept, "snapshots from the future are never judged"
    kept -= {s.id for s in ahead}
    assert kept <= {s.id for s in items}
    fulls = [s for s in items if s.kind == "full"]
    if fulls:
        assert max(fulls, key=lambda s: (s.created_at.timestamp(), s.id)).id in kept
    horizon = max(t.for_s for t in tiers)
    for s in items:
        age = now - (s.created_at.timestamp() - T0.timestamp())
        if s.id in kept and s.kind == "disk":
            assert age < horizon, "a disk snapshot beyond every tier was kept"
    # At most one kept snapshot per (kind, tier, bucket) among those the tier covers, plus the protected one.
    bound = sum(t.for_s // t.every_s + 2 for t in tiers) * 2 + 1
    assert len(kept) <= bound
    # The newest snapshot of each kind is kept while some tier still covers its age.
    for kind in ("disk", "full"):
        of_kind = [s for s in items if s.kind == kind]
        if of_kind:
            newest = max(of_kind, key=lambda s: (s.created_at.timestamp(), s.id))
            if now - (newest.created_at.timestamp() - T0.timestamp()) < horizon:
                assert newest.id in kept
