"""User templates through object storage (docs/adr/0056-oci-import-and-template-travel.md): publishing a
template built or imported here, fetching one a node lacks on its first use, and importing an OCI image
archive the control plane stored.

Object store layout:
- `templates/user/<tpl-name>`: a published user template, one artifact (entry `template.stream`, a `btrfs
  send -p <template base>` delta; the manifest's metadata carries the template's metadata), manifest last.
- `templates/<tpl id>/source`: an uploaded image archive (entry `source.tar`), written by the control plane.

Invariants:
- Concurrent first uses of one template on one node share ONE download and ONE receive: a single flight
  per (agent, template name). A flight that fails is forgotten, so the next caller tries again; callers
  waiting on it get its error.
- Every part is verified (sha256, size) before the helper sees the file; the helper receives only a delta
  onto this node's base that creates exactly the named template, and writes its metadata last.
- A fetched template gets its warm start before the flight ends, so the creates that waited restore it
  instead of each booting cold; then the agent's `template_arrived` hook is told its name (the node's
  info and heartbeat report it, so the scheduler prefers this node for it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import weakref
from typing import TYPE_CHECKING, Any, Protocol, cast

from space.core import errors
from space.node.agent import transfer
from space.objectstore.artifacts import Manifest, read_manifest
from space.objectstore.base import ObjectStore

if TYPE_CHECKING:
    from space.node.agent.helper_client import HelperClient
    from space.node.drivers.base import Driver, Progress

log = logging.getLogger("space.node.agent.template_travel")

USER_PREFIX = "tpl-"
STREAM = "template.stream"
SOURCE = "source.tar"


class TravelAgent(Protocol):
    """What this module needs of a NodeAgent."""

    driver: Driver
    store: ObjectStore | None

    async def ensure_warm(self, template: str, progress: Progress | None = None) -> None: ...


def published_prefix(name: str) -> str:
    """Where user template `name` (node-level `tpl-<hex>`) is published."""
    return f"templates/user/{name}"


def source_prefix(tpl_id: str) -> str:
    """Where the control plane stores the uploaded image archive of template `tpl_id` (entry source.tar)."""
    return f"templates/{tpl_id}/source"


def is_user_template(name: str) -> bool:
    return name.startswith(USER_PREFIX)


def _helper(agent: TravelAgent) -> HelperClient:
    helper = getattr(agent.driver, "helper", None)
    if helper is None:
        raise errors.Unavailable("this node's driver keeps no user templates (no helper)")
    return cast("HelperClient", helper)


def _store(agent: TravelAgent) -> ObjectStore:
    if agent.store is None:
        raise errors.Unavailable("this node has no object store: user templates cannot travel to it")
    return agent.store


async def held(agent: TravelAgent, name: str) -> dict[str, Any] | None:
    """The metadata of complete template `name` on this node, or None."""
    listing = await _helper(agent).call("template.list")
    for entry in listing.get("templates", []):
        if entry.get("name") == name:
            return dict(entry.get("metadata") or {})
    return None


# -- publish ------------------------------------------------------------------------------------------------
async def publish_template(agent: TravelAgent, name: str) -> Manifest:
    """Upload user template `name` (a send -p base delta and its metadata; manifest last). Publishing the
    same template twice writes the same thing again (the writer clears what a killed upload left)."""
    store = _store(agent)
    if not is_user_template(name):
        raise errors.InvalidArgument(
            f"only user templates are published this way, not {name!r}", field="name"
        )
    helper = _helper(agent)
    result = await helper.call("template.export", {"name": name}, timeout=1800.0)
    try:
        files = {str(k): int(v) for k, v in dict(result["files"]).items()}
        manifest, timings = await asyncio.to_thread(
            transfer.upload, store, published_prefix(name), pathlib.Path(str(result["dir"])), files,
            data_key=None, metadata=dict(result["metadata"]),
        )  # fmt: skip
    finally:
        await helper.call("staging.release", {"kind": "template-export", "template": name})
    log.info("template %s published to %s (%.0f ms)", name, manifest.prefix, timings["upload_ms"])
    return manifest


# -- fetch (one flight per template and node) -------------------------------------------------------------
_flights: weakref.WeakKeyDictionary[object, dict[str, asyncio.Task[dict[str, Any]]]] = (
    weakref.WeakKeyDictionary()
)


async def fetch_template(agent: TravelAgent, name: str) -> dict[str, Any]:
    """Make user template `name` available here, fetching it from the object store if this node lacks it.
    Concurrent callers share one flight; a failed flight is forgotten so the next call retries."""
    flights = _flights.setdefault(agent, {})
    task = flights.get(name)
    if task is None:
        task = asyncio.get_running_loop().create_task(_fetch(agent, name))
        flights[name] = task
        task.add_done_callback(lambda done: _land(flights, name, done))
    return await asyncio.shield(task)


def _land(
    flights: dict[str, asyncio.Task[dict[str, Any]]], name: str, task: asyncio.Task[dict[str, Any]]
) -> None:
    if flights.get(name) is task:
        del flights[name]  # success or failure: the next first use asks again (and finds it held)
    if not task.cancelled():
        task.exception()  # retrieved: a flight nobody awaits any more logs nothing at collection


async def ensure_template_here(agent: TravelAgent, name: str) -> None:
    """Before a create of `name`: a user template this node lacks is fetched (one flight); built-ins and
    nodes without a store are left to the create itself (which says NotFound)."""
    if not is_user_template(name) or agent.store is None or getattr(agent.driver, "helper", None) is None:
        return
    if await held(agent, name) is None:
        await fetch_template(agent, name)


async def _fetch(agent: TravelAgent, name: str) -> dict[str, Any]:
    meta = await held(agent, name)
    if meta is not None:
        return meta
    store = _store(agent)
    try:
        manifest = await asyncio.to_thread(read_manifest, store, published_prefix(name))
    except errors.NotFound as exc:
        raise errors.NotFound(
            f"template {name!r} is neither on this node nor published", template=name
        ) from exc
    template_meta = manifest.metadata.get("template_metadata")
    if manifest.metadata.get("kind") != "user-template" or not isinstance(template_meta, dict):
        raise errors.ArtifactCorrupt(f"{manifest.prefix} is not a user template", reason="bad_manifest")
    if set(manifest.entries) != {STREAM}:
        raise errors.ArtifactCorrupt(f"{manifest.prefix} holds unexpected entries", reason="bad_entry")
    helper = _helper(agent)
    staged = await helper.call("staging.prepare", {"kind": "template-import", "template": name})
    try:
        await asyncio.to_thread(
            transfer.download, store, manifest, pathlib.Path(str(staged["dir"])), data_key=None, skip=set()
        )
        result = await helper.call(
            "template.import", {"name": name, "metadata_json": json.dumps(template_meta)}, timeout=1800.0
        )
    finally:
        await helper.call("staging.release", {"kind": "template-import", "template": name})
    await _warm(agent, name)
    log.info("template %s fetched from %s", name, manifest.prefix)
    arrived = getattr(agent, "template_arrived", None)
    if arrived is not None:
        arrived(name)  # the node reports it from now on (its heartbeat's templates)
    return dict(result.get("metadata") or template_meta)


async def _warm(agent: TravelAgent, name: str) -> None:
    try:
        await agent.ensure_warm(name)
    except errors.SpaceError as exc:  # the template works without it: its sandboxes boot cold
        log.warning("template %s: no warm start (%s)", name, exc.message)


# -- OCI image archives -------------------------------------------------------------------------------------
def imported_name(name: str) -> str:
    """The node-level template an image archive is unpacked into, for the build of `name` to run on."""
    return f"{name}-oci"


async def import_oci(agent: TravelAgent, name: str, ref: str | None) -> str:
    """Unpack the image archive the control plane stored for `ref` (a template id) into template
    `<name>-oci` and answer that name: the build of `name` runs its steps on top of it."""
    if ref is None:
        raise errors.InvalidArgument("no OCI archive named", field="from")
    store = _store(agent)
    target = imported_name(name)
    if await held(agent, target) is not None:
        return target
    try:
        manifest = await asyncio.to_thread(read_manifest, store, source_prefix(ref))
    except errors.NotFound as exc:
        raise errors.NotFound(f"no image archive was uploaded for {ref!r}", field="from") from exc
    if set(manifest.entries) != {SOURCE}:
        raise errors.InvalidArgument(f"{manifest.prefix} holds no single {SOURCE}", field="from")
    helper = _helper(agent)
    staged = await helper.call("staging.prepare", {"kind": "oci-import", "template": target})
    try:
        await asyncio.to_thread(
            transfer.download, store, manifest, pathlib.Path(str(staged["dir"])), data_key=None, skip=set()
        )
        await helper.call("template.import_oci", {"name": target, "source": f"oci:{ref}"}, timeout=3600.0)
    finally:
        await helper.call("staging.release", {"kind": "oci-import", "template": target})
    return target
