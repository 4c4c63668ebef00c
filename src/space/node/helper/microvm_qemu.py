"""One QEMU microVM process: its command line, its jail, its accelerator, and QMP (root helper only).

Invariants:
- The accelerator is detected, never assumed: `kvm` only when /dev/kvm opens read-write AND a hardware
  KVM module (kvm_intel or kvm_amd) is loaded; a /dev/kvm of another kind (e.g. the PVM nested hypervisor
  of some cloud machines, where a stock guest kernel hangs in its real-mode setup) means `tcg`.
- Every QEMU runs jailed (docs/adr/0068-qemu-microvm-driver.md): in a fresh mount namespace (a slave of
  the host's, so a network slot deleted on the host is not kept alive by QEMU's copy of /run/netns) and in
  its sandbox's network namespace, where its virtio-net device's tap is the only way out
  (docs/adr/0080-microvm-egress.md), or in a fresh empty one (a template's boot, a node without sandbox
  networks: the device's tap then leads nowhere), chrooted into its disk's
  root-owned directory (which holds the disk and its metadata only) and running as the sandbox's own
  unprivileged uid once its files are open (`-chroot`, `-runas`), under QEMU's seccomp filter with
  spawning, obsolete calls and resource control denied (`-sandbox on,...`; not `elevateprivileges`, which
  would forbid `-runas` its own uid change), in cgroups that bound its memory and tasks.
- QEMU never opens a path after start-up: checkpoint and restore images are passed as file descriptors
  over QMP (`getfd` + `fd:` migration URIs), which also keeps `spawn=deny` possible (no `exec:` URIs).
- The channel is QEMU's stdio chardev behind a virtio serial port; the holder (space.node.helper.holder)
  owns the pipes, so the guest's port never sees the host side close while the agent reconnects.
- No argument reaches a shell; every path comes from NodeLayout and validated ids.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time
from dataclasses import dataclass
from typing import Any

from space.core import errors
from space.node.helper.microvm_kernel import CHANNEL_PORT_NAME
from space.node.helper.netaddr import MICROVM_TAP, SANDBOX_MAC

QEMU = "qemu-system-x86_64"
QMP_TIMEOUT_S = 30.0
#: The kernel command line: quiet boot, a panic ends QEMU (-no-reboot) instead of hanging.
KERNEL_APPEND = "quiet panic=-1 rdinit=/init"
#: Under TCG the guest's TSC is the host's: telling the kernel its rate skips the PIT calibration, which on
#: a busy host fails, after which the guest's clock never ticks and the boot hangs (seen here).
TCG_TSC_APPEND = "tsc_early_khz={khz} tsc=reliable"
SECCOMP = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
HARDWARE_KVM_MODULES = ("kvm_intel", "kvm_amd")


def detect_accel(dev_kvm: pathlib.Path = pathlib.Path("/dev/kvm"), sys_module: pathlib.Path =
                 pathlib.Path("/sys/module")) -> str:  # fmt: skip
    """`kvm` where /dev/kvm runs hardware guests, else `tcg` (see invariants)."""
    if not any((sys_module / name).is_dir() for name in HARDWARE_KVM_MODULES):
        return "tcg"
    try:
        fd = os.open(dev_kvm, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return "tcg"
    os.close(fd)
    return "kvm"


def host_tsc_khz(cpuinfo: pathlib.Path = pathlib.Path("/proc/cpuinfo")) -> int:
    """The host's TSC rate as the kernel reports it (`cpu MHz` of the first CPU), in kHz."""
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "cpu MHz":
            return max(1, round(float(value) * 1000))
    raise errors.RuntimeFailure("/proc/cpuinfo names no CPU rate")


def kernel_append(accel: str) -> str:
    if accel == "tcg":
        return f"{KERNEL_APPEND} {TCG_TSC_APPEND.format(khz=host_tsc_khz())}"
    return KERNEL_APPEND


@dataclass(frozen=True)
class MachineSpec:
    kernel: pathlib.Path
    initramfs: pathlib.Path
    disk: pathlib.Path
    qmp_socket: pathlib.Path
    jail: pathlib.Path  # the root-owned directory of the disk: QEMU's root once started
    uid: int
    memory_mb: int = 512
    vcpus: int = 1
    accel: str = "tcg"
    incoming: bool = False  # start waiting for a migration stream (restore) instead of booting
    netns: pathlib.Path | None = None  # the sandbox's network namespace (holding its tap); None: an empty one


def qemu_argv(spec: MachineSpec) -> list[str]:
    if spec.accel not in {"kvm", "tcg"}:
        raise errors.InvalidArgument(f"unknown accelerator {spec.accel!r}", field="accel")
    if spec.netns is None:
        jail = ["unshare", "--mount", "--net"]
    else:
        jail = ["nsenter", f"--net={spec.netns}", "unshare", "--mount"]
    argv = [
        *jail, "--propagation", "slave", f"--wd={spec.jail}", "--",
        QEMU,
        "-M", "microvm,rtc=on", "-accel", spec.accel, "-cpu", "max" if spec.accel == "tcg" else "host",
        "-m", str(spec.memory_mb), "-smp", str(spec.vcpus),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-kernel", str(spec.kernel), "-initrd", str(spec.initramfs), "-append", kernel_append(spec.accel),
        "-drive", f"id=root,file={spec.disk},format=raw,if=none,cache=writeback,discard=unmap",
        "-device", "virtio-blk-device,drive=root",
        "-device", "virtio-serial-device",
        "-chardev", "stdio,id=channel,signal=off",
        "-device", f"virtserialport,chardev=channel,name={CHANNEL_PORT_NAME}",
        # The same device in every guest, networked or not, so any checkpoint restores in any slot: QEMU
        # opens the tap (made for its uid by the helper, or here in an empty namespace) before -runas.
        "-netdev", f"tap,id=net0,ifname={MICROVM_TAP},script=no,downscript=no",
        "-device", f"virtio-net-device,netdev=net0,mac={SANDBOX_MAC}",
        "-qmp", f"unix:{spec.qmp_socket},server=on,wait=off",
        "-sandbox", SECCOMP,
        "-chroot", str(spec.jail), "-runas", f"{spec.uid}:{spec.uid}",
    ]  # fmt: skip
    if spec.incoming:
        argv += ["-incoming", "defer"]
    return argv


class Qmp:
    """A synchronous QMP session on one QEMU's control socket."""

    def __init__(self, path: pathlib.Path, timeout: float = QMP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout)
                self.sock.connect(str(path))
                break
            except OSError as exc:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise errors.RuntimeFailure(f"QMP socket {path.name} does not answer: {exc}") from exc
                time.sleep(0.005)
        self.buffer = b""
        self._message()  # the greeting
        self.command("qmp_capabilities")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Qmp:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _message(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            try:
                chunk = self.sock.recv(65536)
            except OSError as exc:  # QEMU ended (e.g. a damaged migration stream) or did not answer
                raise errors.RuntimeFailure(f"QMP: {exc}") from exc
            if not chunk:
                raise errors.RuntimeFailure("QEMU closed its QMP socket")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        value = json.loads(line)
        if not isinstance(value, dict):
            raise errors.RuntimeFailure("QMP sent a message that is not an object")
        return value

    def command(
        self, name: str, arguments: dict[str, Any] | None = None, fds: list[int] | None = None
    ) -> Any:
        request: dict[str, Any] = {"execute": name}
        if arguments:
            request["arguments"] = arguments
        data = json.dumps(request).encode() + b"\n"
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.sendall(data)
        except OSError as exc:
            raise errors.RuntimeFailure(f"QMP {name}: {exc}") from exc
        while True:
            message = self._message()
            if "event" in message:
                continue
            if "error" in message:
                raise errors.RuntimeFailure(f"QMP {name}: {message['error'].get('desc', message['error'])}")
            return message.get("return")

    def status(self) -> str:
        """QEMU's run state: running, paused, inmigrate, postmigrate, finish-migrate, shutdown, ..."""
        return str(self.command("query-status")["status"])

    def wait_migration(self, timeout: float = 600.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.command("query-migrate") or {}
            state = info.get("status")
            if state == "completed":
                return dict(info)
            if state in {"failed", "cancelled"}:
                raise errors.RuntimeFailure(f"migration {state}: {info.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise errors.RuntimeFailure("migration did not complete in time")
            time.sleep(0.002)

    def save(self, image: pathlib.Path) -> dict[str, Any]:
        """Write the stopped VM's state to `image` (created here, 0600) through a passed descriptor."""
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            self.command("getfd", {"fdname": "checkpoint"}, fds=[fd])
        finally:
            os.close(fd)
        self.command("migrate", {"uri": "fd:checkpoint"})
        return self.wait_migration()

    def load(self, image: pathlib.Path) -> None:
        """Take a VM's state from `image` (QEMU started with `-incoming defer`)."""
        fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.command("getfd", {"fdname": "incoming"}, fds=[fd])
        finally:
            os.close(fd)
        self.command("migrate-incoming", {"uri": "fd:incoming"})
        deadline = time.monotonic() + QMP_TIMEOUT_S
        while self.status() == "inmigrate":
            if time.monotonic() > deadline:
                raise errors.RuntimeFailure("restore did not finish in time")
            time.sleep(0.002)
