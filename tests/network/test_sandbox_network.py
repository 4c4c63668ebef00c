"""The pure parts of space.node.helper.network: names, addresses, generated rulesets, bundle netns entries.
(The real namespaces, nft tables and runsc are exercised in tests/network/test_runsc_network.py.)"""

from __future__ import annotations

import ipaddress
import pathlib

import pytest
from pydantic import ValidationError

from space.core import errors
from space.node.helper.netaddr import SANDBOX_ADDR, SANDBOX_GATEWAY, node_tag
from space.node.helper.network import SandboxNetworks, prepare_launch, set_bundle_netns
from space.node.helper.params import GatewayPorts
from space.node.layout import NodeLayout

PORTS = GatewayPorts(proxy=3128, transparent_http=3129, transparent_tls=3130, dns=3053)


def _networks(data_dir: str = "/var/lib/space") -> SandboxNetworks:
    networks = SandboxNetworks(NodeLayout(pathlib.Path(data_dir)))
    networks._block = ipaddress.IPv4Network("100.64.16.0/20")
    return networks


def test_names_are_per_node_and_fit_the_kernel_limits() -> None:
    a, b = _networks("/var/lib/space"), _networks("/var/lib/space2")
    assert node_tag(pathlib.Path("/var/lib/space")) == a.tag != b.tag
    last = a.max_slots - 1
    for name in (a.sandbox_ns(last), a.edge_ns(last), a.host_link(last), a.gateway_link):
        assert len(name) <= 15, name  # IFNAMSIZ - 1 for links; netns names share the scheme
    assert a.table != b.table


def test_addresses_come_from_the_node_block_and_are_unique() -> None:
    networks = _networks()
    hosts = {networks.host_addr(slot) for slot in range(networks.max_slots)}
    assert len(hosts) == networks.max_slots == 4093
    assert networks.gateway_addr not in hosts
    assert all(addr in networks.block for addr in hosts | {networks.gateway_addr})
    assert networks.block.broadcast_address not in hosts
    with pytest.raises(errors.InvalidState):
        _ = SandboxNetworks(NodeLayout(pathlib.Path("/x"))).gateway_addr  # not prepared


def test_without_gateway_ports_the_node_table_lets_nothing_out() -> None:
    networks = _networks()
    rules = networks.root_ruleset()
    accepts = [line.strip() for line in rules.splitlines() if "accept" in line and "policy" not in line]
    assert accepts == [f'oifname "sp{networks.tag}h*" ct state established,related accept']  # replies only
    assert "dnat" not in rules
    assert f'iifname "sp{networks.tag}h*" drop' in rules
    assert rules.startswith(f"table inet {networks.table} {{}}\ndelete table inet {networks.table}\n")


def test_with_gateway_ports_only_the_gateway_is_reachable_and_the_rest_redirected() -> None:
    networks = _networks()
    networks._ports = PORTS
    rules = networks.root_ruleset()
    gw = networks.gateway_addr
    assert f"ip daddr {gw} tcp dport {{ 3128, 3129, 3130, 3053 }} accept" in rules
    assert f"ip daddr {gw} udp dport 3053 accept" in rules
    assert f"th dport 53 dnat ip to {gw}:3053" in rules
    assert f"tcp dport 80 dnat ip to {gw}:3129" in rules
    assert f"tcp dport 443 dnat ip to {gw}:3130" in rules
    assert "meta nfproto ipv6 drop" in rules and "fib saddr . iif oif missing drop" in rules
    edge = networks.edge_ruleset(networks.host_addr(7))
    assert f"ip saddr {SANDBOX_ADDR} snat ip to {networks.host_addr(7)}" in edge
    assert f"ip daddr {SANDBOX_GATEWAY} dnat ip to {gw}" in edge
    assert "policy drop" in edge


def test_gateway_ports_are_four_distinct_valid_ports() -> None:
    good = PORTS.model_dump()
    for bad in ({**good, "dns": 3128}, {**good, "proxy": 0}, {**good, "proxy": 70000},
                {**good, "proxy": "3128"}, {**good, "extra": 1}):  # fmt: skip
        with pytest.raises(ValidationError):
            GatewayPorts.model_validate(bad)


def test_bundle_network_namespace_is_set_or_cleared() -> None:
    config = {"linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/run/netns/elsewhere"}]}}
    set_bundle_netns(config, pathlib.Path("/run/netns/spabcdefs3"))
    assert config["linux"]["namespaces"] == [
        {"type": "pid"},
        {"type": "network", "path": "/run/netns/spabcdefs3"},
    ]
    assert prepare_launch(None, "sb-x", config) == []  # network "none": runsc makes an empty namespace
    assert config["linux"]["namespaces"] == [{"type": "pid"}, {"type": "network"}]
