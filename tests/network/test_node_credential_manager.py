"""The node's credential manager against a scripted control plane (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from space.node.agent.credential_manager import AuditForwarder, ControlPlaneCredentials, audit_action

SANDBOX = "sb-" + "a" * 26
NODE = "node-" + "b" * 26


class ScriptedControlPlane:
    def __init__(self) -> None:
        self.fetches = 0
        self.status = 200
        self.credentials: list[dict[str, Any]] = [self.credential("gh")]
        self.audit_batches: list[list[dict[str, Any]]] = []
        self.audit_status = 200

    @staticmethod
    def credential(name: str, **extra: Any) -> dict[str, Any]:
        return {
            "name": name, "scope": "project", "value": f"secret-value-of-{name}",
            "hosts": ["api.example.com"],
            "method": "bearer", "header_name": "Authorization", "header_template": "Bearer {value}",
            "query_param": None, "placeholder": f"space-cred-{name}-0123456789abcdef", "expires_at": None,
            "rate_per_minute": None, "version": 1,
        } | extra  # fmt: skip

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer node-token"
        if request.url.path == f"/v1/nodes/{NODE}/sandboxes/{SANDBOX}/credentials":
            self.fetches += 1
            if self.status != 200:
                body = {"error": {"code": "permission_denied", "message": "not assigned", "details": {}}}
                return httpx.Response(self.status, json=body)
            policy = {"allow": ["api.example.com"], "deny": [], "version": 3}
            answer: dict[str, Any] = {"sandbox_id": SANDBOX, "policy": policy}
            answer["credentials"] = self.credentials
            return httpx.Response(200, json=answer | {"missing": [], "expired": []})
        if request.url.path == f"/v1/nodes/{NODE}/audit":
            self.audit_batches.append(json.loads(request.content)["events"])
            return httpx.Response(self.audit_status, json={"accepted": 1, "rejected": 0})
        return httpx.Response(404)


@pytest.fixture
def cp() -> ScriptedControlPlane:
    return ScriptedControlPlane()


def client(cp: ScriptedControlPlane) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url="http://cp.invalid", transport=httpx.MockTransport(cp.handle),
        headers={"Authorization": "Bearer node-token"},
    )  # fmt: skip


def test_credentials_are_fetched_once_then_served_from_the_cache(cp: ScriptedControlPlane) -> None:
    async def run() -> None:
        manager = ControlPlaneCredentials(client(cp), lambda: NODE, max_age_s=60)
        first = await manager.credentials(SANDBOX)
        again = await manager.credentials(SANDBOX)
        assert [c.name for c in first] == ["gh"] and again == first
        assert first[0].value == "secret-value-of-gh"
        assert first[0].placeholder == "space-cred-gh-0123456789abcdef"
        assert (await manager.policy(SANDBOX))["version"] == 3
        assert cp.fetches == 1
        manager.forget(SANDBOX)  # a pushed policy change drops the cache at once
        await manager.credentials(SANDBOX)
        assert cp.fetches == 2

    asyncio.run(run())


def test_concurrent_askers_share_one_fetch(cp: ScriptedControlPlane) -> None:
    async def run() -> None:
        manager = ControlPlaneCredentials(client(cp), lambda: NODE)
        results = await asyncio.gather(*(manager.credentials(SANDBOX) for _ in range(20)))
        assert all(len(r) == 1 for r in results)
        assert cp.fetches == 1

    asyncio.run(run())


def test_expired_credentials_are_dropped_and_near_expiry_shortens_the_cache(cp: ScriptedControlPlane) -> None:
    now = datetime.now(UTC)
    cp.credentials = [
        cp.credential("old", expires_at=(now - timedelta(seconds=5)).isoformat()),
        cp.credential("soon", expires_at=(now + timedelta(seconds=0.3)).isoformat()),
    ]

    async def run() -> None:
        manager = ControlPlaneCredentials(client(cp), lambda: NODE, max_age_s=60)
        assert [c.name for c in await manager.credentials(SANDBOX)] == ["soon"]
        await asyncio.sleep(0.4)
        assert await manager.credentials(SANDBOX) == []  # refetched: "soon" has expired meanwhile
        assert cp.fetches == 2

    asyncio.run(run())


def test_refusal_or_no_registration_means_no_credentials(cp: ScriptedControlPlane) -> None:
    cp.status = 403

    async def run() -> None:
        assert await ControlPlaneCredentials(client(cp), lambda: NODE).credentials(SANDBOX) == []
        assert await ControlPlaneCredentials(client(cp), lambda: None).credentials(SANDBOX) == []

    asyncio.run(run())
    assert cp.fetches == 1


def test_an_unusable_credential_is_skipped_without_logging_its_value(
    cp: ScriptedControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    # A value of the wrong type fails Credential's validation, whose message quotes the input: the value.
    cp.credentials = [cp.credential("bad", value=987654321), cp.credential("gh")]

    async def run() -> None:
        manager = ControlPlaneCredentials(client(cp), lambda: NODE)
        assert [c.name for c in await manager.credentials(SANDBOX)] == ["gh"]

    with caplog.at_level("WARNING", logger="space.node.agent.credential_manager"):
        asyncio.run(run())
    assert "unusable credential" in caplog.text and "value: Input should be a valid string" in caplog.text
    assert "987654321" not in caplog.text and "secret-value-of" not in caplog.text


@pytest.mark.parametrize(
    ("record", "action"),
    [
        ({"event": "credential", "decision": "injected"}, "injected"),
        ({"event": "credential", "decision": "rate_limited"}, "rate_limited"),
        ({"event": "credential", "decision": "not_replaced_unbound_host"}, "placeholder_blocked"),
        ({"event": "credential", "decision": "something_new"}, "denied"),
        ({"event": "egress", "decision": "denied"}, "egress_denied"),
        ({"event": "egress", "decision": "refused"}, "egress_denied"),
        ({"event": "egress", "decision": "allowed"}, None),
        ({"event": "dns", "decision": "answered"}, None),
    ],
)
def test_gateway_records_map_to_control_plane_actions(record: dict[str, Any], action: str | None) -> None:
    assert audit_action(record) == action


def test_audit_events_are_forwarded_in_batches_and_kept_on_server_errors(cp: ScriptedControlPlane) -> None:
    async def run() -> None:
        forwarder = AuditForwarder(client(cp), lambda: NODE, max_queue=3)
        for i in range(5):
            forwarder({"event": "credential", "decision": "injected", "sandbox_id": SANDBOX,
                       "credential": "gh", "host": f"h{i}.example.com", "ts": 1.0, "port": 443})  # fmt: skip
        forwarder({"event": "egress", "decision": "allowed", "sandbox_id": SANDBOX, "host": "x"})
        assert forwarder.dropped == 2
        cp.audit_status = 503
        with pytest.raises(Exception, match="503"):
            await forwarder.flush()
        cp.audit_status = 200
        await forwarder.flush()
        await forwarder.flush()

    asyncio.run(run())
    delivered = cp.audit_batches[-1]
    assert [e["host"] for e in delivered] == ["h2.example.com", "h3.example.com", "h4.example.com"]
    assert delivered[0]["action"] == "injected" and delivered[0]["detail"] == {
        "decision": "injected",
        "port": 443,
    }
    assert (
        len(cp.audit_batches) == 2
    )  # the failed post, then one successful batch; the empty flush posts nothing


def test_events_arriving_during_a_post_to_a_full_queue_are_still_sent() -> None:
    batches: list[list[str]] = []

    def event(host: str) -> dict[str, Any]:
        return {"event": "egress", "decision": "denied", "sandbox_id": SANDBOX, "host": host}

    def handle(request: httpx.Request) -> httpx.Response:
        events = json.loads(request.content)["events"]
        batches.append([e["host"] for e in events])
        if len(batches) == 1:  # while the first batch is in flight, the queue (3) fills with new events
            for i in range(3):
                forwarder(event(f"new{i}.test"))
        return httpx.Response(200, json={"accepted": len(events), "rejected": 0})

    http = httpx.AsyncClient(base_url="http://cp.invalid", transport=httpx.MockTransport(handle))
    forwarder = AuditForwarder(http, lambda: NODE, max_queue=3)
    for i in range(3):
        forwarder(event(f"old{i}.test"))
    asyncio.run(forwarder.flush())
    assert batches == [["old0.test", "old1.test", "old2.test"], ["new0.test", "new1.test", "new2.test"]]
    assert forwarder.dropped == 3  # the sent ones, pushed out of the full queue (counted, never resent)
