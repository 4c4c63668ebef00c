"""Moving staged files between a node and object storage (the agent's side of suspend, restore, templates).

The driver stages what leaves the node (space.node.drivers.base.StagedFiles) and takes in what arrives; this
module only streams files into artifacts and back. Everything here is synchronous and blocking: callers run
it in a thread (asyncio.to_thread), so the event loop keeps serving other sandboxes.

Invariants:
- Memory stays bounded: files are streamed part by part (ArtifactWriter.add_file, read_entry into a file).
- An artifact is written with its manifest last (ArtifactWriter.commit), and a writer that fails is aborted,
  so a half-written artifact is never restorable.
- Every entry is downloaded and verified (sha256 and size of each part, GCM tag when encrypted) before the
  caller hands the files to the driver; a corrupt part raises errors.ArtifactCorrupt and the caller drops
  the whole download.
- Entry names from a manifest are checked against a fixed pattern before they become file names: a forged
  manifest cannot write outside the staging directory.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from space.core import errors, tracing
from space.crypto.envelope import DataKey
from space.objectstore.artifacts import ArtifactWriter, Manifest, read_entry, read_manifest
from space.objectstore.base import ObjectStore

#: What a checkpoint or base artifact may contain: the disk delta, image files, the sandbox spec; a user
#: template's delta and an uploaded image archive (space.node.agent.template_travel).
LAYER = tracing.Layer("space.node")
ENTRY_NAME = re.compile(
    r"(disk\.stream|disk\.tar|base\.stream|sandbox\.json|template\.stream|source\.tar"
    r"|image/[A-Za-z0-9][A-Za-z0-9._-]{0,127})"
)


def template_prefix(base_name: str, version: str) -> str:
    """Where a template base lives in object storage (the same key on every node)."""
    return f"templates/{base_name}/{version}"


def existing_manifest(store: ObjectStore, prefix: str) -> Manifest | None:
    try:
        return read_manifest(store, prefix)
    except errors.NotFound:
        return None


@tracing.timed(LAYER, "objectstore.upload")  # a span when called within a trace (ADR 0072)
def upload(
    store: ObjectStore,
    prefix: str,
    directory: Path,
    files: dict[str, int],
    *,
    data_key: DataKey | None,
    metadata: dict[str, Any],
    extra: dict[str, bytes] | None = None,
) -> tuple[Manifest, dict[str, float]]:
    """Write one artifact from staged files (+ small in-memory entries); manifest last, read back."""
    started = time.monotonic()
    writer = ArtifactWriter(store, prefix, data_key=data_key, metadata=metadata)
    try:
        for name in sorted(files):
            if ENTRY_NAME.fullmatch(name) is None:
                raise errors.InvalidArgument(f"refusing to upload an entry named {name!r}")
            writer.add_file(name, directory / name)
        for name, data in sorted((extra or {}).items()):
            writer.add_bytes(name, data)
        manifest = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return manifest, {"upload_ms": (time.monotonic() - started) * 1000}


@tracing.timed(LAYER, "objectstore.download")
def download(
    store: ObjectStore, manifest: Manifest, directory: Path, *, data_key: bytes | None, skip: set[str]
) -> dict[str, float]:
    """Every entry (except `skip`) into `directory/<name>`, each part verified before it is written."""
    started = time.monotonic()
    for name in sorted(manifest.entries):
        if ENTRY_NAME.fullmatch(name) is None:
            raise errors.ArtifactCorrupt(
                f"artifact {manifest.prefix!r} names an unexpected entry {name!r}",
                part=name,
                reason="bad_entry",
            )
        if name in skip:
            continue
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            read_entry(store, manifest, name, out, data_key=data_key)
    return {"download_ms": (time.monotonic() - started) * 1000}
