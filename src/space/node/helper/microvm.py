"""The microVM sandboxes of one node: template checkpoints, per-sandbox disks and QEMU incarnations.

Layout (under the node's btrfs filesystem, so every disk copy is a reflink; docs/adr/0068):
    fs/microvm/templates/<name>/   disk.img (the booted template's disk at its checkpoint), memory (its RAM
                                   and device state), initrd (node initramfs + the template's environment),
                                   meta.json (accelerator, memory, vCPUs: what a restore must match)
    fs/microvm/sandboxes/<id>/     disk.img (a reflink of its template's, owned by the sandbox's uid),
                                   meta.json; also QEMU's root once it runs (chroot)
    fs/microvm/checkpoints/<id>/<snapshot>/  memory, disk.img, meta.json
    run/<id>/                      channel.sock (the holder's), qmp.sock, holder.json, runtime.log, exit.json

Invariants:
- A sandbox is created by restoring its template's checkpoint over a reflinked copy of the disk that
  checkpoint was taken with; only making a template's checkpoint cold-boots a guest.
- A memory image is only ever loaded together with the disk saved at the same stopped moment (QMP `stop`,
  then migrate, then the reflink), so the guest's page cache and its disk agree.
- Each QEMU runs under the sandbox's own uid (SANDBOX_UID_BASE + a hash of its id, never a real user's),
  jailed as space.node.helper.microvm_qemu describes, in memory and pids cgroups of its own.
- Every operation converges when repeated: destroying a missing sandbox, stopping a stopped one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

from space.core import errors
from space.core.ids import SANDBOX_ID_PATTERN
from space.node.helper.microvm_kernel import INITRAMFS_VERSION, ensure_guest_kernel, template_initramfs
from space.node.helper.microvm_qemu import MachineSpec, Qmp, detect_accel, qemu_argv
from space.node.helper.network import SandboxNetworks
from space.node.helper.runtime import Runtimes, log_tail
from space.node.layout import NodeLayout
from space.node.volumes.template_files import run

SANDBOX_UID_BASE = 0x6000_0000
SANDBOX_ID = re.compile(SANDBOX_ID_PATTERN)
SOCKET_WAIT_S = 10.0
EXIT_WAIT_S = 10.0
#: Host memory a QEMU may use beyond its guest's RAM (its own code, TCG's translation cache, buffers).
MEMORY_OVERHEAD_MB = 384
PIDS_MAX = 256  # QEMU threads: vCPUs, RCU, its I/O thread pool (up to 64 workers)
CGROUP_V1 = pathlib.Path("/sys/fs/cgroup")
CGROUP_NAME = "space-microvm"


@dataclass(frozen=True)
class Machine:
    memory_mb: int = 512
    vcpus: int = 1


def sandbox_uid(sandbox_id: str) -> int:
    return SANDBOX_UID_BASE + (zlib.crc32(sandbox_id.encode()) & 0x00FF_FFFF)


def reflink(source: pathlib.Path, target: pathlib.Path) -> None:
    tmp = target.with_name(target.name + ".tmp")
    run(["cp", "--reflink=always", str(source), str(tmp)], "reflink copy of a disk")
    os.replace(tmp, target)


class MicroVMs:
    def __init__(
        self,
        layout: NodeLayout,
        owner_uid: int,
        accel: str | None = None,
        network: SandboxNetworks | None = None,
    ) -> None:
        self.layout = layout
        self.owner_uid = owner_uid
        self.network = network  # None: the node gives sandboxes no network (their tap leads nowhere)
        self.accel = accel or detect_accel()
        self.root = layout.fs / "microvm"

    # -- paths ---------------------------------------------------------------------------------------------
    def template_dir(self, name: str) -> pathlib.Path:
        return self.root / "templates" / name

    def sandbox_dir(self, sandbox_id: str) -> pathlib.Path:
        return self.root / "sandboxes" / sandbox_id

    def checkpoint_dir(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        return self.root / "checkpoints" / sandbox_id / snapshot_id

    def template_stamp(self, name: str, machine: Machine | None = None) -> str:
        """Changes whenever the node's template is rebuilt (its metadata file is rewritten last on every
        build: new guest code, new files), or the guest kernel recipe, the accelerator or the machine change;
        "" when the node has no such template."""
        try:
            template_meta = (self.layout.templates / f"{name}.json").read_bytes()
        except OSError:
            return ""
        parts = [template_meta, self.accel.encode(), INITRAMFS_VERSION.encode()]
        if machine is not None:
            parts.append(f"{machine.memory_mb}/{machine.vcpus}".encode())
        return hashlib.sha256(b"\0".join(parts)).hexdigest()

    def template_ready(self, name: str, machine: Machine | None = None) -> bool:
        """Its checkpoint exists and was made from the template as it is now (a stale one is made again)."""
        try:
            meta = json.loads((self.template_dir(name) / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        if machine is not None and (meta.get("memory_mb"), meta.get("vcpus")) != (
            machine.memory_mb,
            machine.vcpus,
        ):
            return False
        stamp = self.template_stamp(name)
        return bool(stamp) and meta.get("template_stamp") == stamp

    # -- templates -----------------------------------------------------------------------------------------
    def build_template_disk(self, name: str, rootfs: pathlib.Path, env: dict[str, str]) -> pathlib.Path:
        """The template's ext4 disk image (from its root filesystem) and initrd, in a fresh build directory;
        the template is ready only once `adopt_template` has checkpointed a booted guest of it."""
        kernel = ensure_guest_kernel()
        build = self.root / "templates" / f".build-{name}"
        shutil.rmtree(build, ignore_errors=True)
        build.mkdir(parents=True)
        used = int(run(["du", "-sb", str(rootfs)], "du of a template").stdout.split()[0])
        disk = build / "disk.img"
        size_mb = max(1024, (used * 2) // (1 << 20) + 512)  # sparse: room to write, paid for when written
        run(["mkfs.ext4", "-q", "-F", "-L", "space-root", "-E", "root_owner=0:0", "-d", str(rootfs),
             str(disk), f"{size_mb}M"], "mkfs.ext4 of a template disk")  # fmt: skip
        template_initramfs(kernel, env, build / "initrd")
        return build

    def boot_template(self, name: str, machine: Machine) -> str:
        """Cold-boot the template's freshly built disk as the sandbox `tpl-<name>`'s runtime; returns its
        channel socket (the caller waits for HELLO, then calls adopt_template)."""
        build = self.root / "templates" / f".build-{name}"
        if not (build / "disk.img").is_file():
            raise errors.NotFound(f"microVM template {name!r} has no disk built", template=name)
        kernel = ensure_guest_kernel()
        return self._launch(f"tpl-{name}", build, build / "initrd", kernel.vmlinuz, machine, None)

    def adopt_template(self, name: str, machine: Machine) -> dict[str, Any]:
        """Checkpoint the booted template guest (stopped: memory, then its disk) and make it the template."""
        runtime_id = f"tpl-{name}"
        build = self.root / "templates" / f".build-{name}"
        started = time.monotonic()
        with Qmp(self._qmp(runtime_id)) as qmp:
            qmp.command("stop")
            info = qmp.save(build / "memory")
        self._kill(runtime_id)
        os.chown(build / "disk.img", 0, 0)  # a template's disk belongs to no sandbox
        meta = {"accel": self.accel, "memory_mb": machine.memory_mb, "vcpus": machine.vcpus,
                "kernel": ensure_guest_kernel().release, "created_at": time.time(),
                "template_stamp": self.template_stamp(name)}  # fmt: skip
        (build / "meta.json").write_text(json.dumps(meta))
        target = self.template_dir(name)
        shutil.rmtree(target, ignore_errors=True)
        build.rename(target)
        shutil.rmtree(self.layout.run_dir(runtime_id), ignore_errors=True)
        return {"image_bytes": (target / "memory").stat().st_size, "seconds": time.monotonic() - started,
                "migration_ms": info.get("total-time")}  # fmt: skip

    # -- sandboxes -----------------------------------------------------------------------------------------
    def create(self, sandbox_id: str, template: str) -> str:
        """A new sandbox from its template's checkpoint, running; returns its channel socket."""
        source = self.template_dir(template)
        if not self.template_ready(template):
            raise errors.NotFound(f"microVM template {template!r} is not on this node", template=template)
        box = self.sandbox_dir(sandbox_id)
        if (box / "meta.json").is_file():
            raise errors.AlreadyExists(f"sandbox {sandbox_id} already has a microVM disk")
        box.mkdir(parents=True, exist_ok=True)
        reflink(source / "disk.img", box / "disk.img")
        meta = json.loads((source / "meta.json").read_text())
        (box / "meta.json").write_text(json.dumps({**meta, "template": template}))
        return self._restore_from(sandbox_id, source / "memory")

    def machine_of(self, sandbox_id: str) -> tuple[Machine, dict[str, Any]]:
        try:
            meta = json.loads((self.sandbox_dir(sandbox_id) / "meta.json").read_text())
        except FileNotFoundError as exc:
            raise errors.NotFound(f"sandbox {sandbox_id} has no microVM here") from exc
        return Machine(int(meta["memory_mb"]), int(meta["vcpus"])), meta

    def _restore_from(self, sandbox_id: str, memory: pathlib.Path, *, paused: bool = False) -> str:
        machine, meta = self.machine_of(sandbox_id)
        if meta.get("accel") != self.accel:
            raise errors.RuntimeIncompatible(
                f"checkpoint was taken under {meta.get('accel')}, this node runs {self.accel}"
            )
        box = self.sandbox_dir(sandbox_id)
        initrd = self.template_dir(str(meta["template"])) / "initrd"
        kernel = ensure_guest_kernel()
        socket_path = self._launch(sandbox_id, box, initrd, kernel.vmlinuz, machine, memory)
        try:
            with Qmp(self._qmp(sandbox_id)) as qmp:
                qmp.load(memory)
                if not paused:
                    qmp.command("cont")
        except BaseException:
            self._kill(sandbox_id)  # no half-restored QEMU stays behind
            raise
        return socket_path

    def boot(self, sandbox_id: str) -> str:
        """Cold-boot a stopped sandbox from its own disk (its processes were gone; its files are kept)."""
        machine, meta = self.machine_of(sandbox_id)
        if self._alive(sandbox_id):
            return str(self.layout.channel_socket(sandbox_id))
        initrd = self.template_dir(str(meta["template"])) / "initrd"
        kernel = ensure_guest_kernel()
        return self._launch(sandbox_id, self.sandbox_dir(sandbox_id), initrd, kernel.vmlinuz, machine, None)

    def sandbox_ids(self) -> list[str]:
        """The sandboxes that have a microVM disk on this node."""
        root = self.root / "sandboxes"
        if not root.is_dir():
            return []
        return sorted(
            p.name for p in root.iterdir() if SANDBOX_ID.fullmatch(p.name) and (p / "meta.json").is_file()
        )

    def pause(self, sandbox_id: str) -> None:
        with Qmp(self._qmp(sandbox_id)) as qmp:
            qmp.command("stop")

    def resume(self, sandbox_id: str) -> None:
        with Qmp(self._qmp(sandbox_id)) as qmp:
            qmp.command("cont")

    def status(self, sandbox_id: str) -> str:
        """running | paused | absent (no QEMU)."""
        if not self._alive(sandbox_id):
            return "absent"
        try:
            with Qmp(self._qmp(sandbox_id), timeout=2.0) as qmp:
                state = qmp.status()
        except errors.RuntimeFailure:
            return "absent"
        return "running" if state == "running" else "paused"

    def checkpoint(self, sandbox_id: str, snapshot_id: str, *, keep_running: bool = True) -> dict[str, Any]:
        """Memory and disk of one stopped moment; the guest continues unless `keep_running` is False."""
        target = self.checkpoint_dir(sandbox_id, snapshot_id)
        target.mkdir(parents=True, exist_ok=True)
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        with Qmp(self._qmp(sandbox_id)) as qmp:
            qmp.command("stop")
            qmp.save(target / "memory")
            timings["memory_s"] = time.monotonic() - t0
            reflink(self.sandbox_dir(sandbox_id) / "disk.img", target / "disk.img")
            timings["disk_s"] = time.monotonic() - t0 - timings["memory_s"]
            if keep_running:
                qmp.command("cont")
        shutil.copyfile(self.sandbox_dir(sandbox_id) / "meta.json", target / "meta.json")
        timings["total_s"] = time.monotonic() - t0
        return {"image_bytes": (target / "memory").stat().st_size, "timings": timings}

    def restore(self, sandbox_id: str, snapshot_id: str, source_sandbox_id: str | None = None) -> str:
        """Run `sandbox_id` from a checkpoint (its own: rollback; another's: fork, on a reflinked disk)."""
        source = self.checkpoint_dir(source_sandbox_id or sandbox_id, snapshot_id)
        if not (source / "meta.json").is_file():
            raise errors.NotFound(f"checkpoint {snapshot_id} is not on this node", snapshot_id=snapshot_id)
        self.stop(sandbox_id)
        box = self.sandbox_dir(sandbox_id)
        box.mkdir(parents=True, exist_ok=True)
        reflink(source / "disk.img", box / "disk.img")
        shutil.copyfile(source / "meta.json", box / "meta.json")
        return self._restore_from(sandbox_id, source / "memory")

    def snapshots(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The sandbox's checkpoints on this node (all full: memory and disk)."""
        root = self.root / "checkpoints" / sandbox_id
        found = []
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            if (entry / "meta.json").is_file() and (entry / "memory").is_file():
                found.append({"snapshot_id": entry.name, "kind": "full",
                              "created_at": (entry / "meta.json").stat().st_mtime,
                              "image_bytes": (entry / "memory").stat().st_size})  # fmt: skip
        return found

    def delete_checkpoint(self, sandbox_id: str, snapshot_id: str) -> bool:
        target = self.checkpoint_dir(sandbox_id, snapshot_id)
        existed = target.exists()
        shutil.rmtree(target, ignore_errors=True)
        return existed

    def stop(self, sandbox_id: str) -> None:
        self._kill(sandbox_id)

    def destroy(self, sandbox_id: str) -> None:
        self._kill(sandbox_id)
        if self.network is not None:
            self.network.release(sandbox_id)  # after QEMU ended: its tap no longer holds the namespace
        shutil.rmtree(self.sandbox_dir(sandbox_id), ignore_errors=True)
        shutil.rmtree(self.root / "checkpoints" / sandbox_id, ignore_errors=True)
        shutil.rmtree(self.layout.run_dir(sandbox_id), ignore_errors=True)

    def destroy_all(self) -> list[str]:
        """Every microVM of the node ended and its files removed, template boots included (node teardown)."""
        root = self.root / "sandboxes"
        destroyed = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        for sandbox_id in destroyed:
            self.destroy(sandbox_id)
        if self.layout.run.is_dir():
            for run_dir in self.layout.run.glob("tpl-*"):
                self._kill(run_dir.name)
                shutil.rmtree(run_dir, ignore_errors=True)
        return destroyed

    # -- QEMU processes ------------------------------------------------------------------------------------
    def _qmp(self, sandbox_id: str) -> pathlib.Path:
        return self.layout.run_dir(sandbox_id) / "qmp.sock"

    def _holder_info(self, sandbox_id: str) -> dict[str, Any] | None:
        try:
            value = json.loads((self.layout.run_dir(sandbox_id) / "holder.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return value if isinstance(value, dict) else None

    def _alive(self, sandbox_id: str) -> bool:
        info = self._holder_info(sandbox_id)
        if info is None or (self.layout.run_dir(sandbox_id) / "exit.json").exists():
            return False
        try:
            cmdline = pathlib.Path(f"/proc/{int(info['runtime_pid'])}/cmdline").read_bytes()
        except (OSError, KeyError, ValueError):
            return False
        return str(self.layout.run_dir(sandbox_id)).encode() in cmdline

    def _launch(  # noqa: PLR0917 - one private call site per kind of start
        self,
        sandbox_id: str,
        jail: pathlib.Path,
        initrd: pathlib.Path,
        kernel: pathlib.Path,
        machine: Machine,
        incoming: pathlib.Path | None,
    ) -> str:
        run_dir = self.layout.run_dir(sandbox_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        run_dir.chmod(0o755)
        for stale in ("exit.json", "holder.json", "channel.sock", "qmp.sock"):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / stale).unlink()
        # QEMU's root is the directory of its disk, named relatively: the same name opens it before the
        # chroot and again after it (a migration's end re-opens the image by name), so QEMU starts there
        # (`unshare --wd`; the holder stays outside, so it never pins the node's filesystem). Its uid may
        # write the disk and nothing else there.
        jail.chmod(0o755)
        os.chown(jail / "disk.img", sandbox_uid(sandbox_id), sandbox_uid(sandbox_id))
        spec = MachineSpec(
            kernel=kernel, initramfs=initrd, disk=pathlib.Path("disk.img"), qmp_socket=run_dir / "qmp.sock",
            jail=jail, uid=sandbox_uid(sandbox_id), memory_mb=machine.memory_mb, vcpus=machine.vcpus,
            accel=self.accel, incoming=incoming is not None, netns=self._netns(sandbox_id),
        )  # fmt: skip
        socket_path = self.layout.channel_socket(sandbox_id)
        log_path = run_dir / "runtime.log"
        argv = [*Runtimes.holder_argv()[:-1], str(socket_path), str(self.owner_uid), str(log_path), "--"]
        holder = subprocess.Popen(
            [*argv, *qemu_argv(spec)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )  # fmt: skip
        threading.Thread(target=holder.wait, name="reap-microvm-holder", daemon=True).start()
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not (socket_path.exists() and (run_dir / "holder.json").exists()):
            if holder.poll() is not None or time.monotonic() > deadline:
                raise errors.RuntimeFailure(f"QEMU of {sandbox_id} did not start: {log_tail(log_path)}")
            time.sleep(0.001)
        info = self._holder_info(sandbox_id) or {}
        self._confine(sandbox_id, int(info.get("runtime_pid", 0)), machine)
        return str(socket_path)

    def _netns(self, sandbox_id: str) -> pathlib.Path | None:
        """The sandbox's network slot with a fresh tap for its uid (a restore, fork or restart gets one
        too); None for a template's boot (no sandbox, no slot) or a node without sandbox networks."""
        if self.network is None or not SANDBOX_ID.fullmatch(sandbox_id):
            return None
        return self.network.attach_microvm(sandbox_id, sandbox_uid(sandbox_id))

    def _confine(self, sandbox_id: str, pid: int, machine: Machine) -> None:
        """Memory and task limits of the QEMU process (cgroup v1 hierarchies where the host has them)."""
        limits = {
            "memory": {"memory.limit_in_bytes": (machine.memory_mb + MEMORY_OVERHEAD_MB) << 20},
            "pids": {"pids.max": PIDS_MAX},
        }
        for controller, values in limits.items():
            base = CGROUP_V1 / controller
            if not base.is_dir() or pid <= 0:
                continue
            group = base / CGROUP_NAME / sandbox_id
            group.mkdir(parents=True, exist_ok=True)
            for key, value in values.items():
                (group / key).write_text(str(value))
            (group / "cgroup.procs").write_text(str(pid))

    def _release_cgroups(self, sandbox_id: str) -> None:
        for controller in ("memory", "pids"):
            with contextlib.suppress(OSError):
                (CGROUP_V1 / controller / CGROUP_NAME / sandbox_id).rmdir()

    def _kill(self, sandbox_id: str) -> None:
        info = self._holder_info(sandbox_id)
        if info is not None and self._alive(sandbox_id):
            with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                os.kill(int(info["runtime_pid"]), signal.SIGKILL)
            deadline = time.monotonic() + EXIT_WAIT_S
            while not (self.layout.run_dir(sandbox_id) / "exit.json").exists() or _running(
                info, "holder_pid"
            ):
                if time.monotonic() > deadline:
                    raise errors.RuntimeFailure(f"QEMU of {sandbox_id} did not end")
                time.sleep(0.005)
        self._release_cgroups(sandbox_id)


def _running(info: dict[str, Any], key: str) -> bool:
    """Whether the process holder.json names under `key` still exists (not yet reaped counts as gone)."""
    try:
        stat = pathlib.Path(f"/proc/{int(info[key])}/stat").read_text()
    except (OSError, KeyError, ValueError):
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
