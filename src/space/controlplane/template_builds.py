"""The control plane's template builds: record, drive on a node, log, settle; delete; converge (ADR 0055).

A build request is recorded as a `building` template (store.templates) leased to this control plane, then
driven in a background task: the node's NDJSON build stream (`POST /node/v1/templates/{node_name}/build`,
docs/adr/0054-template-build.md) is read line by line, its log lines appended to the template's bounded log,
and its final item settles the row (`done` -> ready, `error` -> failed).

Invariants:
- The row is `building` BEFORE the node is asked (so a crash leaves a row to settle, never a node template
  nobody knows of), under a lease this process renews every RENEW_S while the stream lasts.
- A build ends in exactly one compare-and-swap: ready (only under this process's lease) or failed; a
  stream that ends without a result, a node that cannot be reached, and a stop of this process all fail
  the build with the reason (a build is not resumed: its sandbox on the node is gone with the stream).
- Convergence (`sweep`, at start-up and every SWEEP_S): a `building` row whose lease passed, or whose
  owner is a dead control-plane process of this host (same pid and start time test as the reconciler's
  leases), is failed and the node asked to drop any copy; a `deleting` row has its node copies removed,
  then its uploaded archive and published copy in the object store, then the row. Both are idempotent
  and safe on several replicas (every change is a guarded swap).
- A template is deleted only when none of its project's sandboxes (not deleted) was made from it: a
  suspended or stopped sandbox still needs its template to be restored or started elsewhere (409).
- `from` names what the user sees (a built-in, a project template's name or id, `oci:<ref>`); the node gets
  the node-level name, and only a ready template of the same project can be built upon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, Protocol

from space.controlplane import template_catalog
from space.controlplane.reconciler.loop import process_start_time
from space.controlplane.scheduler import schedulable_nodes
from space.controlplane.store.records import NodeRecord, TemplateRecord
from space.controlplane.store.store import Store
from space.core import errors, ids
from space.core.template_spec import TemplateBuildSpec, parse_build_spec
from space.core.template_states import TemplateStatus
from space.node.agent.template_travel import published_prefix, source_prefix
from space.objectstore.artifacts import delete_artifact
from space.objectstore.base import ObjectStore

log = logging.getLogger(__name__)

LEASE_S: Final = 30.0
RENEW_S: Final = 10.0
SWEEP_S: Final = 15.0
SOURCE_WINDOW_S: Final = 3600.0  # how long a build from an OCI upload waits for (and holds) its upload
#: `from` of a build whose OCI archive is uploaded afterwards (PUT /v1/templates/{id}/source).
OCI_UPLOAD: Final = "oci:upload"
LOG_FLUSH_S: Final = 0.25  # log lines are written in batches at most this old
LOG_BATCH: Final = 256
MAX_LINE: Final = 8 * 1024


class NodeTemplateCalls(Protocol):
    """The node RPC calls a template build needs (space.node.rpc, ADR 0054)."""

    def build_template(self, name: str, spec: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    async def delete_template(self, name: str) -> Any: ...


NodeCalls = Callable[[str], NodeTemplateCalls]


def choose_build_node(store: Store, base: str | None, fresh_s: float | None) -> NodeRecord:
    """A ready, fresh node for a build: one that holds the base template first, then the most free memory."""
    nodes = schedulable_nodes(store, fresh_s)
    if not nodes:
        raise errors.ResourceExhausted("no ready node with a fresh heartbeat can build a template now")

    def rank(node: NodeRecord) -> tuple[bool, float, str]:
        free = float((node.capacity or {}).get("memory_mb", 0)) - float((node.used or {}).get("memory_mb", 0))
        return (base is not None and base in (node.templates or []), free, node.id)

    return max(nodes, key=rank)


def _dead_local_owner(owner: str | None) -> bool:
    """True when `owner` names a control-plane process of this host that is gone."""
    parts = (owner or "").split(":")
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    return process_start_time(int(parts[1])) != parts[2]


class TemplateBuilds:
    """Every template build this control plane drives, and the sweep that converges the others."""

    def __init__(
        self,
        store: Store,
        nodes: NodeCalls,
        *,
        owner: str,
        fresh_s: float | None = None,
        objects: ObjectStore | None = None,
    ) -> None:
        """`objects`: the object store a deletion removes the template's uploaded archive and published copy
        from (None: there is none)."""
        self.store = store
        self.nodes = nodes
        self.owner = owner
        self.fresh_s = fresh_s
        self.objects = objects
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # -- build --------------------------------------------------------------------------------------------
    async def start(self, project_id: str, name: object, raw_spec: Any) -> TemplateRecord:
        """Record a build of `raw_spec` as the project's template `name` and start driving it; a build `from`
        OCI_UPLOAD waits (SOURCE_WINDOW_S) for its archive instead (template_sources)."""
        valid_name = template_catalog.check_new_name(name)
        if not isinstance(raw_spec, dict):
            raise errors.InvalidArgument("spec must be a JSON object", field="spec")
        template_id = ids.new_template_id()
        source, wire = raw_spec.get("from"), dict(raw_spec)
        awaiting = source == OCI_UPLOAD
        if awaiting:
            wire["from"] = f"oci:{template_id}"  # the staged archive's reference (docs/adr/0056)
        elif isinstance(source, str) and source.startswith("oci:"):
            raise errors.InvalidArgument(
                f"an OCI archive is built from {OCI_UPLOAD!r}, then uploaded to the template's source",
                field="spec.from",
            )
        elif isinstance(source, str):
            base = await asyncio.to_thread(template_catalog.find, self.store, project_id, source)
            wire["from"] = template_catalog.require_ready(base)
        spec = parse_build_spec(wire)
        node = None
        if not awaiting:
            node = await asyncio.to_thread(choose_build_node, self.store, spec.base_template, self.fresh_s)
        record = await asyncio.to_thread(
            self.store.create_template, project_id, valid_name, spec=spec.wire(), source=str(source),
            node_id=node.id if node else None, lease_owner=self.owner,
            lease_s=SOURCE_WINDOW_S if awaiting else LEASE_S, template_id=template_id,
        )  # fmt: skip
        if not awaiting:
            self._launch(record, spec)
        return record

    async def launch_uploaded(self, record: TemplateRecord) -> TemplateRecord:
        """Start the build of a template whose OCI archive was just stored (under this process's lease)."""
        spec = parse_build_spec(record.spec)
        node = await asyncio.to_thread(choose_build_node, self.store, None, self.fresh_s)
        assigned = await asyncio.to_thread(self.store.assign_template_node, record.id, self.owner, node.id)
        if assigned is None:
            raise errors.Conflict(f"template {record.name!r} was settled while its source was uploaded")
        self._launch(assigned, spec)
        return assigned

    def _launch(self, record: TemplateRecord, spec: TemplateBuildSpec) -> None:
        task = asyncio.create_task(self._drive(record, spec), name=f"template build {record.id}")
        self._tasks[record.id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(record.id, None))

    def building_here(self) -> int:
        return len(self._tasks)

    async def _drive(self, record: TemplateRecord, spec: TemplateBuildSpec) -> None:
        logs = _LogWriter(self.store, record.id)
        renewing = asyncio.create_task(self._renew(record.id, logs))
        outcome: str | None = "the node's build stream ended without a result"
        try:
            assert record.node_id is not None
            stream = self.nodes(record.node_id).build_template(record.node_name, spec.wire())
            async for item in stream:
                if "log" in item:
                    await logs.add(str(item["log"]))
                elif "done" in item:
                    await logs.flush()  # the node's lines before the last one
                    outcome = await self._finish(record, item["done"])
                    break
                elif "error" in item:
                    outcome = _error_text(item["error"])
                    break
        except errors.SpaceError as exc:
            outcome = f"{exc.code}: {exc.message}"
        except asyncio.CancelledError:
            outcome = "the control plane driving the build stopped"
            raise
        finally:
            renewing.cancel()
            await _quietly(logs.flush())
            if outcome is not None:
                await _quietly(self._fail(record, outcome))

    async def _finish(self, record: TemplateRecord, done: Any) -> str | None:
        """Settle a build the node finished (None: settled; else why it failed)."""
        done = done if isinstance(done, dict) else {}
        metadata = done.get("metadata") if isinstance(done.get("metadata"), dict) else {}
        size = done.get("size_bytes")
        # The line first: a log follower that sees the status settled has every line by then.
        await asyncio.to_thread(self.store.append_template_log, record.id, ["build finished: template ready"])
        finished = await asyncio.to_thread(
            self.store.finish_template, record.id, self.owner, node_id=record.node_id,
            size_bytes=size if isinstance(size, int) and not isinstance(size, bool) else None,
            default_user=_short(metadata.get("default_user")), workdir=_short(metadata.get("workdir")),
        )  # fmt: skip
        if finished is None:
            return "the build was settled elsewhere (its lease passed) before the node finished it"
        return None

    async def _fail(self, record: TemplateRecord, reason: str) -> None:
        current = await asyncio.to_thread(self.store.get_template, record.project_id or "", record.id)
        if (
            current is None
            or current.status != TemplateStatus.BUILDING.value
            or current.lease_owner != self.owner
        ):
            return  # settled (or deleted) elsewhere
        await asyncio.to_thread(self.store.append_template_log, record.id, [f"build failed: {reason}"])
        failed = await asyncio.to_thread(self.store.fail_template, record.id, reason, owner=self.owner)
        if failed is not None:
            await self._drop_node_copy(failed)

    async def _renew(self, template_id: str, logs: _LogWriter) -> None:
        """While the build runs: flush lines a quiet stream left waiting; renew the lease every RENEW_S."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(LOG_FLUSH_S)
            with contextlib.suppress(errors.SpaceError):
                await logs.flush()
                if time.monotonic() - renewed >= RENEW_S:
                    await asyncio.to_thread(self.store.renew_template_lease, template_id, self.owner, LEASE_S)
                    renewed = time.monotonic()

    # -- delete -------------------------------------------------------------------------------------------
    async def delete(self, project_id: str, record: TemplateRecord) -> bool:
        """Delete a project template: refused (409) while sandboxes of it exist; its build is stopped. True:
        gone; False: `deleting`, a node still holds a copy (or is still winding its build down), and the
        sweep finishes the deletion when it answers."""
        in_use = await asyncio.to_thread(self.store.sandboxes_of_template, project_id, record.node_name)
        if in_use:
            raise errors.Conflict(
                f"template {record.name!r} is used by {in_use} sandbox(es) of the project: delete them first",
                sandboxes=in_use,
            )
        marked = await asyncio.to_thread(self.store.mark_template_deleting, project_id, record.id)
        if marked is None:
            raise template_catalog.not_found(record.id)
        task = self._tasks.get(record.id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        try:
            await self._remove(marked)
        except errors.Unavailable as exc:
            log.info("template %s: deletion left to the sweep: %s", record.id, exc.message)
            return False
        return True

    async def _remove(self, record: TemplateRecord) -> None:
        await self._drop_node_copy(record, strict=True)
        if self.objects is not None:  # its uploaded archive and its published copy (docs/adr/0056)
            for prefix in (source_prefix(record.id), published_prefix(record.node_name)):
                await asyncio.to_thread(delete_artifact, self.objects, prefix)
        await asyncio.to_thread(self.store.purge_template, record.id)

    async def _drop_node_copy(self, record: TemplateRecord, *, strict: bool = False) -> None:
        """Ask every node that holds (or built) the template to drop it. strict: a node that cannot be
        reached leaves the row for the next sweep (Unavailable); else failures are only logged."""
        nodes = await asyncio.to_thread(self.store.list_nodes, None)
        holders = {n.id for n in nodes if record.node_name in (n.templates or []) and n.status == "ready"}
        if record.node_id is not None and any(n.id == record.node_id and n.status == "ready" for n in nodes):
            holders.add(record.node_id)
        for node_id in sorted(holders):
            try:
                await self.nodes(node_id).delete_template(record.node_name)
            except errors.NotFound:
                continue
            except errors.SpaceError as exc:
                if strict:
                    raise errors.Unavailable(
                        f"template {record.name!r} could not be removed from node {node_id} yet "
                        f"({exc.code}); it is deleted when the node answers"
                    ) from exc
                log.warning("template %s: node %s kept its copy: %s", record.id, node_id, exc)

    # -- convergence --------------------------------------------------------------------------------------
    async def sweep(self) -> list[str]:
        """Fail abandoned builds, finish deletions; returns the ids it settled (see the module invariants)."""
        settled = []
        now = await asyncio.to_thread(self.store.now)
        for record in await asyncio.to_thread(self.store.expired_builds, now):
            if record.id in self._tasks:
                continue
            why = "the control plane driving the build stopped before it ended"
            if record.node_id is None:
                why = f"no OCI archive was uploaded within {SOURCE_WINDOW_S:.0f} s"
            failed = await asyncio.to_thread(self.store.fail_template, record.id, why, expired_before=now)
            if failed is not None:
                settled.append(record.id)
                await self._drop_node_copy(failed)
        settled += await self._fail_dead_owners()
        for record in await asyncio.to_thread(self.store.templates_in_status, TemplateStatus.DELETING):
            with contextlib.suppress(errors.SpaceError):
                await self._remove(record)
                settled.append(record.id)
        return settled

    async def _fail_dead_owners(self) -> list[str]:
        settled = []
        for record in await asyncio.to_thread(self.store.templates_in_status, TemplateStatus.BUILDING):
            awaiting_upload = record.source == OCI_UPLOAD  # any replica may still take the upload
            if record.id in self._tasks or awaiting_upload or not _dead_local_owner(record.lease_owner):
                continue
            failed = await asyncio.to_thread(
                self.store.fail_template, record.id,
                "the control plane driving the build stopped before it ended", owner=record.lease_owner,
            )  # fmt: skip
            if failed is not None:
                settled.append(record.id)
                await self._drop_node_copy(failed)
        return settled

    async def run_forever(self) -> None:
        while True:
            try:
                await self.sweep()
            except errors.SpaceError as exc:
                log.warning("template sweep: %s", exc)
            await asyncio.sleep(SWEEP_S)

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _LogWriter:
    """Batches a build's log lines into the store: LOG_BATCH lines at a time, and what waits every LOG_FLUSH_S
    (the build's renewing task flushes)."""

    def __init__(self, store: Store, template_id: str) -> None:
        self.store = store
        self.template_id = template_id
        self.pending: list[str] = []

    async def add(self, line: str) -> None:
        self.pending.append(line[:MAX_LINE])
        if len(self.pending) >= LOG_BATCH:
            await self.flush()

    async def flush(self) -> None:
        lines, self.pending = self.pending, []
        if lines:
            await asyncio.to_thread(self.store.append_template_log, self.template_id, lines)


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return f"{str(error.get('code', 'build_failed'))[:64]}: {str(error.get('message', ''))[:2000]}"
    return str(error)[:2000]


def _short(value: Any) -> str | None:
    return value[:1024] if isinstance(value, str) and value else None


async def _quietly(step: Any) -> None:
    """Run a settling step that must not mask the error (or cancellation) being handled."""
    try:
        await asyncio.shield(step)
    except (errors.SpaceError, asyncio.CancelledError) as exc:
        log.warning("template build settling step failed: %r", exc)
