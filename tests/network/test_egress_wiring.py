"""The node's egress wiring without a node: the trust-store block, operator settings, the policy precedence
(node record > control plane > fork parent > none), versions, persistence, and the driver hooks. The real
thing (runsc, netns, nftables, TLS) is tests/e2e/test_egress_e2e.py."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import pathlib

import pytest

from space.core import errors
from space.node.agent.egress_sandbox import CA_BEGIN, CA_END, with_node_ca
from space.node.agent.egress_settings import DEFAULT_PORTS, EgressRequest, load_settings
from space.node.agent.egress_wiring import EgressDriver
from space.node.drivers.base import SandboxSpec
from space.node.egress import EgressPolicy, StaticResolver
from tests.support.egress_wiring_fakes import FakeControlPlane, fake_wiring

CA = b"-----BEGIN CERTIFICATE-----\nNODE-A\n-----END CERTIFICATE-----\n"
OTHER_CA = b"-----BEGIN CERTIFICATE-----\nNODE-B\n-----END CERTIFICATE-----\n"
SYSTEM = b"-----BEGIN CERTIFICATE-----\nPUBLIC-ROOT\n-----END CERTIFICATE-----"


def test_the_node_ca_block_replaces_another_nodes_and_keeps_the_rest() -> None:
    first = with_node_ca(SYSTEM, CA)
    assert first.startswith(SYSTEM + b"\n") and first.count(CA_BEGIN) == 1 and CA in first
    assert with_node_ca(first, CA) == first  # idempotent
    moved = with_node_ca(first + b"appended later\n", OTHER_CA)
    assert CA not in moved and OTHER_CA in moved and moved.count(CA_BEGIN) == moved.count(CA_END) == 1
    assert SYSTEM in moved and b"appended later" in moved
    assert with_node_ca(b"", CA) == CA_BEGIN + CA + CA_END
    # a block cut short (no END marker) is dropped with everything after it
    assert with_node_ca(SYSTEM + b"\n" + CA_BEGIN + b"junk", CA) == with_node_ca(SYSTEM, CA)


def test_operator_settings_from_a_file(tmp_path: pathlib.Path) -> None:
    assert load_settings(tmp_path, None).ports == DEFAULT_PORTS
    config = tmp_path / "egress.json"
    config.write_text(json.dumps({
        "ports": {"proxy": 4128}, "hosts": {"api.test": ["10.98.1.2"]}, "trust_store": "/x/ca.pem",
        "allow_networks": ["10.98.0.0/16"],
    }))  # fmt: skip
    settings = load_settings(tmp_path, config)
    assert settings.ports == {**DEFAULT_PORTS, "proxy": 4128}
    assert isinstance(settings.resolver, StaticResolver)
    assert settings.trust_store == pathlib.Path("/x/ca.pem")
    assert settings.operator_allowed_networks == [ipaddress.ip_network("10.98.0.0/16")]
    for bad in ("{", "[]", json.dumps({"allow_networks": ["10.98.0.1/8"]}), json.dumps({"ports": []})):
        config.write_text(bad)
        with pytest.raises(errors.InvalidArgument):
            load_settings(tmp_path, config)


def test_a_malformed_policy_is_a_typed_error() -> None:
    with pytest.raises(errors.InvalidArgument):
        EgressRequest(allow=["exa mple.com"]).policy()
    assert EgressRequest(allow=["API.test."]).policy().allow == ["api.test"]


def test_policy_precedence_versions_and_persistence(tmp_path: pathlib.Path) -> None:
    cp = FakeControlPlane({"sb-b": {"allow": ["b.test"], "deny": [], "version": 2}})
    wiring, gateway, helper = fake_wiring(tmp_path, cp)
    helper.addresses.update(
        {"sb-a": "100.64.0.2", "sb-b": "100.64.0.3", "sb-c": "100.64.0.4", "sb-d": "100.64.0.5"}
    )

    async def scenario() -> None:
        wiring.remember("sb-a", EgressRequest(allow=["a.test"], version=1))
        await wiring.runtime_up("sb-a", None, fresh=False)  # the node's own record
        await wiring.runtime_up("sb-b", None, fresh=False)  # the control plane's
        await wiring.runtime_up("sb-c", None, fresh=False)  # nobody's: no egress
        # a fork child: the control plane decides (it resolves children to their parent's policy)
        await wiring.runtime_up("sb-d", None, fresh=False, source_sandbox_id="sb-a")
        # with a control plane, a policy without its org approvals opens no private range (ADR 0026)
        assert gateway.policies["sb-a"] == ("100.64.0.2", EgressPolicy(allow=["a.test"], private_networks=[]))
        assert gateway.policies["sb-b"][1].allow == ["b.test"]
        assert "sb-c" not in gateway.policies and "sb-d" not in gateway.policies
        # node-only: a fork child takes its parent's record
        node_only, node_gateway, node_helper = fake_wiring(tmp_path / "node-only")
        node_helper.addresses.update(helper.addresses)
        node_only.remember("sb-a", EgressRequest(allow=["a.test"]))
        await node_only.runtime_up("sb-d", None, fresh=False, source_sandbox_id="sb-a")
        assert node_gateway.policies["sb-d"] == ("100.64.0.5", EgressPolicy(allow=["a.test"]))
        assert node_only.recorded("sb-d") == EgressRequest(allow=["a.test"])
        wiring.remember("sb-d", EgressRequest(allow=["a.test"]))
        # a push applies at once, drops the cached credentials, and older versions are refused
        answer = await wiring.apply("sb-c", EgressRequest(allow=["c.test"], version=5), ["tok"])
        assert answer == {"applied": True, "live": True, "version": 5}
        assert gateway.policies["sb-c"][1].allow == ["c.test"] and "sb-c" in cp.forgotten
        stale = await wiring.apply("sb-c", EgressRequest(allow=["x.test"], version=4))
        assert stale == {"applied": False, "reason": "stale", "version": 5}
        # the control plane's answer wins over an older pushed record, a newer push wins over it
        cp.policies["sb-a"] = {"allow": ["cp.test"], "deny": [], "version": 7}
        await wiring.runtime_up("sb-a", None, fresh=False)
        assert gateway.policies["sb-a"][1].allow == ["cp.test"]
        await wiring.apply("sb-a", EgressRequest(allow=["pushed.test"], version=9))
        await wiring.runtime_up("sb-a", None, fresh=False)
        assert gateway.policies["sb-a"][1].allow == ["pushed.test"]
        # gone: forgotten by the gateway; a stopped sandbox keeps its record, a deleted one does not
        wiring.runtime_gone("sb-a")
        assert "sb-a" not in gateway.policies and wiring.recorded("sb-a") is not None
        wiring.sandbox_deleted("sb-d")
        assert wiring.recorded("sb-d") is None
        for task in list(wiring._retries.values()):
            task.cancel()

    asyncio.run(scenario())
    again, _gateway, _helper = fake_wiring(tmp_path)
    assert again.recorded("sb-a") == EgressRequest(allow=["pushed.test"], version=9)
    assert again.recorded("sb-c") == EgressRequest(allow=["c.test"], version=5)
    assert again.recorded("sb-d") is None


def test_a_reused_host_address_moves_to_its_new_sandbox(tmp_path: pathlib.Path) -> None:
    wiring, gateway, helper = fake_wiring(tmp_path)
    helper.addresses.update({"sb-old": "100.64.0.9", "sb-new": "100.64.0.9"})
    wiring.remember("sb-old", EgressRequest(allow=["old.test"]))
    wiring.remember("sb-new", EgressRequest(allow=["new.test"]))

    async def scenario() -> None:
        await wiring.runtime_up("sb-old", None, fresh=False)
        await wiring.runtime_up("sb-new", None, fresh=False)

    asyncio.run(scenario())
    assert list(gateway.policies) == ["sb-new"]


class FakeDriver:
    name = "fake-inner"

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def create(self, spec: SandboxSpec) -> None:
        self.calls.append(f"create {sorted(spec.env)}")

    async def destroy(self, sandbox_id: str) -> None:
        self.calls.append(f"destroy {sandbox_id}")

    async def stop(self, sandbox_id: str) -> None:
        self.calls.append(f"stop {sandbox_id}")


def test_the_driver_gives_every_sandbox_the_proxy_environment(tmp_path: pathlib.Path) -> None:
    wiring, gateway, _helper = fake_wiring(tmp_path)
    inner = FakeDriver()
    driver = EgressDriver(inner, wiring)  # type: ignore[arg-type]
    spec = SandboxSpec(sandbox_id="sb-a", env={"MINE": "1", "NO_PROXY": "example.com"})
    wiring.remember("sb-a", EgressRequest(allow=["a.test"]))
    gateway.policies["sb-a"] = ("100.64.0.2", EgressPolicy(allow=["a.test"]))

    async def scenario() -> None:
        await driver.create(spec)
        await driver.stop("sb-a")
        await driver.destroy("sb-a")

    asyncio.run(scenario())
    assert spec.env["HTTPS_PROXY"] == "http://10.99.0.1:3128" and spec.env["NO_PROXY"] == ""
    assert spec.env["MINE"] == "1" and spec.env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca-certificates.crt"
    assert inner.calls[1:] == ["stop sb-a", "destroy sb-a"]
    assert "sb-a" not in gateway.policies and wiring.recorded("sb-a") is None
    assert driver.name == "fake-inner"  # everything else is the wrapped driver's
