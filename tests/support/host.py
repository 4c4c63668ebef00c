"""What a test run may leave on the host, read from the kernel, for leak checks."""

from __future__ import annotations

import pathlib
import subprocess


def mounts_under(prefix: str) -> list[str]:
    found = []
    for line in pathlib.Path("/proc/mounts").read_text().splitlines():
        mountpoint = line.split()[1].replace("\\040", " ")
        if mountpoint.startswith(prefix):
            found.append(mountpoint)
    return found


def loop_devices_for(prefix: str) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout
    return [line for line in out.splitlines() if prefix in line]


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def cgroups_under(name: str) -> list[str]:
    base = pathlib.Path("/sys/fs/cgroup")
    found = []
    for controller in base.iterdir() if base.exists() else []:
        group = controller / name
        if group.is_dir():
            found.extend(str(p) for p in group.iterdir() if p.is_dir())
    return found
