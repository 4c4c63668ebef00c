"""Who a connection to the gateway comes from, and where it was going before the node redirected it.

Invariants:
- A sandbox is known only by the source address of its connection (the node's network setup makes that
  address unforgeable). Addresses are compared in one spelling: no zone id, IPv4-mapped IPv6 as IPv4.
- The original destination of a redirected connection comes from conntrack (SO_ORIGINAL_DST); a connection
  that was not redirected has none (never guessed from the listener's own address).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct

from space.node.egress.policy import IPAddress

SO_ORIGINAL_DST = 80


def plain_ip(address: str) -> str:
    """`address` in the one spelling the gateway keys sandboxes by (unchanged if it is no IP address)."""
    try:
        parsed = ipaddress.ip_address(address.split("%", maxsplit=1)[0])
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


def peer_ip(writer: asyncio.StreamWriter) -> str:
    """The plain source address of a client connection ("" when the transport does not know it)."""
    peer = writer.get_extra_info("peername")
    return plain_ip(str(peer[0])) if isinstance(peer, tuple) else ""


def original_destination(writer: asyncio.StreamWriter) -> tuple[IPAddress, int] | None:
    """The destination before an nftables redirect (SO_ORIGINAL_DST), None if the connection was not
    redirected (or conntrack does not know it)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return None
    local = writer.get_extra_info("sockname")
    try:
        if sock.family == socket.AF_INET:
            raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
            port = struct.unpack_from("!H", raw, 2)[0]
            address = socket.inet_ntop(socket.AF_INET, raw[4:8])
        else:
            raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
            port = struct.unpack_from("!H", raw, 2)[0]
            address = socket.inet_ntop(socket.AF_INET6, raw[8:24])
    except OSError:
        return None
    if isinstance(local, tuple) and (address, port) == (str(local[0]), int(local[1])):
        return None
    return ipaddress.ip_address(address), int(port)


def original_port(writer: asyncio.StreamWriter) -> int | None:
    found = original_destination(writer)
    return found[1] if found else None
