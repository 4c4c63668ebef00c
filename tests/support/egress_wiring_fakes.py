"""Fakes around the node agent's EgressWiring: a gateway that records policies, a helper that knows host
addresses, a control plane that answers policies (tests of space.node.agent.egress_wiring)."""

from __future__ import annotations

import pathlib
from typing import Any

from space.core import errors
from space.node.agent.egress_settings import DEFAULT_PORTS
from space.node.agent.egress_wiring import EgressWiring
from space.node.egress import EgressPolicy

CA = b"-----BEGIN CERTIFICATE-----\nNODE-A\n-----END CERTIFICATE-----\n"


class FakeGateway:
    def __init__(self) -> None:
        self.policies: dict[str, tuple[str, EgressPolicy]] = {}
        self.ports = dict(DEFAULT_PORTS)
        self.ca_certificate_pem = CA
        self.listen_host = "100.64.0.1"

    def set_policy(self, sandbox_id: str, source: str, policy: EgressPolicy) -> None:
        self.policies[sandbox_id] = (source, policy)

    def forget(self, sandbox_id: str) -> None:
        self.policies.pop(sandbox_id, None)


class FakeHelper:
    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}

    async def call(self, verb: str, params: dict[str, Any] | None = None, **_kw: Any) -> dict[str, Any]:
        assert verb == "sandbox.network" and params is not None
        return {"host_addr": self.addresses[params["sandbox_id"]]}


class FakeControlPlane:
    def __init__(self, policies: dict[str, dict[str, Any]]) -> None:
        self.policies = policies
        self.forgotten: list[str] = []

    async def policy(self, sandbox_id: str) -> dict[str, Any]:
        if sandbox_id not in self.policies:
            raise errors.PermissionDenied("not assigned")
        return self.policies[sandbox_id]

    def forget(self, sandbox_id: str) -> None:
        self.forgotten.append(sandbox_id)


def fake_wiring(
    tmp_path: pathlib.Path, control_plane: Any = None
) -> tuple[EgressWiring, FakeGateway, FakeHelper]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    gateway, helper = FakeGateway(), FakeHelper()
    info = {"sandbox_gateway_addr": "10.99.0.1", "gateway_addr": "100.64.0.1"}
    wiring = EgressWiring(helper, gateway, info, tmp_path, control_plane=control_plane)  # type: ignore[arg-type]
    return wiring, gateway, helper
