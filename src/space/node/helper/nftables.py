"""The nftables rulesets of a node's sandbox network, generated as text (pure: the caller applies them).

Invariants:
- Every ruleset is applied with one `nft -f` (atomic replace), never rule by rule: the root table's text
  starts by creating and deleting the table, so applying it replaces whatever was there.
- The root table lets traffic from the slots reach only the egress gateway's ports on gateway_addr (TCP
  80/443 and UDP/TCP 53 anywhere are redirected to it) and drops everything else from or to a slot, IPv6
  included; without gateway ports nothing gets out at all (replies only).
- A packet from a slot whose source does not route back through the link it came from is dropped (strict
  reverse-path check), so the host address the gateway sees cannot be spoofed.
- An edge forwards only the sandbox's address outwards (SNAT to the slot's host address) and replies
  inwards; it accepts nothing addressed to itself.
"""

from __future__ import annotations

import ipaddress

from space.node.helper.netaddr import EDGE_TABLE, SANDBOX_ADDR, SANDBOX_GATEWAY, SlotNames
from space.node.helper.params import GatewayPorts


def root_ruleset(names: SlotNames, gateway: ipaddress.IPv4Address, ports: GatewayPorts | None) -> str:
    slots = names.host_link_glob
    lines = [
        f"table inet {names.table} {{}}",
        f"delete table inet {names.table}",
        f"table inet {names.table} {{",
        "  chain sandbox_guard {",
        "    type filter hook prerouting priority raw; policy accept;",
        f"    iifname {slots} meta nfproto ipv6 drop",
        # strict reverse-path check: a slot's packets must come from the host_addr routed to its link
        f"    iifname {slots} fib saddr . iif oif missing drop",
        "  }",
    ]
    allow: list[str] = []
    if ports is not None:
        p = ports
        tcp_ports = f"{{ {p.proxy}, {p.transparent_http}, {p.transparent_tls}, {p.dns} }}"
        lines += [
            "  chain sandbox_redirect {",
            "    type nat hook prerouting priority dstnat; policy accept;",
            f"    iifname {slots} ip daddr {gateway} tcp dport {tcp_ports} return",
            f"    iifname {slots} ip daddr {gateway} udp dport {p.dns} return",
            f"    iifname {slots} meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {gateway}:{p.dns}",
            f"    iifname {slots} tcp dport 80 dnat ip to {gateway}:{p.transparent_http}",
            f"    iifname {slots} tcp dport 443 dnat ip to {gateway}:{p.transparent_tls}",
            "  }",
        ]
        allow = [
            f"    iifname {slots} ip daddr {gateway} tcp dport {tcp_ports} accept",
            f"    iifname {slots} ip daddr {gateway} udp dport {p.dns} accept",
        ]
    lines += [
        "  chain sandbox_input {",
        "    type filter hook input priority filter; policy accept;",
        *allow,
        f"    iifname {slots} drop",
        "  }",
        "  chain sandbox_forward {",
        "    type filter hook forward priority filter; policy accept;",
        f"    iifname {slots} drop",
        f"    oifname {slots} drop",
        "  }",
        "  chain sandbox_output {",
        "    type filter hook output priority filter; policy accept;",
        f"    oifname {slots} ct state established,related accept",
        f"    oifname {slots} drop",
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def delete_root_table(names: SlotNames) -> str:
    # `table ...` first makes the delete succeed whether or not the table exists
    return f"table inet {names.table}\ndelete table inet {names.table}\n"


def edge_ruleset(gateway: ipaddress.IPv4Address, host_addr: ipaddress.IPv4Address) -> str:
    return (
        f"table inet {EDGE_TABLE} {{\n"
        "  chain prerouting {\n"
        "    type nat hook prerouting priority dstnat; policy accept;\n"
        f'    iifname "in0" ip daddr {SANDBOX_GATEWAY} dnat ip to {gateway}\n'
        "  }\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f'    oifname "up0" ip saddr {SANDBOX_ADDR} snat ip to {host_addr}\n'
        "  }\n"
        "  chain forward {\n"
        "    type filter hook forward priority filter; policy drop;\n"
        f'    iifname "in0" oifname "up0" ip saddr {SANDBOX_ADDR} accept\n'
        '    iifname "up0" oifname "in0" ct state established,related accept\n'
        "  }\n"
        "  chain input {\n"
        "    type filter hook input priority filter; policy drop;\n"
        "  }\n"
        "}\n"
    )
