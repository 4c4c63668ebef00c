"""The root helper's verb that turns a staged OCI image archive into a read-only user template
(docs/adr/0056-oci-import-and-template-travel.md). Not to be confused with space.node.helper.oci, which
writes the OCI *runtime* bundle of a sandbox.

Invariants:
- The archive is the agent's file `<staging>/oci-import-<name>/source.tar`, opened once without following
  any symlink (space.node.helper.staging) and reflinked into a root-only copy before it is read, so the
  agent cannot change it between the digest checks and the unpacking.
- Only user templates (`tpl-...`) are imported; built-ins are never replaced. An existing complete template
  of the name is AlreadyExists.
- The tree is made in `templates/.<name>.oci` (a fresh subvolume) and moved in read-only; its metadata file
  is written last (the completeness rule of template_build_verbs). Any failure discards the half-made
  tree and the copy: nothing is left for the next import to trip on.
- Nothing of the image runs on the host (no chroot): the guest layer is copied in beneath the tree's
  descriptor, never through a path the image controls, and is not byte-compiled (the daemon compiles in
  memory at boot, once per warm start).
"""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import shutil
import time
from typing import Any

from pydantic import Field

from space.core import errors
from space.core.template_spec import OCI_REF_PATTERN
from space.node.helper import staging
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import Params, TemplateName
from space.node.volumes import btrfs, oci_image, templates
from space.node.volumes.oci_layer import Budget, open_dir, remove_at
from space.node.volumes.template_files import (
    METADATA_FORMAT,
    discard_subvolume,
    now,
    tree_size,
    write_json_atomic,
)

SOURCE = "source.tar"
USER_PREFIX = "tpl-"
MAX_IMAGE_BYTES = 16 << 30
MAX_IMAGE_ENTRIES = 1_000_000


class OciImportParams(Params):
    name: TemplateName
    source: str = Field(pattern=f"^(?:{OCI_REF_PATTERN})$", description="the build spec's `from`")
    max_bytes: int = Field(default=MAX_IMAGE_BYTES, ge=1, le=MAX_IMAGE_BYTES)
    max_entries: int = Field(default=MAX_IMAGE_ENTRIES, ge=1, le=MAX_IMAGE_ENTRIES)


def _private_copy(staged: pathlib.Path, copy: pathlib.Path) -> None:
    """Reflink the staged archive (opened once, no symlink) into a root-only file."""
    with staging.open_staged(staged, SOURCE) as src:
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            try:
                fcntl.ioctl(out.fileno(), staging.FICLONE, src.fileno())
            except OSError:
                shutil.copyfileobj(src, out, 1 << 20)


def install_guest(root_fd: int) -> int:
    """SPACE's guest code into `<root>/opt/space/lib/space` (replacing whatever the image had there)."""
    lib = tuple(templates.GUEST_LIB.strip("/").split("/"))
    size = 0
    with open_dir(root_fd, lib, create=True, name=templates.GUEST_LIB) as lib_fd:
        remove_at(lib_fd, "space")
        for rel, data in templates.guest_files(templates.default_guest_src()):
            parts = ("space", *rel.split("/"))
            with open_dir(lib_fd, parts[:-1], create=True, name=rel) as parent:
                fd = os.open(
                    parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=parent
                )
                try:
                    os.write(fd, data)
                    os.fchmod(fd, 0o644)
                finally:
                    os.close(fd)
            size += len(data)
    return size


def _disk_error(exc: OSError, name: str) -> errors.SpaceError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return errors.StorageExhausted(f"the node's disk filled up while unpacking {name}")
    return errors.RuntimeFailure(f"unpacking {name} failed: {exc.strerror or exc}")


def template_import_oci(ctx: HelperContext, params: OciImportParams, progress: Progress) -> dict[str, Any]:
    name = params.name
    if not name.startswith(USER_PREFIX):
        raise errors.InvalidArgument(f"only user templates ({USER_PREFIX}...) are imported", field="name")
    target = ctx.layout.template(name)
    meta_path = ctx.layout.templates / f"{name}.json"
    work = ctx.layout.templates / f".{name}.oci"
    copy = ctx.layout.templates / f".{name}.source"
    with ctx.lock(f"template:{name}"):
        if meta_path.exists():
            raise errors.AlreadyExists(f"template {name!r} is already on this node")
        discard_subvolume(target)  # no metadata: an import or build killed before its end
        discard_subvolume(work)
        started = time.monotonic()
        try:
            _private_copy(staging.template_dir(ctx, "oci-import", name), copy)
            btrfs.create_subvolume(work)
            os.chmod(work, 0o755)  # noqa: S103 - a root filesystem's root
            root_fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                budget = Budget(max_bytes=params.max_bytes, max_entries=params.max_entries)
                with open(copy, "rb") as archive:
                    image = oci_image.unpack(archive, root_fd, budget)
                guest_size = install_guest(root_fd)
            except OSError as exc:
                raise _disk_error(exc, name) from exc
            finally:
                os.close(root_fd)
            btrfs.set_readonly(work, True)
            os.rename(work, target)
        except BaseException:
            discard_subvolume(work)
            raise
        finally:
            copy.unlink(missing_ok=True)
        meta = {
            "format": METADATA_FORMAT,
            "name": name,
            "created": now(),
            "builtin": False,
            "from": params.source,
            "kind": "oci-image",
            "image_digest": image.digest,
            "layers": image.layers,
            "entries": budget.entries,
            "unpacked_bytes": budget.bytes,
            "skipped": dict(budget.skipped),
            "python": image.python,
            "python_link_added": image.python_link_added,
            "guest_code_hash": templates.guest_code_hash(),
            "guest_lib": templates.GUEST_LIB,
            "guest_command": templates.guest_command(),
            "guest_bytes": guest_size,
            "size_bytes": tree_size(target),
            "subvolume_id": btrfs.subvolume_id(target),
            **{k: v for k, v in oci_image.config_metadata(image.config).items() if v is not None},
        }
        write_json_atomic(meta_path, meta)
    progress(f"space: image {image.digest or name} imported as {name} ({time.monotonic() - started:.1f} s)")
    return {"name": name, "path": str(target), "metadata": meta}
