"""Protocol version negotiation (standard library only).

The HELLO frame carries {"protocol": <highest supported>, "min_protocol": <lowest supported>, ...}.
Both sides pick the highest version inside both ranges; no overlap is a VersionMismatch.

Versions: 1 = the original framing. 2 = per-stream credit flow control (WINDOW frames, and a "window" field
in HELLO naming the credit its sender grants the peer per stream). A peer of version 1 simply never sees a
WINDOW frame: each side decides from the negotiated version whether to wait for credit.
"""

from __future__ import annotations

from typing import Any

from space.protocol.errors import VersionMismatch

PROTOCOL_VERSION = 2
MIN_PROTOCOL_VERSION = 1
#: From this version on, DATA/EOF/EVENT frames of a call are flow-controlled (space.protocol.flow).
FLOW_CONTROL_VERSION = 2


def hello_payload(**extra: Any) -> dict[str, Any]:
    return {"protocol": PROTOCOL_VERSION, "min_protocol": MIN_PROTOCOL_VERSION, **extra}


def negotiate(peer: dict[str, Any]) -> int:
    try:
        peer_max = int(peer["protocol"])
        peer_min = int(peer.get("min_protocol", peer_max))
    except (KeyError, TypeError, ValueError) as exc:
        raise VersionMismatch(f"HELLO without a usable protocol version: {peer!r}") from exc
    chosen = min(peer_max, PROTOCOL_VERSION)
    if chosen < max(peer_min, MIN_PROTOCOL_VERSION):
        raise VersionMismatch(
            f"no common protocol version: peer speaks {peer_min}..{peer_max}, "
            f"we speak {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
        )
    return chosen
