"""The fake driver: `spaced` as a plain host subprocess, for fast tests of the logic above drivers.

NOT ISOLATION. Processes run on the host as the caller. It exists so that the agent's lifecycle logic and
the channel can be tested in milliseconds without root; it warns loudly whenever it is constructed.

Semantics it imitates: pause/resume with SIGSTOP/SIGCONT of the daemon's process group; a "checkpoint" copies
the sandbox directory and restoring it starts a fresh daemon there (processes are *not* carried over — only
the real drivers do that); stop/destroy kill the process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import shutil
import signal
import sys
import tarfile
from collections.abc import Sequence
from typing import Any

from space.core import errors
from space.core.settings import SandboxLimits
from space.node.agent.channel import GuestChannel
from space.node.drivers.base import (
    CheckpointInfo,
    Driver,
    Progress,
    RuntimeState,
    SandboxSpec,
    StagedFiles,
)

log = logging.getLogger(__name__)


class FakeDriver(Driver):
    name = "fake"
    isolating = False

    def __init__(self, base_dir: pathlib.Path) -> None:
        log.warning("FakeDriver: sandboxes are plain host processes WITHOUT isolation (tests only)")
        self.base_dir = base_dir
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.paused: set[str] = set()
        self.specs: dict[str, SandboxSpec] = {}
        #: (total, free) bytes to report instead of the host filesystem's (tests of the disk reserve).
        self.disk_override: tuple[int, int] | None = None
        #: template -> its start command (the fake driver keeps no template metadata; tests set these).
        self.start_commands: dict[str, str] = {}
        # Its sandboxes are host processes: their start commands' output stays under the driver's directory.
        self.start_log = str(base_dir / "start.log")

    def state_file(self, name: str) -> pathlib.Path | None:
        return self.base_dir / "agent" / name

    def _dir(self, sandbox_id: str) -> pathlib.Path:
        return self.base_dir / "sandboxes" / sandbox_id

    def _snapshot_dir(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        return self.base_dir / "snapshots" / sandbox_id / snapshot_id

    async def prepare(self, progress: Progress | None = None) -> None:
        (self.base_dir / "sandboxes").mkdir(parents=True, exist_ok=True)

    async def ensure_template(self, name: str, progress: Progress | None = None) -> dict[str, Any]:
        return {"name": name, "fake": True}

    async def start_command(self, template: str) -> str | None:
        return self.start_commands.get(template)

    async def create(self, spec: SandboxSpec) -> None:
        root = self._dir(spec.sandbox_id)
        if root.exists():
            raise errors.AlreadyExists(f"sandbox {spec.sandbox_id} already exists")
        (root / "work").mkdir(parents=True)
        self.specs[spec.sandbox_id] = spec

    async def _spawn(self, sandbox_id: str) -> GuestChannel:
        root = self._dir(sandbox_id)
        src = pathlib.Path(__file__).resolve().parents[3]
        spec = self.specs.get(sandbox_id, SandboxSpec(sandbox_id))
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(src),
            "SPACED_WORKDIR": str(root / "work"),
            **spec.env,
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "space.guest", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, cwd=str(root / "work"), env=env, start_new_session=True,
            limit=1 << 22,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        self.processes[sandbox_id] = proc
        channel = GuestChannel(proc.stdout, proc.stdin, name=sandbox_id)
        await channel.handshake(timeout=10.0)
        return channel

    async def start(self, sandbox_id: str) -> GuestChannel:
        if not self._dir(sandbox_id).exists():
            raise errors.NotFound(f"sandbox {sandbox_id} has no files on this node")
        if sandbox_id in self.processes and self.processes[sandbox_id].returncode is None:
            raise errors.AlreadyExists(f"sandbox {sandbox_id} is already running")
        return await self._spawn(sandbox_id)

    async def connect(self, sandbox_id: str) -> GuestChannel:
        raise errors.Unavailable("the fake driver keeps no holder: a channel cannot be re-attached")

    def _signal(self, sandbox_id: str, sig: signal.Signals) -> None:
        proc = self.processes.get(sandbox_id)
        if proc is None or proc.returncode is not None:
            raise errors.InvalidState(f"sandbox {sandbox_id} is not running", state="stopped")
        _signal_tree(proc.pid, sig)

    async def pause(self, sandbox_id: str) -> None:
        self._signal(sandbox_id, signal.SIGSTOP)
        self.paused.add(sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        self._signal(sandbox_id, signal.SIGCONT)
        self.paused.discard(sandbox_id)

    async def checkpoint(
        self, sandbox_id: str, snapshot_id: str, *, keep_running: bool = True, leave_paused: bool = False
    ) -> tuple[CheckpointInfo, GuestChannel | None]:
        if leave_paused:
            if sandbox_id not in self.paused:
                await self.pause(sandbox_id)
            await self.disk_snapshot(sandbox_id, snapshot_id)
            return CheckpointInfo(sandbox_id, snapshot_id, 0, {}), None
        await self.disk_snapshot(sandbox_id, snapshot_id)
        channel = None
        if keep_running:
            await self._kill(sandbox_id)
            channel = await self._spawn(sandbox_id)
        else:
            await self._kill(sandbox_id)
        return CheckpointInfo(sandbox_id, snapshot_id, 0, {}), channel

    async def restore(
        self,
        sandbox_id: str,
        snapshot_id: str,
        *,
        source_sandbox_id: str | None = None,
        limits: SandboxLimits | None = None,
    ) -> GuestChannel:
        source = source_sandbox_id or sandbox_id
        snap = self._snapshot_dir(source, snapshot_id)
        if not snap.exists():
            raise errors.NotFound(f"checkpoint {snapshot_id} of {source} is not on this node")
        await self._kill(sandbox_id)
        shutil.rmtree(self._dir(sandbox_id), ignore_errors=True)
        shutil.copytree(snap, self._dir(sandbox_id), symlinks=True)
        if source in self.specs and sandbox_id not in self.specs:
            self.specs[sandbox_id] = SandboxSpec(
                sandbox_id,
                self.specs[source].template,
                limits or self.specs[source].limits,
                self.specs[source].env,
            )
        return await self._spawn(sandbox_id)

    async def disk_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        dst = self._snapshot_dir(sandbox_id, snapshot_id)
        if dst.exists():
            raise errors.AlreadyExists(f"snapshot {snapshot_id} exists")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self._dir(sandbox_id), dst, symlinks=True)

    async def reset_rootfs(self, sandbox_id: str, snapshot_id: str) -> None:
        snap = self._snapshot_dir(sandbox_id, snapshot_id)
        if not snap.exists():
            raise errors.NotFound(f"snapshot {snapshot_id} of {sandbox_id} is not on this node")
        shutil.rmtree(self._dir(sandbox_id), ignore_errors=True)
        shutil.copytree(snap, self._dir(sandbox_id), symlinks=True)

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        shutil.rmtree(self._snapshot_dir(sandbox_id, snapshot_id), ignore_errors=True)

    async def list_snapshots(self, sandbox_id: str) -> list[dict[str, Any]]:
        root = self.base_dir / "snapshots" / sandbox_id
        return (
            [
                {"snapshot_id": p.name, "kind": "full", "created_at": p.stat().st_mtime, "image_bytes": 0}
                for p in sorted(root.iterdir())
            ]
            if root.exists()
            else []
        )

    async def _kill(self, sandbox_id: str) -> None:
        proc = self.processes.pop(sandbox_id, None)
        self.paused.discard(sandbox_id)
        if proc is None or proc.returncode is not None:
            return
        _signal_tree(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def stop(self, sandbox_id: str) -> None:
        await self._kill(sandbox_id)

    async def destroy(self, sandbox_id: str) -> None:
        await self._kill(sandbox_id)
        shutil.rmtree(self._dir(sandbox_id), ignore_errors=True)
        shutil.rmtree(self.base_dir / "snapshots" / sandbox_id, ignore_errors=True)
        for staged in (self.base_dir / "staging").glob(f"*-{sandbox_id}-*"):
            shutil.rmtree(staged, ignore_errors=True)
        self.specs.pop(sandbox_id, None)

    async def state(self, sandbox_id: str) -> RuntimeState:
        proc = self.processes.get(sandbox_id)
        alive = proc is not None and proc.returncode is None
        runtime = ("paused" if sandbox_id in self.paused else "running") if alive else "absent"
        return RuntimeState(sandbox_id, self._dir(sandbox_id).exists(), runtime, alive)

    async def list(self) -> list[RuntimeState]:
        root = self.base_dir / "sandboxes"
        return [await self.state(p.name) for p in sorted(root.iterdir())] if root.exists() else []

    async def usage(self, sandbox_id: str) -> dict[str, Any]:
        return {"memory_bytes": None, "disk_exclusive_bytes": None}

    async def metrics(self, sandbox_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The daemon's process tree as the host sees it: CPU time (its own and its reaped children's) and
        resident memory, from one scan of /proc; disk as storage_usage counts it."""
        tree = _process_tree()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _ticks, _pages) in tree.items():
            children.setdefault(ppid, []).append(pid)
        readings: dict[str, dict[str, Any]] = {}
        for sandbox_id in sandbox_ids:
            proc = self.processes.get(sandbox_id)
            if proc is None or proc.returncode is not None:
                continue
            cpu_ticks, resident_pages = 0, 0
            for pid in _below(children, proc.pid):
                counters = tree.get(pid)
                if counters is not None:
                    cpu_ticks += counters[1]
                    resident_pages += counters[2]
            usage = await self.storage_usage(sandbox_id)
            readings[sandbox_id] = {
                "source": str(proc.pid), "cpu_ns": cpu_ticks * 1_000_000_000 // _CLOCK_TICKS,
                "memory_bytes": resident_pages * _PAGE_BYTES, "memory_cache_bytes": None,
                "disk_bytes": usage["used_bytes"] if usage else None,
            }  # fmt: skip
        return readings

    async def storage_usage(self, sandbox_id: str, *, fresh: bool = True) -> dict[str, Any] | None:
        """The fake keeps full copies: a sandbox's storage is its directory plus every snapshot copy."""
        snapshots = self.base_dir / "snapshots" / sandbox_id
        used = _tree_bytes(self._dir(sandbox_id)) + _tree_bytes(snapshots)
        count = sum(1 for _ in snapshots.iterdir()) if snapshots.is_dir() else 0
        return {"used_bytes": used, "files_bytes": used, "images_bytes": 0, "snapshots": count}

    async def disk_space(self) -> dict[str, int] | None:
        if self.disk_override is not None:
            return {"total_bytes": self.disk_override[0], "free_bytes": self.disk_override[1]}
        try:
            usage = shutil.disk_usage(self.base_dir)
        except OSError:
            return None
        return {"total_bytes": usage.used + usage.free, "free_bytes": usage.free}

    async def close(self) -> None:
        for sandbox_id in list(self.processes):
            await self._kill(sandbox_id)

    # -- object storage transfers: the snapshot directory as one tar entry ----------------------------------
    def _staging(self, kind: str, sandbox_id: str | None, snapshot_id: str | None) -> pathlib.Path:
        name = kind if sandbox_id is None else f"{kind}-{sandbox_id}-{snapshot_id}"
        return self.base_dir / "staging" / name

    async def export_snapshot(self, sandbox_id: str, snapshot_id: str) -> StagedFiles:
        snap = self._snapshot_dir(sandbox_id, snapshot_id)
        if not snap.is_dir():
            raise errors.NotFound(f"checkpoint {snapshot_id} of {sandbox_id} is not on this node")
        out = self._staging("export", sandbox_id, snapshot_id)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        with tarfile.open(out / "disk.tar", "w") as tar:
            tar.add(snap, arcname=".")
        size = (out / "disk.tar").stat().st_size
        metadata = {"format": 1, "kind": "full-checkpoint", "driver": self.name, "sandbox_id": sandbox_id,
                    "snapshot_id": snapshot_id, "disk_stream_bytes": size, "image_bytes": 0}  # fmt: skip
        return StagedFiles(out, {"disk.tar": size}, metadata)

    async def prepare_import(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        out = self._staging("import", sandbox_id, snapshot_id)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        return out

    async def import_snapshot(self, spec: SandboxSpec, snapshot_id: str) -> None:
        staged = self._staging("import", spec.sandbox_id, snapshot_id) / "disk.tar"
        if not staged.is_file():
            raise errors.NotFound(f"disk.tar of {snapshot_id} was not staged")
        snap = self._snapshot_dir(spec.sandbox_id, snapshot_id)
        shutil.rmtree(snap, ignore_errors=True)
        snap.mkdir(parents=True)
        with tarfile.open(staged) as tar:
            members = tar.getmembers()
            for member in members:
                parts = pathlib.PurePosixPath(member.name).parts
                if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                    raise errors.InvalidArgument(f"disk.tar holds an unsafe entry {member.name!r}")
            tar.extractall(snap, members=members)  # noqa: S202 - every member checked above
        self.specs[spec.sandbox_id] = spec
        (self.base_dir / "sandboxes" / spec.sandbox_id).mkdir(parents=True, exist_ok=True)
        await self.release_staging("import", spec.sandbox_id, snapshot_id)

    async def release_staging(
        self, kind: str, sandbox_id: str | None = None, snapshot_id: str | None = None
    ) -> None:
        shutil.rmtree(self._staging(kind, sandbox_id, snapshot_id), ignore_errors=True)


def _tree_bytes(root: pathlib.Path) -> int:
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_size
    return total


def _signal_tree(root: int, sig: signal.Signals) -> None:
    """Signal the daemon and every process below it: spaced gives each process its own session, so its
    process group alone would miss them (the daemon is their subreaper, so orphans stay below it too)."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    pending, seen = [root], []
    while pending:
        pid = pending.pop()
        seen.append(pid)
        pending.extend(children.get(pid, []))
    for pid in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _process_tree() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, CPU ticks of it and its reaped children, resident pages) of every process."""
    found: dict[int, tuple[int, int, int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15) ... rss(22)
        ticks = sum(int(value) for value in fields[11:15])
        found[int(entry.name)] = (int(fields[1]), ticks, int(fields[21]))
    return found


def _below(children: dict[int, list[int]], root: int) -> list[int]:
    pending, seen = [root], []
    while pending:
        pid = pending.pop()
        seen.append(pid)
        pending.extend(children.get(pid, []))
    return seen
