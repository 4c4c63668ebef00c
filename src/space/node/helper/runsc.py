"""Invocation of gVisor's `runsc` (root helper only).

Invariants:
- Every sandbox on a node uses the same global flags, kept in one place: `--overlay2=none` so writes land
  in the sandbox's btrfs subvolume (snapshots see them), `--net-disconnect-ok` so a sandbox that used the
  network can still be checkpointed.
- Sandboxes run detached (`--detach`, ADR 0045): `runsc run|restore` returns once the sandbox is up, so
  no runsc process stays beside each sandbox; the holder (space.node.helper.holder) adopts and reaps the
  sandbox and gofer processes as a child subreaper.
- Control commands never hang the helper: each has a timeout and a failure becomes RuntimeFailure
  carrying runsc's own message.
- Every checkpoint image holds `runtime.json` (IMAGE_DESCRIPTOR), the runtime descriptor of the runsc
  that wrote it (space.core.runtimes), written after runsc finished; it travels with the image (export,
  import, warm starts), and a restore is refused (RuntimeIncompatible) when it does not fit this runsc.
"""

from __future__ import annotations

import functools
import json
import pathlib
import subprocess
from dataclasses import dataclass
from typing import Any

from space.core import errors, runtimes, tracing
from space.node.volumes import template_base

CONTROL_TIMEOUT_S = 60.0
VERSION_TIMEOUT_S = 10.0
#: The runtime descriptor beside the files runsc writes into a checkpoint image directory.
IMAGE_DESCRIPTOR = "runtime.json"
LAYER = tracing.Layer("space.node.helper")


@functools.cache
def runsc_version(binary: str) -> str | None:
    """`runsc --version`'s version ("runsc version 0.0~20240729.0" -> "0.0~20240729.0"); None if it cannot
    tell (asked once per binary: a helper never swaps its runsc while it runs)."""
    try:
        proc = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = (proc.stdout.strip().splitlines() or [""])[0]
    words = first.split()
    return words[2] if proc.returncode == 0 and words[:2] == ["runsc", "version"] and len(words) > 2 else None


@dataclass(frozen=True)
class Runsc:
    root: pathlib.Path
    binary: str = "runsc"
    platform: str = "ptrace"
    network: str = "none"

    def global_flags(self) -> list[str]:
        return [
            self.binary,
            f"--root={self.root}",
            f"--platform={self.platform}",
            f"--network={self.network}",
            "--overlay2=none",
            "--net-disconnect-ok",
        ]

    def descriptor(self) -> runtimes.Descriptor:
        """What this runsc's checkpoints need to be restored (space.core.runtimes)."""
        return runtimes.describe(
            "runsc",
            platform=self.platform,
            network=self.network,
            runtime_version=runsc_version(self.binary),
            template_base=f"{template_base.BASE_NAME.lstrip('.')}@{template_base.BASE_VERSION}",
        )

    def check_image(self, image: pathlib.Path) -> None:
        """RuntimeIncompatible unless this runsc can restore `image` (an image without a descriptor was
        written before descriptors existed: runsc itself is then the judge)."""
        try:
            raw = (image / IMAGE_DESCRIPTOR).read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise errors.RuntimeFailure(f"cannot read the checkpoint's runtime descriptor: {exc}") from exc
        try:
            recorded: object = json.loads(raw[: 64 * 1024])
        except (json.JSONDecodeError, UnicodeDecodeError):
            recorded = "unreadable"  # refused below as malformed, with the reason
        runtimes.check_restore(self.descriptor(), recorded, what=f"checkpoint {image.name}")

    def run_argv(self, bundle: pathlib.Path, sandbox_id: str) -> list[str]:
        return [*self.global_flags(), "run", "--detach", f"--bundle={bundle}", sandbox_id]

    def restore_argv(self, bundle: pathlib.Path, image: pathlib.Path, sandbox_id: str) -> list[str]:
        flags = ["--detach", f"--bundle={bundle}", f"--image-path={image}"]
        return [*self.global_flags(), "restore", *flags, sandbox_id]

    def control(self, *args: str, timeout: float = CONTROL_TIMEOUT_S) -> str:
        argv = [*self.global_flags(), *args]
        try:
            with LAYER.span(f"runsc.{args[0]}", command=args[0]):  # the subcommand: a fixed word (ADR 0072)
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise errors.RuntimeFailure(f"runsc {args[0]} timed out after {timeout}s") from exc
        if proc.returncode != 0:
            message = (proc.stderr or proc.stdout).strip().splitlines()
            detail = message[-1] if message else f"exit code {proc.returncode}"
            raise errors.RuntimeFailure(f"runsc {args[0]} failed: {detail}", command=args[0])
        return proc.stdout

    def state(self, sandbox_id: str) -> dict[str, Any] | None:
        """runsc's view of a container, or None if it does not know it."""
        try:
            out = self.control("state", sandbox_id, timeout=10.0)
        except errors.RuntimeFailure:
            return None
        try:
            value = json.loads(out)
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None

    def pause(self, sandbox_id: str) -> None:
        self.control("pause", sandbox_id)

    def resume(self, sandbox_id: str) -> None:
        self.control("resume", sandbox_id)

    def checkpoint(self, sandbox_id: str, image: pathlib.Path, *, leave_running: bool = False) -> None:
        # Uncompressed: ~3x faster to write and to restore here (measured: 70-150 ms vs 195-270 ms for an idle
        # Python daemon); images that leave the node are compressed and encrypted by the uploader instead.
        flags = ["--compression=none", f"--image-path={image}"]
        if leave_running:
            flags.append("--leave-running")
        self.control("checkpoint", *flags, sandbox_id, timeout=300.0)
        (image / IMAGE_DESCRIPTOR).write_text(json.dumps(self.descriptor(), sort_keys=True))

    def kill(self, sandbox_id: str) -> None:
        self.control("kill", "--all", sandbox_id, "KILL", timeout=10.0)

    def delete(self, sandbox_id: str) -> None:
        self.control("delete", "--force", sandbox_id, timeout=30.0)
