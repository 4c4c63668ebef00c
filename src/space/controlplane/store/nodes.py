"""Nodes: registration, enrolment, re-registration, heartbeats and liveness.

Invariants:
- A node's url is unique. `enrol_node` (a NEW node) never takes a url another node holds, and
  `reregister_node` (an EXISTING node) requires the identity of its enrolment (ADR 0021); only the
  trusted `register_node` (operators' tools, tests) registers by url unchecked.
- Secrets are kept as SHA-256 digests (the node's identity); the node's RPC token, which the control
  plane must present, only sealed by the caller (ADR 0021).
- Every registration stamps the same fields (`_set_registration`): RPC token, capacity, templates,
  labels, status and heartbeat time.
- A heartbeat moves a sandbox's last activity only for sandboxes assigned to that node, never backwards.
- `mark_lost` returns only the nodes it changed, so exactly one caller acts on each loss.
- The operator's admin state (cordon, drain: space.core.node_states, ADR 0065) and a drain's bookkeeping
  live under the reserved `space.` labels, which every registration keeps: a drained node that restarts,
  is upgraded or was lost comes back cordoned. Admin changes take the node's row lock.
- A node is removed only when no sandbox but deleted or failed ones is recorded on it, and only when it
  is cordoned, drained, lost or offline (an active ready node could be given a sandbox meanwhile); the
  references of its deleted and failed sandboxes and of its snapshots are cleared in the same
  transaction, and its identity goes with the row (its next call is a 401).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, get_args

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

from space.controlplane.store.database import Repository
from space.controlplane.store.digests import MAX_SECRET_LENGTH, hash_secret, matches, plausible_secret
from space.controlplane.store.enrolment_tokens import consume_enrolment
from space.controlplane.store.mapping import node_record
from space.controlplane.store.models import Node, Sandbox, Snapshot
from space.controlplane.store.records import RELEASE_KEY, NodeRecord, NodeStatus
from space.controlplane.store.values import aware, seconds, text
from space.core import ids, node_states
from space.core.errors import AlreadyExists, Conflict, InvalidArgument, InvalidState, NotFound
from space.core.lifecycle import State
from space.core.node_states import NodeAdmin, NodeAdminEvent

_NODE_STATUSES: Final = frozenset(get_args(NodeStatus))
URL_LENGTH: Final = 512


def _set_registration(
    row: Node,
    now: datetime,
    *,
    rpc_token_sealed: bytes | None,
    capacity: Mapping[str, Any] | None,
    templates: Sequence[str],
    labels: Mapping[str, str] | None,
    status: str,
) -> None:
    """What every kind of registration records about the node that (re)announced itself."""
    row.rpc_token_sealed = rpc_token_sealed
    row.capacity = dict(capacity or {})
    row.templates = list(templates)
    reserved = {k: v for k, v in (row.labels or {}).items() if k.startswith(node_states.RESERVED_PREFIX)}
    given = {k: v for k, v in (labels or {}).items() if not k.startswith(node_states.RESERVED_PREFIX)}
    row.labels = {**given, **reserved}  # the operator's hold outlives any registration (ADR 0065)
    row.status = status
    row.last_heartbeat_at = now


def _url_holder(session: Session, url: str) -> Node | None:
    return session.scalars(select(Node).where(Node.url == url).with_for_update()).one_or_none()


def _move_activity(session: Session, node_id: str, activity: Mapping[str, datetime]) -> None:
    """Move the last activity of `node_id`'s sandboxes forward to what it reported (never backwards)."""
    for sandbox_id, at in sorted(activity.items()):
        when = aware(at, "activity")
        session.execute(
            update(Sandbox)
            .where(Sandbox.id == sandbox_id, Sandbox.node_id == node_id, Sandbox.last_activity_at < when)
            .values(last_activity_at=when)
            .execution_options(synchronize_session=False)
        )


class NodeRepository(Repository):
    """The nodes table."""

    def register_node(
        self,
        url: str,
        token: str,
        *,
        capacity: Mapping[str, Any] | None = None,
        templates: Sequence[str] = (),
        labels: Mapping[str, str] | None = None,
        identity: str | None = None,
        rpc_token_sealed: bytes | None = None,
    ) -> NodeRecord:
        """Register a node, idempotent by url: a node that registers again (after a restart) keeps its
        id and becomes ready; its token, capacity, templates and labels are replaced. `identity` is the
        per-node secret the caller issued for this registration (only its hash is kept); it replaces the
        previous one, so an identity from an earlier registration stops working (None: none works).

        Trusted and unchecked (operators' tools, tests): the node-facing API enrols with `enrol_node` and
        re-registers with `reregister_node`, which never let one node take another's url (ADR 0021)."""
        url = text(url, "url", URL_LENGTH)
        token = text(token, "token", MAX_SECRET_LENGTH)
        if identity is not None:
            identity = text(identity, "identity", MAX_SECRET_LENGTH)
        for _attempt in range(2):
            now = self.now()
            try:
                with self._tx(f"registering node {url}") as session:
                    row = _url_holder(session, url)
                    if row is None:
                        row = Node(id=ids.new_node_id(), url=url, registered_at=now, used={})
                        session.add(row)
                    row.token_hash = hash_secret(token)
                    row.identity_hash = hash_secret(identity) if identity is not None else None
                    _set_registration(
                        row,
                        now,
                        rpc_token_sealed=rpc_token_sealed,
                        capacity=capacity,
                        templates=templates,
                        labels=labels,
                        status="ready",
                    )
                    session.flush()
                    return node_record(row)
            except AlreadyExists:
                continue  # a concurrent first registration of the same url won; take its row
        raise Conflict(f"node {url} is being registered concurrently; retry")

    def authenticate_node(self, node_id: str, identity: str) -> NodeRecord | None:
        """The node `node_id` if `identity` is the secret issued at its latest registration, else None
        (hashes compared in constant time; the cluster's bootstrap token is never an identity)."""
        if not plausible_secret(identity):
            return None
        with self._tx("authenticating a node") as session:
            row = session.get(Node, node_id)
            if row is None or not matches(row.identity_hash, identity):
                return None
            return node_record(row)

    def node_endpoint(self, node_id: str) -> tuple[str, bytes | None] | None:
        """(url, sealed RPC token) of a node, for the node pool only (ADR 0021); None if not registered."""
        with self._tx("reading a node's endpoint") as session:
            row = session.get(Node, node_id)
            return (row.url, row.rpc_token_sealed) if row is not None else None

    def enrol_node(
        self,
        node_id: str,
        url: str,
        *,
        identity: str,
        seal_rpc_token: Callable[[str], bytes],
        capacity: Mapping[str, Any] | None = None,
        templates: Sequence[str] = (),
        labels: Mapping[str, str] | None = None,
        enrolment_token: str | None = None,
    ) -> NodeRecord:
        """A NEW node (ADR 0021) with id `node_id`: `url` must not be held by any node (AlreadyExists: the
        node that holds it re-registers with its identity, `reregister_node`; nobody takes it over with a
        bootstrap token). The one exception is a record from before per-node RPC tokens (no sealed token,
        its identity was never persisted by its node): the upgraded node at that url adopts it, keeping
        its id. `seal_rpc_token(final node id)` gives the sealed RPC token to store. With
        `enrolment_token`, one use of it is consumed in the same transaction (Unauthenticated if it is
        unknown, expired or used up), so a refused enrolment uses nothing. The identity is kept hashed."""
        ids.parse_node_id(node_id)
        url = text(url, "url", URL_LENGTH)
        identity = text(identity, "identity", MAX_SECRET_LENGTH)
        now = self.now()
        with self._tx(f"enrolling node {url}") as session:
            if enrolment_token is not None:
                consume_enrolment(session, enrolment_token, now)
            row = _url_holder(session, url)
            if row is not None and row.rpc_token_sealed is not None:
                raise AlreadyExists(
                    f"{url} is registered to node {row.id}: that node re-registers with its identity",
                    field="url",
                )
            if row is None:
                # token_hash (ADR 0009) is superseded by rpc_token_sealed: nothing checks it any more.
                row = Node(id=node_id, url=url, registered_at=now, used={}, token_hash="")
                session.add(row)
            row.identity_hash = hash_secret(identity)
            _set_registration(
                row,
                now,
                rpc_token_sealed=bytes(seal_rpc_token(row.id)),
                capacity=capacity,
                templates=templates,
                labels=labels,
                status="ready",
            )
            session.flush()
            return node_record(row)

    def reregister_node(
        self,
        node_id: str,
        identity: str,
        url: str,
        *,
        rpc_token_sealed: bytes,
        capacity: Mapping[str, Any] | None = None,
        templates: Sequence[str] = (),
    ) -> NodeRecord | None:
        """An EXISTING node registers again (a restart, a new address): it must present the identity of
        its enrolment (None if it does not: the caller answers 401). It keeps its id, identity and labels
        and becomes ready (a draining node stays draining); its url, RPC token, capacity and templates are
        replaced. A url held by another node is AlreadyExists."""
        url = text(url, "url", URL_LENGTH)
        if not plausible_secret(identity):
            return None
        now = self.now()
        with self._tx(f"re-registering node {node_id}") as session:
            row = session.get(Node, node_id, with_for_update=True)
            if row is None or not matches(row.identity_hash, identity):
                return None
            if row.url != url:
                holder = _url_holder(session, url)
                if holder is not None:
                    raise AlreadyExists(f"{url} is registered to node {holder.id}", field="url")
                row.url = url
            _set_registration(
                row,
                now,
                rpc_token_sealed=bytes(rpc_token_sealed),
                capacity=capacity,
                templates=templates,
                labels=row.labels,  # kept
                status="ready" if row.status in ("lost", "offline") else row.status,  # draining stays so
            )
            session.flush()
            return node_record(row)

    def get_node(self, node_id: str) -> NodeRecord | None:
        with self._tx("reading a node") as session:
            row = session.get(Node, node_id)
            return node_record(row) if row else None

    def heartbeat(
        self,
        node_id: str,
        *,
        used: Mapping[str, Any],
        templates: Sequence[str] | None = None,
        activity: Mapping[str, datetime] | None = None,
        capacity: Mapping[str, Any] | None = None,
        runtime: Mapping[str, Any] | None = None,
        pools: Mapping[str, int] | None = None,
        space_version: str | None = None,
    ) -> NodeRecord:
        """A node's periodic report: resource use, templates present, when given its ready pooled
        sandboxes per template (already parsed by the caller: api/node_routes.py), per-sandbox last activity
        (applied only to sandboxes assigned to this node, never moving backwards) and, when given, its
        runtime descriptor (already parsed by the caller: space.core.runtimes). A lost node that
        reports again is ready; a draining one stays draining. NotFound: register again. The SPACE release
        the node reports (ADR 0079, already parsed) is kept beside its descriptor, under RELEASE_KEY of the
        runtime column (a descriptor's reader ignores keys it does not know; no schema change)."""
        now = self.now()
        if runtime is not None and space_version is not None:
            runtime = {**runtime, RELEASE_KEY: space_version}
        statement = (
            update(Node)
            .where(Node.id == node_id)
            .values(
                used=dict(used),
                last_heartbeat_at=now,
                status=case((Node.status == "lost", "ready"), else_=Node.status),
                **({"templates": list(templates)} if templates is not None else {}),
                **({"capacity": dict(capacity)} if capacity is not None else {}),
                **({"runtime": dict(runtime)} if runtime is not None else {}),
                **({"pools": dict(pools)} if pools is not None else {}),
            )
            .returning(Node)
            .execution_options(synchronize_session=False)
        )
        with self._tx(f"heartbeat of node {node_id}") as session:
            row = session.scalars(statement).one_or_none()
            if row is None:
                raise NotFound(f"node {node_id} not registered")
            _move_activity(session, node_id, activity or {})
            return node_record(row)

    def set_node_status(self, node_id: str, status: NodeStatus) -> NodeRecord:
        if status not in _NODE_STATUSES:
            raise InvalidArgument(f"invalid node status {status!r}", field="status")
        with self._tx(f"setting node {node_id} {status}") as session:
            row = session.get(Node, node_id, with_for_update=True)
            if row is None:
                raise NotFound(f"node {node_id} not registered")
            row.status = status
            return node_record(row)

    def mark_lost(self, older_than_s: float) -> list[str]:
        """Mark nodes whose last heartbeat is older than `older_than_s` lost; return their ids (only
        the ones this call changed, so exactly one caller acts on each loss)."""
        cutoff = self.now() - seconds(older_than_s, "older_than_s")
        statement = (
            update(Node)
            .where(Node.status.in_(("ready", "draining")), Node.last_heartbeat_at < cutoff)
            .values(status="lost")
            .returning(Node.id)
            .execution_options(synchronize_session=False)
        )
        with self._tx("marking lost nodes") as session:
            return sorted(session.scalars(statement))

    def list_nodes(self, status: NodeStatus | None = "ready") -> list[NodeRecord]:
        """Nodes with `status` (default: ready ones, for the scheduler); None lists all."""
        query = select(Node)
        if status is not None:
            query = query.where(Node.status == status)
        with self._tx("listing nodes") as session:
            return [node_record(row) for row in session.scalars(query.order_by(Node.registered_at, Node.id))]

    # -- the operator's admin state (space.core.node_states, ADR 0065) ------------------------------------
    def node_admin_event(self, node_id: str, event: NodeAdminEvent) -> NodeRecord | None:
        """Apply `event` to the node's admin state under its row lock: the node after it, or None when
        `remove` removed it. NotFound for an unknown node; InvalidState (409) naming the state otherwise."""
        with self._tx(f"node {node_id}: {event.value}") as session:
            row = session.get(Node, node_id, with_for_update=True)
            if row is None:
                raise NotFound(f"node {node_id} not found")
            state = node_states.of_labels(row.labels)
            target = node_states.next_state(state, event)
            if target is None:
                self._remove(session, row, state)
                return None
            labels = dict(row.labels or {})
            labels[node_states.ADMIN_LABEL] = target.value
            if target is NodeAdmin.ACTIVE:  # an uncordon ends a drain: what it moved keeps its wish
                labels = {k: v for k, v in labels.items() if k != node_states.ADMIN_LABEL}
            row.labels = labels
            session.flush()
            return node_record(row)

    def _remove(self, session: Session, row: Node, state: NodeAdmin) -> None:
        if state is NodeAdmin.ACTIVE and row.status not in ("lost", "offline"):
            raise InvalidState(
                f"node {row.id} is {row.status} and active: cordon or drain it before removing it",
                state=state.value, event="remove",
            )  # fmt: skip
        done = (State.DELETED.value, State.FAILED.value)
        held = session.scalars(
            select(Sandbox.id).where(Sandbox.node_id == row.id, Sandbox.state.not_in(done)).limit(5)
        ).all()
        if held or node_states.drain_entries(row.labels):
            raise InvalidState(
                f"node {row.id} ({state.value}, {row.status}) still holds sandboxes "
                f"({', '.join(held) or 'being moved'}): drain it first",
                state=state.value, event="remove",
            )  # fmt: skip
        for table in (Sandbox, Snapshot):
            session.execute(
                update(table).where(table.node_id == row.id).values(node_id=None)
                .execution_options(synchronize_session=False)
            )  # fmt: skip
        session.delete(row)

    def note_drain(self, node_id: str, sandbox_id: str, desired: str | None) -> bool:
        """Record (`desired` given) or forget (None) that a drain of `node_id` is moving `sandbox_id` and
        what its desired state was. False when the node is gone."""
        with self._tx(f"node {node_id}: drain bookkeeping") as session:
            row = session.get(Node, node_id, with_for_update=True)
            if row is None:
                return False
            labels = dict(row.labels or {})
            key = node_states.DRAIN_LABEL + sandbox_id
            if desired is None:
                labels.pop(key, None)
            else:
                labels[key] = desired
            row.labels = labels
            return True

    def sandboxes_per_node(self) -> dict[str, int]:
        """node id -> how many sandboxes (any state but deleted) are recorded on it."""
        query = (
            select(Sandbox.node_id, func.count())
            .where(Sandbox.node_id.is_not(None), Sandbox.state != State.DELETED.value)
            .group_by(Sandbox.node_id)
        )
        with self._tx("counting sandboxes per node") as session:
            return {str(node_id): int(count) for node_id, count in session.execute(query).all()}
