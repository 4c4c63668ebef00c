"""A template's OCI archive upload: the request body, bounded, stored as an artifact, then the build starts.

docs/adr/0055-templates-in-the-control-plane.md and docs/adr/0056 (the node's import). A build `from`
OCI_UPLOAD is recorded with the staged reference `oci:<tpl id>` in its spec and waits for
`PUT /v1/templates/{id}/source`; the archive is stored in the object store as an artifact at
`templates/<tpl id>/source` with one entry `source.tar` (parts with their SHA-256, manifest last), which the
node downloads, verifies and imports before it runs the build's steps.

Invariants:
- One upload per template: the template's `source` moves awaiting -> uploading -> uploaded by compare-and-
  swap, so a second concurrent or later upload is a Conflict (409) and never overwrites the first; a failed
  upload (too large, the client went away, the store failed) moves it back to awaiting, so it may be sent
  again, and removes what was written.
- The body is counted as it arrives and refused past the cap (TooLarge) without being held in memory: it
  is spooled to a temporary file (deleted when the request ends), then stored part by part.
- Without an object store nothing is accepted (Unavailable, 503): a node could not fetch the archive.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from typing import BinaryIO, Final

from space.controlplane.store.records import TemplateRecord
from space.controlplane.template_builds import LEASE_S, OCI_UPLOAD, SOURCE_WINDOW_S, TemplateBuilds
from space.core import errors
from space.node.agent.template_travel import source_prefix  # where the node's importer reads it
from space.objectstore.artifacts import ArtifactWriter
from space.objectstore.base import ObjectStore

UPLOADING: Final = "oci:uploading"
UPLOADED: Final = "oci:archive"
SOURCE_ENTRY: Final = "source.tar"
MAX_SOURCE_BYTES: Final = 4 << 30


def _store(objects: ObjectStore, template_id: str, spool: BinaryIO) -> None:
    writer = ArtifactWriter(
        objects, source_prefix(template_id), data_key=None, metadata={"template_id": template_id}
    )
    try:
        writer.add_stream(SOURCE_ENTRY, spool)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


async def _spool(body: AsyncIterator[bytes], spool: BinaryIO, limit: int) -> int:
    size = 0
    async for chunk in body:
        size += len(chunk)
        if size > limit:
            raise errors.TooLarge(f"an OCI archive is at most {limit} bytes", limit=limit)
        spool.write(chunk)
    if size == 0:
        raise errors.InvalidArgument("the OCI archive is empty", field="body")
    spool.flush()
    spool.seek(0)
    return size


async def receive_source(
    builds: TemplateBuilds,
    objects: ObjectStore | None,
    record: TemplateRecord,
    body: AsyncIterator[bytes],
    *,
    limit: int = MAX_SOURCE_BYTES,
) -> TemplateRecord:
    """Store `body` as the template's archive and start its build (see the module invariants)."""
    if objects is None:
        raise errors.Unavailable("building a template from an OCI archive needs object storage")
    if record.source != OCI_UPLOAD:
        raise errors.Conflict(
            f"template {record.name!r} takes no upload (it is {record.status}, built from {record.source!r})"
        )
    claimed = await asyncio.to_thread(
        builds.store.move_template_source, record.id, expected=OCI_UPLOAD, to=UPLOADING,
        owner=builds.owner, lease_s=SOURCE_WINDOW_S,
    )  # fmt: skip
    if claimed is None:
        raise errors.Conflict(f"template {record.name!r} already has its source (or is being sent it)")
    try:
        with tempfile.TemporaryFile(prefix="space-template-source-") as spool:
            await _spool(body, spool, limit)
            await asyncio.to_thread(_store, objects, record.id, spool)
    except BaseException:
        await asyncio.shield(
            asyncio.to_thread(
                builds.store.move_template_source,
                record.id,
                expected=UPLOADING,
                to=OCI_UPLOAD,
                owner=builds.owner,
                lease_s=SOURCE_WINDOW_S,
            )
        )
        raise
    uploaded = await asyncio.to_thread(
        builds.store.move_template_source, record.id, expected=UPLOADING, to=UPLOADED,
        owner=builds.owner, lease_s=LEASE_S,
    )  # fmt: skip
    if uploaded is None:
        raise errors.Conflict(f"template {record.name!r} was settled while its source was uploaded")
    return await builds.launch_uploaded(uploaded)
