"""Raw node-RPC requests from tests, signed the way the control plane signs them.

The node wants, on every sandbox-scoped route, an `X-Space-Capability` for that sandbox (core.capability)
besides the node token. Production code mints it from the sandbox id of an authorized record (NodeClient);
tests that poke the node with plain httpx use `NodeAuth`, which mints one for the sandbox the request's path
(or a restore request's body) names, so those tests keep testing what they test. Tests of the capability
itself (test_node_capability.py, test_adversarial_tenants.py) build their headers by hand instead.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Generator

import httpx

from space.core.capability import CAPABILITY_HEADER, mint
from space.core.ids import SANDBOX_ID_PATTERN

_SANDBOX_IN_PATH = re.compile(rf"/node/v1/sandboxes/({SANDBOX_ID_PATTERN})(?:/|$)")


def capability_headers(token: str, sandbox_id: str) -> dict[str, str]:
    return {CAPABILITY_HEADER: mint(token, sandbox_id, now=time.time())}


def node_headers(token: str, sandbox_id: str | None = None) -> dict[str, str]:
    """The token, and a capability for `sandbox_id` if given."""
    headers = {"Authorization": f"Bearer {token}"}
    if sandbox_id is not None:
        headers |= capability_headers(token, sandbox_id)
    return headers


class NodeAuth(httpx.Auth):
    """httpx auth: the node token on every request, and a capability for the sandbox it names (if any)."""

    requires_request_body = False  # a streamed upload must stay streamed (restore bodies are JSON, read)

    def __init__(self, token: str) -> None:
        self.token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.token}"
        sandbox_id = None
        found = _SANDBOX_IN_PATH.search(request.url.path)
        if found is not None:
            sandbox_id = found.group(1)
        elif request.url.path.endswith("/sandboxes/restore"):
            try:
                named = json.loads(request.content).get("sandbox_id")
            except (httpx.RequestNotRead, ValueError, AttributeError):
                named = None
            sandbox_id = named if isinstance(named, str) else None
        if sandbox_id is not None:
            request.headers.update(capability_headers(self.token, sandbox_id))
        yield request
