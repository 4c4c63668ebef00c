"""The scheduler's preference for warm pools (issue 12, scheduler.py): nodes with a pooled sandbox of the
template first, then nodes holding the template, then the rest; the count it believes is charged locally
per placement until the node's next heartbeat; a pool orders candidates but never admits a node without
room (pooled sandboxes are not in `used`: they give way). And what a heartbeat may say about pools
(api/node_routes.py): parsed, bounded, only for the node's own templates, only by the node itself."""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from space.controlplane import scheduler
from space.controlplane.api.app import create_app
from space.controlplane.api.node_routes import MAX_POOL_COUNT, MAX_POOL_TEMPLATES
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.records import NodeRecord
from space.controlplane.store.store import Store, open_store
from space.core import errors
from space.core.lifecycle import State
from space.core.settings import SandboxLimits

T0 = datetime(2026, 1, 1, tzinfo=UTC)
BIG = {"cpus": 8.0, "memory_mb": 65536, "sandboxes": 1000}


def node(
    node_id: str, *, memory_free: int = 32768, templates: tuple[str, ...] = ("python",),
    pools: dict[str, int] | None = None, used: dict[str, Any] | None = None, beat: datetime = T0,
) -> NodeRecord:  # fmt: skip
    used = used if used is not None else {"memory_mb": BIG["memory_mb"] - memory_free}
    return NodeRecord(node_id, f"http://{node_id}.test", dict(BIG), used, list(templates), {}, "ready",
                      beat, T0, pools=pools)  # fmt: skip


def sandbox(sandbox_id: str = "sb-new", template: str = "python", disk_mb: int = 100) -> Any:
    return SimpleNamespace(id=sandbox_id, template=template, state=State.PENDING, isolation="gvisor",
                           limits=SandboxLimits(cpus=0.5, memory_mb=256, disk_mb=disk_mb))  # fmt: skip


@dataclass
class FakeStore:
    nodes: list[NodeRecord]
    placed: dict[str, list[Any]] = field(default_factory=dict)

    def list_nodes(self, status: str | None) -> list[NodeRecord]:
        return [n for n in self.nodes if status is None or n.status == status]

    def placed_disk_mb(self, node_id: str, *, besides: str | None = None) -> int:
        return sum(sb.limits.disk_mb for sb in self.placed.get(node_id, []) if sb.id != besides)


def choose(store: FakeStore, ledger: scheduler.PoolLedger | None, sb: Any = None) -> str:
    return scheduler.choose_node(store, sb or sandbox(), pools=ledger)  # type: ignore[arg-type]


def test_pooled_nodes_come_first_then_nodes_with_the_template_then_the_rest() -> None:
    # Free memory would order them the other way round: the tiers decide before it does.
    store = FakeStore([
        node("bare", memory_free=60000, templates=()),
        node("template", memory_free=40000),
        node("pooled", memory_free=1000, pools={"python": 1}),
    ])  # fmt: skip
    ledger = scheduler.PoolLedger()
    assert choose(store, ledger) == "pooled"
    assert choose(store, ledger) == "template"  # its one pooled sandbox is taken: believed 0 now
    store.nodes[1:] = [replace(n, templates=[]) for n in store.nodes[1:]]
    assert choose(store, ledger) == "bare"  # no template nor pool anywhere: the most free memory
    # Another template's pool is no reason to go there.
    assert choose(store, scheduler.PoolLedger(), sandbox(template="node")) == "bare"


def test_without_a_ledger_pools_are_not_considered() -> None:
    """Restores and recoveries (no `pools`) restore a checkpoint: a pooled sandbox does not help them."""
    store = FakeStore(
        [node("pooled", memory_free=1000, pools={"python": 5}), node("roomy", memory_free=9000)]
    )
    assert choose(store, None) == "roomy"


def test_eight_concurrent_creates_spread_over_the_pools_and_are_charged_once_each() -> None:
    store = FakeStore([
        node("a", memory_free=30000, pools={"python": 1}),
        node("b", memory_free=20000, pools={"python": 2}),
        node("c", memory_free=10000, pools={"python": 1}),
    ])  # fmt: skip
    ledger = scheduler.PoolLedger()
    chosen: list[str] = []
    start = threading.Barrier(8)

    def create(i: int) -> None:
        start.wait()
        chosen.append(choose(store, ledger, sandbox(f"sb-{i}")))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # 4 pooled sandboxes in all: each bound once; the other 4 creates go by template and free memory (a).
    assert {n: taken[1] for n, taken in ledger.taken.items()} == {
        "a": {"python": 1}, "b": {"python": 2}, "c": {"python": 1}
    }  # fmt: skip
    assert Counter(chosen) == {"a": 1 + 4, "b": 2, "c": 1}


def test_a_newer_heartbeat_replaces_the_belief() -> None:
    store = FakeStore([node("a", pools={"python": 1}), node("b", memory_free=60000)])
    ledger = scheduler.PoolLedger()
    assert choose(store, ledger) == "a"
    assert choose(store, ledger) == "b"  # a's one is taken until it reports again
    store.nodes[0] = replace(store.nodes[0], last_heartbeat_at=T0 + timedelta(seconds=2), pools={"python": 2})
    assert [choose(store, ledger) for _ in range(3)] == ["a", "a", "b"]


def test_a_pool_never_admits_a_node_without_room() -> None:
    """Pooled sandboxes are not in a node's `used` (they give way to placements, ADR 0047): a node whose
    sandboxes fill it is refused even with a believed pooled sandbox, a node whose only load is its pool
    takes any placement, and disk is judged for every node."""
    full = {"memory_mb": BIG["memory_mb"], "sandboxes": BIG["sandboxes"], "cpus": BIG["cpus"] * 4}
    with pytest.raises(errors.ResourceExhausted):
        choose(FakeStore([node("full-with-pool", used=full, pools={"python": 1})]), scheduler.PoolLedger())
    assert choose(
        FakeStore([node("only-its-pool", used={}, pools={"python": 4})]), scheduler.PoolLedger()
    ) == ("only-its-pool")
    disk = {**BIG, "disk_mb": 1000, "disk_free_mb": 1000, "disk_reserve_mb": 0}
    small = replace(node("small-disk", pools={"python": 3}), capacity=disk)
    with pytest.raises(errors.ResourceExhausted):
        choose(FakeStore([small]), scheduler.PoolLedger(), sandbox(disk_mb=1001))


def test_counts_below_zero_are_believed_as_none() -> None:
    ledger = scheduler.PoolLedger()
    assert ledger.believed(node("a", pools={"python": -5}), "python") == 0
    assert ledger.believed(node("a", pools=None), "python") == 0


# -- what a heartbeat may say about pools -------------------------------------------------------------------
BOOTSTRAP = "b" * 40


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, TestClient]]:
    """One control plane for the module (each test enrols nodes of its own)."""
    root = tmp_path_factory.mktemp("pools-cp")
    store = open_store(sqlite_url(root / "cp"))
    app = create_app(store, node_token=BOOTSTRAP, run_reconciler=False, data_dir=root,
                     settings=ControlPlaneSettings.from_env({}))  # fmt: skip
    try:
        with TestClient(app) as client:
            yield store, client
    finally:
        store.close()


def enrol(client: TestClient) -> tuple[str, str]:
    body = {"url": f"http://127.0.0.1:1/{secrets.token_hex(6)}", "token": secrets.token_urlsafe(24),
            "capacity": {"cpus": 1, "memory_mb": 640}, "templates": ["python"]}  # fmt: skip
    answer = client.post("/v1/nodes/register", json=body, headers={"Authorization": f"Bearer {BOOTSTRAP}"})
    assert answer.status_code == 200, answer.text
    return str(answer.json()["node_id"]), str(answer.json()["identity"])


def beat(client: TestClient, node_id: str, identity: str, pools: Any, **extra: Any) -> int:
    body = {"templates": ["python", "node"], "capacity": {"cpus": 1, "memory_mb": 640}, "used": {},
            "sandboxes": [], "pools": pools, **extra}  # fmt: skip
    answer = client.post(f"/v1/nodes/{node_id}/heartbeat", json=body,
                         headers={"Authorization": f"Bearer {identity}"})  # fmt: skip
    return answer.status_code


def pools_of(store: Store, node_id: str) -> dict[str, int] | None:
    record = store.get_node(node_id)
    assert record is not None
    return record.pools


def test_a_heartbeat_records_its_pools(cp: tuple[Store, TestClient]) -> None:
    store, client = cp
    node_id, identity = enrol(client)
    assert pools_of(store, node_id) is None  # not reported yet
    assert beat(client, node_id, identity, {"python": 3, "node": 0}) == 200
    assert pools_of(store, node_id) == {"python": 3, "node": 0}
    assert beat(client, node_id, identity, None) == 200  # an agent that reports none keeps the last
    assert pools_of(store, node_id) == {"python": 3, "node": 0}


@pytest.mark.parametrize(
    ("pools", "recorded"),
    [
        ({"python": -4, "node": 2}, {"python": 0, "node": 2}),  # negative: none ready
        ({"python": 10**30}, {"python": MAX_POOL_COUNT}),  # absurd: clamped
        ({"python": True, "node": 1.5}, {}),  # not integers
        ({"python": "3"}, {}),
        ({"rust": 2, "python": 1}, {"python": 1}),  # a template the node does not report holding
        ({"Python": 1, "../x": 1, "": 1, "a" * 70: 1}, {}),  # not template names
        ([["python", 3]], {}),  # not a map
        ("python", {}),
        ({f"t{i}": 1 for i in range(MAX_POOL_TEMPLATES + 1)}, {}),  # a huge map: nothing believed
    ],
)
def test_a_heartbeat_cannot_make_the_scheduler_believe_nonsense(
    cp: tuple[Store, TestClient], pools: Any, recorded: dict[str, int]
) -> None:
    store, client = cp
    node_id, identity = enrol(client)
    assert beat(client, node_id, identity, pools) == 200  # the heartbeat itself still counts
    assert pools_of(store, node_id) == recorded


def test_a_node_cannot_report_pools_for_another_node(cp: tuple[Store, TestClient]) -> None:
    store, client = cp
    victim, _victim_identity = enrol(client)
    _attacker, attacker_identity = enrol(client)
    assert beat(client, victim, attacker_identity, {"python": 50}) == 401
    assert beat(client, victim, BOOTSTRAP, {"python": 50}) == 401  # nor with the cluster's bootstrap token
    assert pools_of(store, victim) is None


def test_a_pools_map_of_thousands_of_templates_is_believed_as_none(cp: tuple[Store, TestClient]) -> None:
    store, client = cp
    node_id, identity = enrol(client)
    assert beat(client, node_id, identity, {"python": 1}) == 200
    huge = {f"t{i}": i for i in range(5000)} | {"python": 7}
    assert beat(client, node_id, identity, huge, templates=["python", *huge]) == 200
    assert pools_of(store, node_id) == {}
