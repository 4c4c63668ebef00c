"""Defence in depth at the node (ADR 0026): with a control plane, the gateway opens a private range only
inside what the control plane says an org admin approved for the project, whatever allow CIDR a policy
carries (a control-plane bug that let one through, a push without the approvals, a stale record)."""

from __future__ import annotations

import asyncio
import ipaddress
import pathlib
from typing import Any

from space.node.agent.egress_settings import EgressRequest
from space.node.egress.policy import CompiledPolicy, EgressPolicy, normalize_host
from tests.support.egress_wiring_fakes import FakeControlPlane, fake_wiring

INSIDE = ipaddress.ip_address("10.1.2.3")


def allowed(policy: EgressPolicy, address: str = "10.1.2.3") -> bool:
    return CompiledPolicy(policy).decide_name(normalize_host(address)).allowed


def test_private_allow_cidrs_open_only_inside_the_approval() -> None:
    allow = ["10.1.2.0/24", "fd00::/64", "*.example.com"]
    assert allowed(EgressPolicy(allow=allow))  # no org layer: the operator's own policy, as before
    assert not allowed(EgressPolicy(allow=allow, private_networks=[]))
    assert not allowed(EgressPolicy(allow=allow, private_networks=["10.9.0.0/16"]))
    assert not allowed(EgressPolicy(allow=allow, private_networks=["10.1.2.128/25"]))  # narrower than allow
    assert allowed(EgressPolicy(allow=allow, private_networks=["10.1.0.0/16"]))
    assert not allowed(EgressPolicy(allow=allow, private_networks=["10.1.0.0/16"]), "fd00::1")
    assert allowed(EgressPolicy(allow=allow, private_networks=["fd00::/8"]), "fd00::1")
    # A name resolving into a private range is judged the same way.
    policy = CompiledPolicy(EgressPolicy(allow=allow, private_networks=[]))
    name = normalize_host("api.example.com")
    assert not policy.filter_addresses(name, [INSIDE]).allowed
    opened = CompiledPolicy(EgressPolicy(allow=allow, private_networks=["10.0.0.0/8"]))
    assert opened.filter_addresses(name, [INSIDE]).allowed
    # Never-reachable ranges stay closed whatever is "approved".
    for never in ("127.0.0.1", "169.254.169.254"):
        sneaky = EgressPolicy(allow=[never], private_networks=["127.0.0.0/8", "169.254.0.0/16"])
        assert not allowed(sneaky, never)


def test_a_node_with_a_control_plane_requires_the_approvals(tmp_path: pathlib.Path) -> None:
    cp = FakeControlPlane(
        {
            "sb-a": {"allow": ["10.1.2.0/24"], "deny": [], "version": 1},  # no approvals sent: none
            "sb-b": {"allow": ["10.1.2.0/24"], "deny": [], "version": 1, "private_networks": ["10.1.0.0/16"]},
        }
    )
    wiring, gateway, helper = fake_wiring(tmp_path, cp)
    helper.addresses.update({"sb-a": "100.64.0.2", "sb-b": "100.64.0.3", "sb-c": "100.64.0.4"})

    async def scenario() -> dict[str, Any]:
        for sandbox_id in ("sb-a", "sb-b"):
            await wiring.runtime_up(sandbox_id, None, fresh=False)
        # a push without the approvals (an older or buggy control plane) opens nothing private either
        await wiring.apply("sb-c", EgressRequest(allow=["10.1.2.0/24"], version=3))
        await wiring.runtime_up("sb-c", None, fresh=False)  # the control plane cannot be asked: the record
        for task in list(wiring._retries.values()):
            task.cancel()
        return {sid: policy for sid, (_source, policy) in gateway.policies.items()}

    policies = asyncio.run(scenario())
    assert not allowed(policies["sb-a"]) and allowed(policies["sb-b"]) and not allowed(policies["sb-c"])
    # Without a control plane the node's operator is the authority: unchanged behaviour.
    assert allowed(EgressRequest(allow=["10.1.2.0/24"]).policy())
