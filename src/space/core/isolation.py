"""A sandbox's isolation: what a user asks for (`gvisor` or `microvm`), which node drivers provide it, and
what each isolation cannot do (pure: no I/O; docs/adr/0076-isolation-per-sandbox.md).

Invariants:
- Users name isolations, never drivers: `gvisor` (gVisor's application kernel, driver `runsc`) and
  `microvm` (a QEMU microVM on Debian's own kernel, driver `qemu`). The fake driver of the tests counts as
  `gvisor` (it stands in for runsc everywhere else too). A sandbox's isolation is fixed at create: forks,
  sandboxes from its snapshots, restores and recoveries keep it.
- `parse_isolation` accepts exactly the names of ISOLATIONS (no trimming, no case folding): anything else
  is InvalidArgument naming the field `isolation`, its value never echoed whole.
- A node's isolation comes from the runtime descriptor it reports (space.core.runtimes). A node that has
  not reported one (an older agent, or a runsc node whose helper has not published its descriptor yet)
  counts as `gvisor`, the only isolation such agents ever ran; a node whose descriptor names a driver of
  no isolation here (or is malformed) offers none.
- UNSUPPORTED lists what an isolation cannot do yet; `refuse_unsupported` raises NotSupported (HTTP 409)
  with a message naming the isolation and what to do instead, so nothing is half done.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal, get_args

from space.core import runtimes
from space.core.errors import InvalidArgument, NotSupported

Isolation = Literal["gvisor", "microvm"]
ISOLATIONS: Final[tuple[str, ...]] = get_args(Isolation)
DEFAULT: Final[Isolation] = "gvisor"

#: The node driver (runtime descriptor `driver`) -> the isolation it provides.
DRIVER_ISOLATION: Final[Mapping[str, Isolation]] = {"runsc": "gvisor", "fake": "gvisor", "qemu": "microvm"}

#: isolation -> operation -> why it is refused and what to do instead (the 409's message).
UNSUPPORTED: Final[Mapping[str, Mapping[str, str]]] = {
    "microvm": {
        "disk_snapshot": "disk snapshots are not supported for microvm sandboxes; take a full snapshot",
        "disk_rollback": "microvm sandboxes roll back to full snapshots only",
        "template_checkpoint": "microvm sandboxes start from the checkpoint their node makes of a cold "
        "boot of the template; a sandbox's checkpoint does not become a template's",
        "cold_create": "microvm sandboxes are created from their template's checkpoint only",
    },
}

#: Operations some isolation refuses: only a request for one of these needs to look at the sandbox's.
RESTRICTED: Final = frozenset(op for ops in UNSUPPORTED.values() for op in ops)


def parse_isolation(value: object) -> Isolation:
    """`value` as an isolation name; InvalidArgument (field `isolation`) for anything else."""
    if value == "gvisor":
        return "gvisor"
    if value == "microvm":
        return "microvm"
    raise InvalidArgument(
        f"isolation must be one of {', '.join(ISOLATIONS)}, not {repr(value)[:32]}", field="isolation"
    )


def of_driver(driver: str | None) -> Isolation | None:
    """The isolation a node driver provides (None: a driver of no known isolation)."""
    return DRIVER_ISOLATION.get(driver) if driver is not None else None


def of_node(runtime: object) -> Isolation | None:
    """The isolation a node offers, from the raw runtime descriptor it reported (None: none; see the module
    invariants for a node that reported nothing)."""
    if runtime is None:
        return DEFAULT
    descriptor = runtimes.parse_or_none(runtime)
    return of_driver(descriptor["driver"]) if descriptor is not None else None


def unsupported(isolation: str, operation: str) -> str | None:
    """Why `operation` is refused for sandboxes of `isolation` (None: it is supported)."""
    return UNSUPPORTED.get(isolation, {}).get(operation)


def refuse_policy(isolation: str, *, disk_every_s: int | None, upload_full: bool) -> None:
    """NotSupported when a snapshot policy asks for what sandboxes of `isolation` cannot do (scheduled disk
    snapshots, uploads), refused when it is given rather than failing at every scheduled turn."""
    if disk_every_s is not None:
        refuse_unsupported(isolation, "disk_snapshot")
    if upload_full:
        refuse_unsupported(isolation, "upload")


def refuse_unsupported(isolation: str, operation: str) -> None:
    """NotSupported (409, naming the isolation) when sandboxes of `isolation` cannot do `operation`."""
    reason = unsupported(isolation, operation)
    if reason is not None:
        raise NotSupported(reason, isolation=isolation, operation=operation)
