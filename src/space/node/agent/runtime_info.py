"""The runtime descriptor of this node, as the agent reports it (ADR 0035:
`docs/adr/0035-checkpoints-describe-their-runtime.md`).

Invariants:
- On a runsc node the descriptor is the one the root helper published (`run/runtime.json`, written at
  node.prepare by space.node.helper.runtime): the helper alone knows its runsc, platform and network mode.
  It is read as untrusted input (space.core.runtimes.parse_or_none); unreadable or absent means unknown
  (None), never a guess.
- The fake driver's checkpoints restore only on the fake driver: its descriptor names nothing else.
- A qemu node's descriptor names its driver only (`qemu`), never the runsc descriptor its helper also
  publishes: placement matches a microvm sandbox to it by that name (space.core.isolation, ADR 0076), and
  its checkpoints restore only on qemu nodes. The accelerator and machine a checkpoint needs are checked by
  the helper on every restore (ADR 0068).
"""

from __future__ import annotations

import json
import pathlib

from space.core import runtimes
from space.node.drivers.base import Driver
from space.node.layout import NodeLayout

#: As written by space.node.helper.runtime (the agent never imports the helper).
RUNTIME_DESCRIPTOR = "runtime.json"
MAX_DESCRIPTOR_BYTES = 64 * 1024


def read_descriptor(path: pathlib.Path) -> runtimes.Descriptor | None:
    """The descriptor in a JSON file, or None if it is absent, too large or malformed."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_DESCRIPTOR_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_DESCRIPTOR_BYTES:
        return None
    try:
        return runtimes.parse_or_none(json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def node_runtime(driver: Driver) -> runtimes.Descriptor | None:
    """This node's runtime descriptor (None: the helper has not published one yet)."""
    if driver.name in ("fake", "qemu"):
        return runtimes.describe(driver.name)
    layout = getattr(driver, "layout", None)  # the runsc driver's; other drivers publish nothing yet
    if not isinstance(layout, NodeLayout):
        return None
    return read_descriptor(layout.run / RUNTIME_DESCRIPTOR)
