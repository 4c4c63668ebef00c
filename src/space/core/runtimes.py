"""Runtime descriptors: what a node's isolation runtime is, what a full checkpoint was made on, and whether
the one can restore the other (pure: no I/O; docs/adr/0035-checkpoints-describe-their-runtime.md).

A descriptor is a small flat JSON object:

    driver           "runsc" | "qemu" | "fake" (required; space.core.isolation maps it to an isolation)
    platform         gVisor's platform ("ptrace", "systrap"); None for drivers without one
    network          the node's sandbox network mode ("none", "sandbox")
    runtime_version  the runtime's own version string (`runsc --version`)
    template_base    "<base name>@<version>" of the template base checkpoint deltas are made against

Invariants:
- Parsing never trusts its input (a manifest from object storage, a heartbeat body, a file beside an image):
  a value that is not a JSON object of at most MAX_KEYS keys, a field of the wrong type, an over-long or
  oddly-spelt string, or a missing `driver` makes the descriptor malformed; unknown keys are ignored (a
  newer writer may add some). Reasons never echo more than SHOWN_CHARS characters of a value.
- `restore_problem(node, checkpoint)` is None exactly when the node can restore the checkpoint, else one
  short sentence naming the first difference. Every field a checkpoint names must be equal on the node:
  gVisor promises no image compatibility across releases, platforms or network modes, and a disk delta
  applies only onto its own template base. A field the checkpoint leaves out (None) constrains nothing.
- A checkpoint without any descriptor (taken before descriptors existed) is restorable anywhere; the
  runtime itself is then the last judge. A checkpoint with a malformed descriptor is restorable nowhere.
- A node that has not reported its runtime is not excluded by placement (`placeable`), so older agents keep
  working; such a node still refuses an incompatible restore itself (RuntimeIncompatible).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from space.core.errors import RuntimeIncompatible

FIELDS: Final = ("driver", "platform", "network", "runtime_version", "template_base")
_LABELS: Final = {
    "driver": "isolation driver",
    "platform": "gVisor platform",
    "network": "network mode",
    "runtime_version": "runtime version",
    "template_base": "template base",
}
MAX_KEYS: Final = 32
MAX_VALUE_CHARS: Final = 128
SHOWN_CHARS: Final = 48
_VALUE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+~/-]*")

Descriptor = dict[str, str | None]


class MalformedDescriptor(ValueError):
    """A descriptor that cannot be read (the message names the field and what is wrong, not its value)."""


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _field(raw: Mapping[Any, Any], name: str) -> str | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise MalformedDescriptor(f"{name} is a {type(value).__name__}, not a string")
    if not 0 < len(value) <= MAX_VALUE_CHARS:
        raise MalformedDescriptor(f"{name} has {len(value)} characters (1 to {MAX_VALUE_CHARS})")
    if _VALUE.fullmatch(value) is None:
        raise MalformedDescriptor(f"{name} holds characters a runtime descriptor never has")
    return value


def parse(raw: object) -> Descriptor:
    """The descriptor `raw` holds (every field of FIELDS, None where absent); MalformedDescriptor if it
    cannot be trusted."""
    if not isinstance(raw, Mapping):
        raise MalformedDescriptor(f"a runtime descriptor is a JSON object, not a {type(raw).__name__}")
    if len(raw) > MAX_KEYS:
        raise MalformedDescriptor(f"a runtime descriptor has at most {MAX_KEYS} keys, not {len(raw)}")
    descriptor = {name: _field(raw, name) for name in FIELDS}
    if descriptor["driver"] is None:
        raise MalformedDescriptor("a runtime descriptor names its driver")
    return descriptor


def describe(
    driver: str,
    *,
    platform: str | None = None,
    network: str | None = None,
    runtime_version: str | None = None,
    template_base: str | None = None,
) -> Descriptor:
    """A descriptor from its fields, checked like one read from outside (so a writer cannot record what a
    reader would refuse)."""
    return parse(
        {
            "driver": driver,
            "platform": platform,
            "network": network,
            "runtime_version": runtime_version,
            "template_base": template_base,
        }
    )


def parse_or_none(raw: object) -> Descriptor | None:
    """For values a peer reports about itself (a heartbeat): the descriptor, or None if absent or
    malformed (an unreadable report is no report)."""
    if raw is None:
        return None
    try:
        return parse(raw)
    except MalformedDescriptor:
        return None


def restore_problem(node: object, checkpoint: object) -> str | None:
    """Why a node whose runtime is `node` cannot restore a checkpoint made on `checkpoint`; None if it
    can. Both are raw (untrusted) values; a None checkpoint is a checkpoint of unknown runtime."""
    if checkpoint is None:
        return None
    try:
        wanted = parse(checkpoint)
    except MalformedDescriptor as exc:
        return f"the checkpoint's runtime descriptor is unreadable: {exc}"
    try:
        have = parse(node)
    except MalformedDescriptor as exc:
        return f"this node's runtime is unknown: {exc}"
    for name in FIELDS:
        need = wanted[name]
        if need is not None and have[name] != need:
            return (
                f"the checkpoint was made with {_LABELS[name]} {_show(need)}; this node has "
                f"{_show(have[name]) if have[name] is not None else 'none'}"
            )
    return None


def first_difference(node: object, checkpoint: object) -> str | None:
    """The FIELDS name behind `restore_problem` (None if there is none, or the problem is unreadability)."""
    try:
        wanted, have = parse(checkpoint), parse(node)
    except MalformedDescriptor:
        return None
    return next((n for n in FIELDS if wanted[n] is not None and have[n] != wanted[n]), None)


def check_restore(node: object, checkpoint: object, *, what: str) -> None:
    """RuntimeIncompatible (naming `what` and the reason) unless the node can restore the checkpoint."""
    problem = restore_problem(node, checkpoint)
    if problem is not None:
        raise RuntimeIncompatible(
            f"{what} cannot be restored on this node: {problem}",
            reason=problem,
            field=first_difference(node, checkpoint),
        )


def placeable(node: object, checkpoint: object) -> bool:
    """Whether placement may send a restore of `checkpoint` to a node that reported `node` (None: the node
    has not reported its runtime; it is not excluded, and checks for itself)."""
    return node is None or restore_problem(node, checkpoint) is None
