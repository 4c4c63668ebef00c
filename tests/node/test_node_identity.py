"""space.node.agent.identity: the node's identity is read per request, so one client follows every
(re-)registration; before the first one, requests carry no credentials at all."""

from __future__ import annotations

import httpx
import pytest

from space.node.agent.identity import IdentityAuth, NodeIdentity


def test_the_client_presents_the_current_identity() -> None:
    seen: list[str | None] = []

    def control_plane(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200)

    identity = NodeIdentity()
    with httpx.Client(auth=IdentityAuth(identity), transport=httpx.MockTransport(control_plane)) as http:
        http.get("http://cp/x")
        identity.set("node-a", "first")
        http.get("http://cp/x")
        identity.set("node-a", "second")  # registered again: rotated
        http.get("http://cp/x")
    assert seen == [None, "Bearer first", "Bearer second"]
    assert identity.current_node_id() == "node-a"
    assert "second" not in repr(identity)  # never in logs by accident


@pytest.mark.parametrize(("node_id", "secret"), [("", "s"), ("node-a", "")])
def test_an_identity_needs_both_parts(node_id: str, secret: str) -> None:
    identity = NodeIdentity("node-a", "old")
    with pytest.raises(ValueError, match="node id and a secret"):
        identity.set(node_id, secret)
    assert (identity.node_id, identity.secret) == ("node-a", "old")
