"""The leader lease of the once-per-cluster jobs (ADR 0034, space.controlplane.store.leader and api/jobs.py).

1. The repository on SQLite with a hand-driven clock: a claim, a refused rival, renewal, expiry and takeover
   (acquired_at dates the tenure), release, and the arguments it refuses.
2. On PostgreSQL: rivals racing for a lease nobody holds; exactly one wins, the rest are told False.
3. Two control-plane replicas on one PostgreSQL database, one fake node, a sandbox with a snapshot policy:
   only the lease holder takes scheduled snapshots; SIGKILLed, the other takes over within the lease (plus
   one renewal period) and takes them from then on.
"""

from __future__ import annotations

import pathlib
import re
import signal
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from space.controlplane.api.jobs import JOBS, LEADER_LEASE
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store, open_store
from space.core import errors
from tests.support import cluster as c
from tests.support import postgres

postgres_url = postgres.postgres_url

LEASE_S = 1.5  # the replicas' SPACE_LEADER_LEASE_S in test 3
TOOK = re.compile(r"leader (\S+): took (\d+) scheduled snapshots")


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clocked(tmp_path: pathlib.Path) -> Iterator[tuple[Store, Clock]]:
    clock = Clock()
    with open_store(sqlite_url(tmp_path / "cp"), clock=clock) as store:
        yield store, clock


def test_claim_renew_expire_take_over_and_release(clocked: tuple[Store, Clock]) -> None:
    store, clock = clocked
    assert store.leader("jobs") is None
    assert store.claim_leadership("jobs", "a", 10.0) is True
    first = store.leader("jobs")
    assert first is not None and first.owner == "a" and first.expires_at == clock.now + timedelta(seconds=10)
    assert store.claim_leadership("jobs", "b", 10.0) is False  # a's lease runs
    clock.advance(9.0)
    assert store.claim_leadership("jobs", "a", 10.0) is True  # a renewal moves the expiry, not the tenure
    renewed = store.leader("jobs")
    assert renewed is not None and renewed.acquired_at == first.acquired_at
    assert renewed.expires_at == clock.now + timedelta(seconds=10)
    clock.advance(9.9)
    assert store.claim_leadership("jobs", "b", 10.0) is False  # still 0.1 s left
    clock.advance(0.1)
    assert store.leader("jobs") is None  # expired: nobody leads
    assert store.claim_leadership("jobs", "b", 10.0) is True  # taken over
    taken = store.leader("jobs")
    assert taken is not None and taken.owner == "b" and taken.acquired_at == clock.now
    assert store.claim_leadership("jobs", "a", 10.0) is False  # the old holder cannot renew any more
    assert store.release_leadership("jobs", "a") is False  # nor release what it no longer holds
    assert store.release_leadership("jobs", "b") is True
    assert store.leader("jobs") is None
    assert store.claim_leadership("jobs", "a", 10.0) is True  # released: free at once, no expiry to wait
    assert store.claim_leadership("other", "b", 10.0) is True  # leases are per name


@pytest.mark.parametrize(
    ("name", "owner", "lease_s"),
    [("", "a", 1.0), ("x" * 65, "a", 1.0), ("jobs", "", 1.0), ("jobs", "o" * 129, 1.0), ("jobs", "a", -1.0)],
)
def test_bad_arguments_are_refused(
    clocked: tuple[Store, Clock], name: str, owner: str, lease_s: float
) -> None:
    store, _clock = clocked
    with pytest.raises(errors.InvalidArgument):
        store.claim_leadership(name, owner, lease_s)
    assert store.leader("jobs") is None


def test_the_snapshot_scheduler_is_a_once_per_cluster_job() -> None:
    once = {job.what for job in JOBS if job.once_per_cluster}
    assert once == {
        "taking scheduled snapshots",
        "removing artifacts nothing refers to",
        "deleting expired idempotency and audit rows",
    }


def test_racing_rivals_on_postgresql_one_wins(postgres_url: str) -> None:
    url = postgres.new_database(postgres_url)
    with open_store(url) as store:
        assert store.dialect == "postgresql"
        for round_ in range(5):
            name = f"race-{round_}"
            start = threading.Barrier(8)
            won: list[str] = []

            def claim(
                owner: str, name: str = name, start: threading.Barrier = start, won: list[str] = won
            ) -> None:
                start.wait(10)
                if store.claim_leadership(name, owner, 30.0):
                    won.append(owner)

            threads = [threading.Thread(target=claim, args=(f"r{i}",)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            holder = store.leader(name)
            assert len(won) == 1 and holder is not None and holder.owner == won[0], (won, holder)


# -- two replicas ----------------------------------------------------------------------------------------
def _restart(cp: c.ControlPlane) -> None:
    """Start `cp` again with a short leader lease and info logs (its "took N scheduled snapshots" lines)."""
    cp.extra_env["SPACE_LEADER_LEASE_S"] = str(LEASE_S)
    cp.argv[cp.argv.index("--log-level") + 1] = "info"
    cp.start_and_wait()


def _took(cp: c.ControlPlane, since: int = 0) -> list[str]:
    """Owners named in `cp`'s log lines about scheduled snapshots it took (after byte `since`)."""
    text = cp.log_path.read_text(errors="replace")[since:]
    return [match.group(1) for match in TOOK.finditer(text)]


@pytest.fixture(scope="module")
def replicas(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    # The node reports to replica 0; replica 1 is made the leader (started first) and is the one killed,
    # so the node keeps its control plane (and its lease) throughout.
    with c.start_fake_cluster(
        tmp_path_factory.mktemp("leader"), database_url=postgres.new_database(postgres_url),
        control_planes=2, node_reports_to=0, control_plane_args=("--snapshot-min-intervals", "1,1"),
    ) as made:  # fmt: skip
        yield made


def test_one_replica_takes_scheduled_snapshots_and_the_other_takes_over(replicas: c.Cluster) -> None:
    first, second = replicas.control_planes[1], replicas.control_planes[0]
    owners = [first.owner, second.owner]
    for cp in (first, second):
        cp.stop()
    for owner in owners:  # (a clean stop gives the lease up; this only makes sure of it)
        replicas.store.release_leadership(LEADER_LEASE, owner)
    _restart(first)
    c.wait_for(lambda: (replicas.store.leader(LEADER_LEASE) or None) is not None, timeout=10, what="a leader")
    _restart(second)
    leader = replicas.store.leader(LEADER_LEASE)
    assert leader is not None and leader.owner == first.owner, (leader, first.owner, second.owner)
    with replicas.sdk() as sp:
        sb = sp.sandboxes.create(
            limits=c.SMALL, snapshot_policy={"disk_every_s": 1, "tiers": [{"every_s": 3600, "for_s": 7200}]}
        )
        try:
            # (Counted in the replicas' logs: retention prunes the scheduled snapshots as fast as they come.)
            try:
                c.wait_for(lambda: len(_took(first)) >= 3, timeout=20, what="3 scheduled snapshots")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{first.log_tail()}\n{second.log_tail()}") from exc
            assert set(_took(first)) == {first.owner}, first.log_tail()
            assert _took(second) == [], second.log_tail()  # the follower took none
            held = replicas.store.leader(LEADER_LEASE)
            assert held is not None and held.owner == first.owner
            mark = second.log_path.stat().st_size
            first.signal(signal.SIGKILL)
            killed = time.monotonic()

            def taken_over() -> bool:
                holder = replicas.store.leader(LEADER_LEASE)
                return holder is not None and holder.owner == second.owner

            c.wait_for(taken_over, timeout=10 * LEASE_S, interval=0.05, what="the follower taking over")
            takeover = time.monotonic() - killed
            # The killed leader's lease ran at most LEASE_S from its last renewal; the follower claims every
            # LEASE_S / 3.
            assert takeover <= LEASE_S + LEASE_S / 3 + 0.5, f"took over after {takeover:.2f} s"
            c.wait_for(lambda: len(_took(second, mark)) >= 2, timeout=20, what="the new leader's snapshots")
            assert set(_took(second, mark)) == {second.owner}
            assert any(s.origin == "policy" for s in replicas.store.list_snapshots(sb.id))
            print(f"\ntakeover {takeover:.2f} s after the leader's SIGKILL (lease {LEASE_S} s)")
        finally:
            sb.delete()
