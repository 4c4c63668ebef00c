"""One bootstrap token no longer rules the cluster (issue 9, item 4; ADR 0021), attacked through the real
control plane and real fake-driver node processes of a cluster of its own (it enrols extra nodes, which
other modules' clusters must not see):

- the bootstrap token (or an enrolment token) enrols NEW nodes only: re-registering another node's url with
  it is a 409, re-registering another node's id with it is a 401, and the victim keeps its id, identity,
  RPC token and sandboxes;
- each node's RPC accepts only that node's own token: not the bootstrap token, not another node's token;
- enrolment tokens are single-use (or N-use), expire, and are stored hashed;
- a restarted node keeps its id and identity, also at a new address, without the bootstrap token;
- node-facing calls for a sandbox not assigned to the calling node change nothing and hand out nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pathlib
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from space.controlplane.nodes import NodePool, RpcTokenSeal
from space.core import errors
from space.node.agent.identity import default_identity_file, default_rpc_token_file, identity_dir
from tests.support import cluster as c
from tests.support import node_identity as ni


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    with c.start_fake_cluster(tmp_path_factory.mktemp("node-enrolment"), nodes=2) as made:
        yield made


@pytest.fixture
def project(cluster: c.Cluster) -> Iterator[c.Project]:
    made = c.new_project(cluster)
    try:
        yield made
    finally:
        c.delete_all(cluster, made)


def error(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    body = answer.json()["error"]
    assert body["code"] == code, answer.text
    return dict(body)


def node_id_of(cluster: c.Cluster, node: c.FakeNode) -> str:
    (record,) = [n for n in cluster.store.list_nodes(None) if n.url == node.url]
    return record.id


def spare_url() -> str:
    return f"http://127.0.0.1:1/{secrets.token_hex(6)}"


def enrolled(cluster: c.Cluster, url: str | None = None, **kw: Any) -> tuple[str, str]:
    """A node enrolled through the API (nothing listens at its url), kept away from the scheduler."""
    node_id, identity = ni.register(cluster, url or spare_url(), **kw)
    cluster.store.set_node_status(node_id, "draining")
    return node_id, identity


def sandbox_on(cluster: c.Cluster, project: c.Project, node: c.FakeNode) -> dict[str, Any]:
    """A running sandbox placed on `node` (the cluster's other node drains meanwhile)."""
    others = [n for n in cluster.nodes if n is not node]
    for other in others:
        cluster.store.set_node_status(node_id_of(cluster, other), "draining")
    try:
        answer = project.http().post("/v1/sandboxes", json={"limits": c.SMALL})
        assert answer.status_code == 201, answer.text
    finally:
        for other in others:
            cluster.store.set_node_status(node_id_of(cluster, other), "ready")
    made = dict(answer.json())
    assert made["node_id"] == node_id_of(cluster, node) and made["state"] == "running", made
    return made


def runs(project: c.Project, sandbox_id: str) -> None:
    answer = project.http().post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "echo alive"})
    assert answer.status_code == 200 and answer.json()["stdout"] == "alive\n", answer.text


def heartbeat_after(cluster: c.Cluster, node_id: str, when: datetime) -> None:
    def beat() -> bool:
        record = cluster.store.get_node(node_id)
        return record is not None and record.last_heartbeat_at > when

    c.wait_for(beat, timeout=15, what=f"a heartbeat of {node_id}")


# -- taking over another node --------------------------------------------------------------------------------
def test_another_nodes_url_cannot_be_taken_over_with_the_bootstrap_token(
    cluster: c.Cluster, project: c.Project
) -> None:
    victim = cluster.node
    victim_id, victim_identity = victim.identity
    before = cluster.store.get_node(victim_id)
    endpoint = cluster.store.node_endpoint(victim_id)
    assert before is not None and endpoint is not None and before.url == victim.url
    sandbox = sandbox_on(cluster, project, victim)
    bootstrap = cluster.node.token
    _id, enrolment = cluster.store.create_enrolment_token(uses=1)

    # Enrolling the victim's url again, with the cluster token or an enrolment token: 409, typed.
    for token in (bootstrap, enrolment):
        huge = {"cpus": 512, "memory_mb": 1 << 22}  # would attract every new sandbox
        body = error(ni.enrol(cluster, victim.url, bootstrap=token, capacity=huge), 409, "already_exists")
        assert body["details"]["field"] == "url" and victim_id in body["message"]
    assert cluster.store.enrolment_token_usable(enrolment), "a refused enrolment used the token up"
    # Re-registering the victim's node id needs the victim's identity: the bootstrap token, an enrolment
    # token, another node's identity, an API key or nothing are 401, whatever url they name.
    other_id, other_identity = enrolled(cluster)
    for credential in (bootstrap, enrolment, other_identity, cluster.admin_key, "", None):
        for url in (victim.url, spare_url()):
            error(ni.reregister(cluster, victim_id, credential, url), 401, "unauthenticated")
    # A node that proves its own identity still cannot move onto the victim's url.
    error(ni.reregister(cluster, other_id, other_identity, victim.url), 409, "already_exists")
    # An alias of the victim's address is another url: it enrols as a node of its own, whose RPC token the
    # victim's agent refuses, so the control plane can do nothing to the victim through it.
    alias_url = victim.url + "/"
    alias_id, _alias_identity = enrolled(cluster, alias_url)
    assert alias_id != victim_id

    async def through_alias() -> None:
        pool = NodePool(cluster.store, cluster.node.token)  # as the control plane builds it
        try:
            await pool.client(alias_id).info()
        finally:
            await pool.aclose()

    with pytest.raises(errors.Unauthenticated):
        asyncio.run(through_alias())

    # The victim is untouched: same id, url, identity, RPC token; it keeps heartbeating and serving.
    after = cluster.store.get_node(victim_id)
    assert after is not None and (after.id, after.url, after.status) == (victim_id, victim.url, "ready")
    assert cluster.store.node_endpoint(victim_id) == endpoint
    assert victim.identity == (victim_id, victim_identity)
    assert cluster.store.authenticate_node(victim_id, victim_identity) is not None
    heartbeat_after(cluster, victim_id, after.last_heartbeat_at)
    runs(project, sandbox["id"])
    record = cluster.store.load_sandbox(sandbox["id"])
    assert record is not None and record.node_id == victim_id and record.crash_count == 0


def test_a_node_from_before_per_node_rpc_tokens_is_adopted_at_its_url_once(cluster: c.Cluster) -> None:
    """Upgrade path: a record without a sealed RPC token (its node kept its identity in memory only) is
    taken by the first enrolment at its url, which keeps its id; from then on only its identity works."""
    url = spare_url()
    legacy = cluster.store.register_node(url, "the-old-cluster-token", capacity={"cpus": 1, "memory_mb": 64})
    cluster.store.set_node_status(legacy.id, "lost")
    assert cluster.store.node_endpoint(legacy.id) == (url, None)
    node_id, identity = enrolled(cluster, url)
    assert node_id == legacy.id
    endpoint = cluster.store.node_endpoint(node_id)
    assert endpoint is not None and endpoint[1] is not None
    error(ni.enrol(cluster, url), 409, "already_exists")
    answer = ni.reregister(cluster, node_id, identity, url)
    assert answer.status_code == 200 and answer.json()["node_id"] == node_id, answer.text
    cluster.store.set_node_status(node_id, "draining")


# -- the node's RPC ------------------------------------------------------------------------------------------
def test_a_nodes_rpc_accepts_only_its_own_token(cluster: c.Cluster) -> None:
    first, second = cluster.nodes
    assert first.rpc_token != second.rpc_token
    for node, other in ((first, second), (second, first)):
        _node_id, identity = node.identity

        def info(token: str | None, target: c.FakeNode = node) -> httpx.Response:
            headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
            return httpx.get(f"{target.url}/node/v1/info", headers=headers, timeout=10)

        assert info(node.rpc_token).status_code == 200
        for wrong in (cluster.node.token, other.rpc_token, identity, cluster.admin_key, None):
            error(info(wrong), 401, "unauthenticated")
        # Not on any route, known or not.
        for path in ("/node/v1/sandboxes", "/node/v1/nope", "/"):
            answer = httpx.get(
                f"{node.url}{path}", headers={"Authorization": f"Bearer {cluster.node.token}"}, timeout=10
            )
            error(answer, 401, "unauthenticated")
        # Kept owner-only in the node's data directory.
        assert identity_dir(node.data_dir).stat().st_mode & 0o777 == 0o700
        for path in (default_rpc_token_file(node.data_dir), default_identity_file(node.data_dir)):
            assert path.stat().st_mode & 0o777 == 0o600, path
            assert path.stat().st_uid == os.geteuid()
    # The control plane keeps the RPC tokens sealed: no token, identity or bootstrap token in the table.
    with cluster.store.engine.connect() as db:
        dumped = repr(db.exec_driver_sql("SELECT * FROM nodes").all())
    for secret in (
        first.rpc_token,
        second.rpc_token,
        first.identity[1],
        second.identity[1],
        cluster.node.token,
    ):
        assert secret not in dumped


def test_a_sealed_rpc_token_opens_only_for_its_node_and_cluster() -> None:
    seal = RpcTokenSeal("cluster-token-" + secrets.token_hex(8))
    sealed = seal.seal("node-a", "the-rpc-token-of-a")
    assert b"the-rpc-token-of-a" not in sealed
    assert seal.open("node-a", sealed) == "the-rpc-token-of-a"
    with pytest.raises(errors.Unavailable):
        seal.open("node-b", sealed)  # copied onto another node's row
    with pytest.raises(errors.Unavailable):
        RpcTokenSeal("another-cluster-token").open("node-a", sealed)
    with pytest.raises(errors.Unavailable):
        seal.open("node-a", sealed[:-1] + bytes([sealed[-1] ^ 1]))


# -- enrolment tokens ----------------------------------------------------------------------------------------
def enrolment_token_cli(cluster: c.Cluster, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "space.controlplane.enrolment", "--database-url", cluster.database_url, *args],
        capture_output=True, text=True, timeout=60, check=False, cwd=c.REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    token = done.stdout.strip()
    assert token.startswith("enrol_") and len(token) > 40, done.stdout
    return token


def test_a_single_use_enrolment_token_enrols_once(cluster: c.Cluster) -> None:
    once = enrolment_token_cli(cluster, "--uses", "1")
    enrolled(cluster, bootstrap=once)
    error(ni.enrol(cluster, spare_url(), bootstrap=once), 401, "unauthenticated")
    twice = enrolment_token_cli(cluster, "--uses", "2", "--ttl", "600")
    # A refused enrolment (the url is held) uses nothing.
    error(ni.enrol(cluster, cluster.node.url, bootstrap=twice), 409, "already_exists")
    enrolled(cluster, bootstrap=twice)
    enrolled(cluster, bootstrap=twice)
    error(ni.enrol(cluster, spare_url(), bootstrap=twice), 401, "unauthenticated")
    # Expired: refused without a use.
    _id, expired = cluster.store.create_enrolment_token(uses=5, ttl_s=0)
    error(ni.enrol(cluster, spare_url(), bootstrap=expired), 401, "unauthenticated")
    # Made up, or an enrolment token's prefix: refused.
    for wrong in ("enrol_" + secrets.token_urlsafe(30), once[:-1]):
        error(ni.enrol(cluster, spare_url(), bootstrap=wrong), 401, "unauthenticated")
    # Concurrent use of a single-use token: exactly one enrolment.
    racing = enrolment_token_cli(cluster)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _i: ni.enrol(cluster, spare_url(), bootstrap=racing), range(6)))
    assert sorted(a.status_code for a in answers) == [200, 401, 401, 401, 401, 401], [a.text for a in answers]
    for answer in answers:
        if answer.status_code == 200:
            cluster.store.set_node_status(answer.json()["node_id"], "draining")
    # Stored hashed only.
    with cluster.store.engine.connect() as db:
        dumped = repr(db.exec_driver_sql("SELECT * FROM enrolment_tokens").all())
    for secret in (once, twice, expired, racing):
        assert secret not in dumped


def test_a_node_enrolled_with_a_token_restarts_at_a_new_address_without_it(cluster: c.Cluster) -> None:
    data_dir = cluster.root / "enrolled-node"
    data_dir.mkdir()
    token_file = cluster.root / "enrolled-node.token"
    token_file.write_text(enrolment_token_cli(cluster) + "\n")
    token_file.chmod(0o600)
    first = c.FakeNode(data_dir, token_file, cluster.url, name="enrolled")
    second: c.FakeNode | None = None
    try:
        first.start()

        def registered() -> str | None:
            first.check_alive()
            found = [n for n in cluster.store.list_nodes(None) if n.url == first.url and n.status == "ready"]
            # The control plane records the node before it answers; the node persists the answer after.
            if not found or not default_identity_file(data_dir).exists():
                return None
            return found[0].id

        node_id = c.wait_for(registered, timeout=60, what="the node enrolled with its enrolment token")
        cluster.store.set_node_status(node_id, "draining")  # never scheduled onto
        assert first.identity[0] == node_id
        identity = first.identity[1]
        rpc_token = first.rpc_token
        first.stop()
        # The token is used up (and now gone): the restarted node needs only what it keeps itself.
        token_file.write_text("used-up-and-forgotten\n")
        second = c.FakeNode(data_dir, token_file, cluster.url, name="enrolled")
        assert second.url != first.url
        before = datetime.now(UTC) - timedelta(seconds=1)
        second.start()

        def moved() -> bool:
            second.check_alive()  # type: ignore[union-attr]
            record = cluster.store.get_node(node_id)
            return record is not None and record.url == second.url and record.last_heartbeat_at > before  # type: ignore[union-attr]

        c.wait_for(moved, timeout=60, what="the restarted node re-registered at its new address")
        # One node, same id and identity, old url released; the control plane reaches it at the new one.
        assert [n.id for n in cluster.store.list_nodes(None) if n.url in (first.url, second.url)] == [node_id]
        assert second.identity == (node_id, identity) and second.rpc_token == rpc_token
        assert cluster.store.authenticate_node(node_id, identity) is not None
        answer = httpx.get(
            f"{second.url}/node/v1/info", headers={"Authorization": f"Bearer {rpc_token}"}, timeout=10
        )
        assert answer.status_code == 200, answer.text
    finally:
        first.stop()
        if second is not None:
            second.stop()


# -- calls for sandboxes assigned elsewhere ------------------------------------------------------------------
def test_node_calls_for_a_sandbox_assigned_elsewhere_change_nothing(
    cluster: c.Cluster, project: c.Project
) -> None:
    owner = cluster.node
    owner_id, _ = owner.identity
    sandbox = sandbox_on(cluster, project, owner)
    before = cluster.store.load_sandbox(sandbox["id"])
    assert before is not None and before.node_id == owner_id
    other_id, other_identity = enrolled(cluster)
    # Credentials: 403, as itself; as the owner (with its own identity): 401.
    error(ni.fetch(cluster, other_id, sandbox["id"], other_identity), 403, "permission_denied")
    error(ni.fetch(cluster, owner_id, sandbox["id"], other_identity), 401, "unauthenticated")
    # Audit: nothing recorded for a sandbox that is not its own.
    event = {"sandbox_id": sandbox["id"], "action": "injected", "credential": "x", "at": time.time()}
    answer = ni.audit(cluster, other_id, other_identity, [event])
    assert answer.status_code == 200 and answer.json() == {"accepted": 0, "rejected": 1}, answer.text
    # A heartbeat reporting the sandbox as crashed, with fresh activity: accepted, and nothing changes.
    future = time.time() + 3600
    beat = {
        "time": time.time(), "sandbox_count": 1, "templates": [],
        "sandboxes": [{"id": sandbox["id"], "state": "crashed", "last_activity_at": future}],
    }  # fmt: skip
    answer = ni.client(cluster, other_identity).post(f"/v1/nodes/{other_id}/heartbeat", json=beat)
    assert answer.status_code == 200, answer.text
    time.sleep(1.0)  # a reconciler round: a crash report it acted on would show by now
    after = cluster.store.load_sandbox(sandbox["id"])
    assert after is not None
    assert (after.state.value, after.node_id, after.crash_count) == ("running", owner_id, 0)
    assert after.last_activity_at < datetime.fromtimestamp(future, UTC) - timedelta(minutes=30)
    runs(project, sandbox["id"])


# -- the registration body -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "file:///etc/passwd"}, "url"),
        ({"url": "http://user:pw@127.0.0.1:1"}, "url"),
        ({"url": "http://127.0.0.1:1/?x=1"}, "url"),
        ({"url": "http://127.0.0.1:1/#x"}, "url"),
        ({"url": "ftp://127.0.0.1:1"}, "url"),
        ({"url": "http://"}, "url"),
        ({"url": ""}, "url"),
        ({"url": 5}, "url"),
        ({"url": "http://127.0.0.1:1/" + "a" * 600}, "url"),
        ({"token": "short"}, "token"),
        ({"token": None}, "token"),
        ({"token": "x" * 300}, "token"),
        ({"capacity": {"memory_mb": "lots"}}, "capacity"),
        ({"capacity": ["not", "a", "map"]}, "capacity"),
    ],
)
def test_registration_bodies_are_checked(cluster: c.Cluster, body: dict[str, Any], field: str) -> None:
    full = {"url": spare_url(), "token": secrets.token_urlsafe(24), "capacity": {"cpus": 1, "memory_mb": 64}}
    full.update(body)
    answer = cluster.http(cluster.node.token).post("/v1/nodes/register", json=full)
    assert error(answer, 400, "invalid_argument")["details"]["field"] == field
    # The same checks on re-registration.
    node_id, identity = cluster.nodes[1].identity
    if field != "capacity" or isinstance(body.get("capacity"), dict):
        answer = ni.client(cluster, identity).post(f"/v1/nodes/{node_id}/register", json=full)
        assert error(answer, 400, "invalid_argument")["details"]["field"] == field


def test_registration_refuses_before_reading_and_never_fails_on_odd_tokens(cluster: c.Cluster) -> None:
    client = cluster.http()
    for auth in ("Bearer ünïcode".encode(), b"Bearer " + b"x" * 10_000, b"Basic abc", b"Bearer"):
        headers = {"Authorization": auth, "Content-Type": b"application/json"}
        answer = client.post("/v1/nodes/register", content=b"{}", headers=headers)
        error(answer, 401, "unauthenticated")
    answer = cluster.http(cluster.node.token).post("/v1/nodes/register", content=b"not json")
    error(answer, 400, "invalid_argument")


def test_an_agent_refuses_to_serve_its_rpc_with_the_bootstrap_token(tmp_path: pathlib.Path) -> None:
    token_file = tmp_path / "node.token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    done = subprocess.run(
        [sys.executable, "-m", "space.node.agent.server", "--driver", "fake", "--data-dir", str(tmp_path),
         "--listen", f"127.0.0.1:{c.free_port()}", "--rpc-token-file", str(token_file),
         "--bootstrap-token-file", str(token_file), "--control-plane", "http://127.0.0.1:9", "--no-prepare"],
        capture_output=True, text=True, timeout=60, check=False, cwd=c.REPO,
    )  # fmt: skip
    assert done.returncode != 0
    assert "must not be the bootstrap token" in done.stderr, done.stderr[-2000:]
