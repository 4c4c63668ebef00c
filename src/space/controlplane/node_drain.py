"""The drain round: moves every sandbox off the nodes an operator drains (docs/adr/0065-node-operations.md).

A drain never moves a sandbox itself. It only changes desired states, by compare-and-swap on the sandbox's
generation, and the reconciler's existing crash-safe steps (suspend, restore, start) do the work:

    running | paused  --desired suspended-->  suspended (to object storage, off the node)
    stopped           --desired running---->  running, then as above (its disk is only on the node)
    suspended (moved) --desired = what it was-->  restored on another node (the scheduler never picks a
                                                 cordoned one); no node with room: it stays suspended
                                                 and the reconciler retries the restore with back-off

Invariants:
- Level-triggered and crash-safe: each round reads the node and its sandboxes as they are now. What the
  drain moved is remembered on the node's record (`space.drain.<sandbox id>` -> its desired state, written
  BEFORE its desired state is changed, forgotten only AFTER the wish is given back), so a control plane
  killed at any point of a drain converges on the next round of any replica, and every sandbox gets back
  the state its owner wanted.
- A sandbox in the middle of a step, or with a wish of its owner not yet met, is left alone until it
  settles; a failed sandbox holds nothing and does not keep a node from being drained.
- A node becomes `drained` only when no sandbox but failed ones is recorded on it and nothing it moved
  waits for its wish: a drained node is empty and can be removed.
- An uncordon ends a drain: sandboxes not yet off the node get their wish back in place once no step is
  in flight (also after a suspend that failed for good, e.g. without object storage); ones already
  suspended are restored as usual.
"""

from __future__ import annotations

import contextlib
import logging

from space.controlplane.store.records import NodeRecord, SandboxRecord
from space.controlplane.store.store import Store
from space.core import errors, node_states
from space.core.lifecycle import IN_PROGRESS_STATES, State
from space.core.node_states import NodeAdmin, NodeAdminEvent

log = logging.getLogger("space.controlplane.drain")

#: States a drain starts moving (their owner's wish met: nothing in flight).
_MOVABLE = frozenset({State.RUNNING, State.PAUSED, State.STOPPED})
#: States that hold nothing on the node: they do not keep it from being drained.
_HOLD_NOTHING = frozenset({State.FAILED, State.DELETED, State.SUSPENDED})


def _wish(store: Store, sb: SandboxRecord, desired: State) -> bool:
    """Ask for `desired` at the generation read (a concurrent change wins; the next round looks again)."""
    if sb.desired_state == desired:
        return False
    with contextlib.suppress(errors.Conflict, errors.InvalidState, errors.NotFound):
        store.set_desired(sb.id, desired, sb.generation)
        return True
    return False


def _move_off(store: Store, node: NodeRecord, sb: SandboxRecord, entries: dict[str, str]) -> bool:
    """One step of moving `sb` off a draining node; True when a wish was changed."""
    if sb.id not in entries:
        if sb.state not in _MOVABLE or sb.desired_state != sb.state:
            return False  # a step or its owner's wish under way: wait until it settles
        store.note_drain(node.id, sb.id, sb.state.value)  # before the change: a crash remembers it
        entries[sb.id] = sb.state.value
    if sb.state in (State.RUNNING, State.PAUSED) and sb.desired_state in (State.RUNNING, State.PAUSED):
        return _wish(store, sb, State.SUSPENDED)
    if sb.state == State.STOPPED and sb.desired_state == State.STOPPED:
        return _wish(store, sb, State.RUNNING)  # its disk is only on this node: start, then suspend
    return False


def _give_back(store: Store, node: NodeRecord, sandbox_id: str, wish: str, draining: bool) -> bool | None:
    """Settle one remembered sandbox: True (wish given back), False (nothing to do yet), None (forgotten)."""
    sb = store.load_sandbox(sandbox_id)
    if sb is None or State.DELETED in (sb.state, sb.desired_state) or sb.state == State.FAILED:
        store.note_drain(node.id, sandbox_id, None)
        return None
    if sb.node_id == node.id:
        if draining or sb.state in IN_PROGRESS_STATES:
            return False  # still being moved off; or (uncordoned meanwhile) mid-step: wait until it settles
    elif not (sb.state == State.SUSPENDED and sb.desired_state == State.SUSPENDED):
        store.note_drain(node.id, sandbox_id, None)  # moved elsewhere already, or its owner changed it
        return None
    changed = _wish(store, sb, State(wish))  # restored elsewhere (or, uncordoned, given back in place)
    store.note_drain(node.id, sandbox_id, None)  # after the change: a crash repeats it, harmlessly
    return changed


def drain_node(store: Store, node: NodeRecord) -> int:
    """One round for one node; the number of wishes changed (the caller pokes the reconciler)."""
    admin = node_states.of_labels(node.labels)
    entries = node_states.drain_entries(node.labels)
    draining = admin is NodeAdmin.DRAINING
    if not draining and not entries:
        return 0
    changed = 0
    held = [sb for sb in store.list_sandboxes_on_node(node.id) if sb.state not in _HOLD_NOTHING]
    if draining:
        changed += sum(_move_off(store, node, sb, entries) for sb in held)
    remaining = 0
    for sandbox_id, wish in sorted(entries.items()):
        outcome = _give_back(store, node, sandbox_id, wish, draining)
        changed += bool(outcome)
        remaining += outcome is False
    if draining and not held and not remaining:
        with contextlib.suppress(errors.InvalidState, errors.NotFound):  # uncordoned or removed meanwhile
            store.node_admin_event(node.id, NodeAdminEvent.DRAINED)
            log.info("node %s: drained", node.id)
    return changed


def drain_round(store: Store) -> int:
    """One round over every node that is draining or has moved sandboxes to settle."""
    changed = 0
    for node in store.list_nodes(None):
        if node_states.of_labels(node.labels) is NodeAdmin.DRAINING or node_states.drain_entries(node.labels):
            changed += drain_node(store, node)
    return changed
