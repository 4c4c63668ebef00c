"""The version of the protocol between a node agent and the control plane (standard library only): the
registration, heartbeat and node-facing routes of the control plane, and the node RPC it calls.

Each side speaks a range of versions, MIN..MAX. A node announces its range when it registers
(`protocol_min`, `protocol_max` in the body; a node from before versioning announces nothing, which means
1..1); the control plane refuses a node whose range does not overlap its own (409 `incompatible_protocol`,
naming both ranges) and answers the version both use (the highest in both ranges) with its own range; the
node checks that answer the same way and, refused, exits naming both ranges instead of retrying.

Versions: 1 = the protocol as of ADR 0071 (everything before it is also 1: it never changed incompatibly).

Invariants (ADR 0071):
- A change a peer of the previous version would misread raises MAX; support for a version is dropped by
  raising MIN, never in the same release that introduces its successor, so releases N and N+1 always
  overlap: control-plane replicas of N and N+1 side by side, and nodes of N under a control plane of N+1
  (upgrade the control plane first, then drain and upgrade nodes one by one).
- A version outside 1..MAX_ANNOUNCED, or a range whose MIN exceeds its MAX, is a malformed announcement
  (400), not an incompatible one.
"""

from __future__ import annotations

from typing import Any

NODE_PROTOCOL_VERSION = 1
MIN_NODE_PROTOCOL_VERSION = 1
#: The largest version number a peer may announce (a bound on hostile input, far beyond any real one).
MAX_ANNOUNCED = 1000


class MalformedRange(ValueError):
    """An announced range is not two whole numbers 1 <= min <= max <= MAX_ANNOUNCED."""


def own_range() -> tuple[int, int]:
    """This code's range (read at call time, so a test can announce another one)."""
    return MIN_NODE_PROTOCOL_VERSION, NODE_PROTOCOL_VERSION


def announced_range(body: dict[str, Any]) -> tuple[int, int]:
    """The range a registration body (or an answer) announces; none announced means 1..1."""
    low, high = body.get("protocol_min", 1), body.get("protocol_max", 1)
    if low is None and high is None:
        return 1, 1
    for value in (low, high):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_ANNOUNCED:
            raise MalformedRange(f"protocol_min and protocol_max are whole numbers from 1 to {MAX_ANNOUNCED}")
    if low > high:
        raise MalformedRange(f"protocol_min ({low}) exceeds protocol_max ({high})")
    return low, high


def common_version(ours: tuple[int, int], theirs: tuple[int, int]) -> int | None:
    """The highest version in both ranges, or None when they do not overlap."""
    chosen = min(ours[1], theirs[1])
    return chosen if chosen >= max(ours[0], theirs[0]) else None


def describe(ours: tuple[int, int], theirs: tuple[int, int], *, we: str, they: str) -> str:
    return (
        f"no common node protocol version: the {they} speaks {theirs[0]}..{theirs[1]}, the {we} speaks "
        f"{ours[0]}..{ours[1]}; upgrade the side with the older range (the control plane first, then the "
        f"nodes one by one)"
    )
