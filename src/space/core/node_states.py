"""An operator's hold on a node as data: ONE transition table (admin state, event) -> admin state.

docs/adr/0065-node-operations.md. A node has two independent states: its liveness `status` (ready, lost,
offline: what its heartbeats say, changed only by the node and the loss timeout) and its ADMIN state (this
table: what the operator said). The admin state is kept across losses, restarts and re-registrations, so a
drained node that comes back after an upgrade stays out of placement until it is uncordoned.

    active --cordon--> cordoned           no new placements; its sandboxes stay
    active | cordoned --drain--> draining  cordoned; its sandboxes are moved off (controlplane.node_drain)
    draining --drained--> drained         nothing is left on it (reported by the drain round)
    cordoned | draining | drained --uncordon--> active
    (every state) --remove--> (row removed: only when nothing is recorded on the node, checked by the store)

Invariants (checked when this module is imported):
- Only ACTIVE nodes take new sandboxes (the scheduler); every other admin state is cordoned.
- Repeating a request in the state it leads to is a no-op (a retried CLI call succeeds): cordon in
  cordoned, drain in draining or drained, uncordon in active.
- A refused event is InvalidState (409) naming the current admin state.
- Every state allows uncordon except active (where it is the no-op) and allows remove (the store refuses a
  node that still holds sandboxes, or an active ready node, which could be given one meanwhile).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from space.core.errors import InvalidArgument, InvalidState


class NodeAdmin(StrEnum):
    ACTIVE = "active"
    CORDONED = "cordoned"
    DRAINING = "draining"
    DRAINED = "drained"


class NodeAdminEvent(StrEnum):
    CORDON = "cordon"
    UNCORDON = "uncordon"
    DRAIN = "drain"
    DRAINED = "drained"  # the drain round found nothing left on the node
    REMOVE = "remove"


A = NodeAdmin
E = NodeAdminEvent

#: None as a target: the node's record is removed.
TRANSITIONS: Final[dict[tuple[NodeAdmin, NodeAdminEvent], NodeAdmin | None]] = {
    (A.ACTIVE, E.CORDON): A.CORDONED,
    (A.CORDONED, E.CORDON): A.CORDONED,
    (A.ACTIVE, E.DRAIN): A.DRAINING,
    (A.CORDONED, E.DRAIN): A.DRAINING,
    (A.DRAINING, E.DRAIN): A.DRAINING,
    (A.DRAINED, E.DRAIN): A.DRAINED,
    (A.DRAINING, E.DRAINED): A.DRAINED,
    (A.ACTIVE, E.UNCORDON): A.ACTIVE,
    (A.CORDONED, E.UNCORDON): A.ACTIVE,
    (A.DRAINING, E.UNCORDON): A.ACTIVE,
    (A.DRAINED, E.UNCORDON): A.ACTIVE,
    **{(state, E.REMOVE): None for state in NodeAdmin},
}

#: Where the admin state and the drain's bookkeeping live: reserved keys of the node's labels, which every
#: registration keeps (no schema change; a node never sets labels under this prefix itself).
RESERVED_PREFIX: Final = "space."
ADMIN_LABEL: Final = "space.admin"
#: `space.drain.<sandbox id>` -> the desired state the sandbox had when the drain moved it (it gets it back).
DRAIN_LABEL: Final = "space.drain."

#: Admin states in which the scheduler places sandboxes on the node.
PLACEABLE: Final = frozenset({A.ACTIVE})
VALUES: Final = tuple(s.value for s in NodeAdmin)


def parse(value: str | None) -> NodeAdmin:
    """The admin state stored for a node (None or unknown: active, as for a node from before ADR 0065)."""
    try:
        return NodeAdmin(value) if value else A.ACTIVE
    except ValueError:
        return A.ACTIVE


def of_labels(labels: dict[str, str] | None) -> NodeAdmin:
    return parse((labels or {}).get(ADMIN_LABEL))


def drain_entries(labels: dict[str, str] | None) -> dict[str, str]:
    """sandbox id -> the desired state to give it back, for the sandboxes a drain is moving off the node."""
    return {k.removeprefix(DRAIN_LABEL): v for k, v in (labels or {}).items() if k.startswith(DRAIN_LABEL)}


def next_state(state: NodeAdmin, event: NodeAdminEvent | str) -> NodeAdmin | None:
    """Where `event` leads from `state` (None: the record goes); InvalidState (409) naming `state` else."""
    try:
        event = NodeAdminEvent(event)
    except ValueError as exc:
        raise InvalidArgument(f"unknown node event {event!r}", field="event") from exc
    if (state, event) not in TRANSITIONS:
        raise InvalidState(
            f"the node is {state.value}: `{event.value}` is not allowed", state=state.value, event=event.value
        )
    return TRANSITIONS[(state, event)]


def _check_table() -> None:
    for state in NodeAdmin:
        if (state, E.REMOVE) not in TRANSITIONS or (state, E.UNCORDON) not in TRANSITIONS:
            raise RuntimeError(f"node admin table: {state} must allow remove and uncordon")
    for (_state, event), target in TRANSITIONS.items():
        if event is not E.REMOVE and target is None:
            raise RuntimeError("node admin table: only remove removes the record")
        if event in (E.CORDON, E.DRAIN) and target in PLACEABLE:
            raise RuntimeError("node admin table: cordon and drain never leave a node placeable")


_check_table()
