"""Where a node keeps things, derived only from its data directory and validated ids.

Invariants:
- Every path a node uses is computed here from the data directory and ids that already passed
  `space.core.ids` validation; nothing is ever built from a caller's raw string.
- `confine()` is the single check that an externally supplied path stays inside the data directory
  (after resolving symlinks), for the rare verbs that take one.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

from space.core import errors


@dataclass(frozen=True)
class NodeLayout:
    data_dir: pathlib.Path

    @property
    def image(self) -> pathlib.Path:
        return self.data_dir / "btrfs.img"

    @property
    def fs(self) -> pathlib.Path:
        """Root of the node's btrfs filesystem (a loop mount here unless data_dir is on btrfs)."""
        return self.data_dir / "fs"

    @property
    def templates(self) -> pathlib.Path:
        return self.fs / "templates"

    @property
    def sandboxes(self) -> pathlib.Path:
        return self.fs / "sandboxes"

    @property
    def snapshots_root(self) -> pathlib.Path:
        return self.fs / "snapshots"

    @property
    def checkpoints_root(self) -> pathlib.Path:
        return self.fs / "checkpoints"

    @property
    def run(self) -> pathlib.Path:
        return self.data_dir / "run"

    @property
    def runsc_root(self) -> pathlib.Path:
        return self.data_dir / "runsc"

    @property
    def helper_socket(self) -> pathlib.Path:
        return self.data_dir / "helper.sock"

    def template(self, name: str) -> pathlib.Path:
        return self.templates / name

    def warm(self, template: str) -> pathlib.Path:
        """A template's warm start: a checkpoint of a booted sandbox of it (image, disk, config)."""
        return self.templates / ".warm" / template

    def bundle(self, sandbox_id: str) -> pathlib.Path:
        return self.sandboxes / sandbox_id

    def rootfs(self, sandbox_id: str) -> pathlib.Path:
        return self.bundle(sandbox_id) / "rootfs"

    def run_dir(self, sandbox_id: str) -> pathlib.Path:
        return self.run / sandbox_id

    def channel_socket(self, sandbox_id: str) -> pathlib.Path:
        return self.run_dir(sandbox_id) / "channel.sock"

    def snapshot(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        return self.snapshots_root / sandbox_id / snapshot_id

    def checkpoint_image(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        return self.checkpoints_root / sandbox_id / snapshot_id

    @property
    def staging(self) -> pathlib.Path:
        """Transfers between the helper and the agent (exports to upload, downloads to import). On the
        btrfs filesystem, so checkpoint images are reflinked out and renamed in, never copied."""
        return self.fs / "staging"

    def export_dir(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        return self.staging / f"export-{sandbox_id}-{snapshot_id}"

    def import_dir(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        return self.staging / f"import-{sandbox_id}-{snapshot_id}"

    def base_export_dir(self) -> pathlib.Path:
        return self.staging / "base-export"

    def base_import_dir(self) -> pathlib.Path:
        return self.staging / "base-import"

    def confine(self, candidate: str | os.PathLike[str]) -> pathlib.Path:
        """Resolve `candidate` and refuse it unless it lies inside the data directory."""
        root = self.data_dir.resolve()
        resolved = pathlib.Path(candidate)
        if not resolved.is_absolute():
            raise errors.InvalidArgument(f"path must be absolute: {str(candidate)!r}", field="path")
        resolved = resolved.resolve()
        if resolved != root and root not in resolved.parents:
            raise errors.InvalidArgument(
                f"path {str(candidate)!r} is outside the node's data directory", field="path"
            )
        return resolved
