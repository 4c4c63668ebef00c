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
    found: list[str] = []
    for controller in base.iterdir() if base.exists() else []:
        group = controller / name
        if group.is_dir():
            found.extend(str(p) for p in group.iterdir() if p.is_dir())
    return found


def network_traces(tag: str) -> list[str]:
    """A node's network namespaces, links and nftables table (space.node.helper.network names them all
    after the node's tag), as found in the kernel."""
    prefix = f"sp{tag}"
    netns_dir = pathlib.Path("/run/netns")
    found = (
        [f"netns {p.name}" for p in netns_dir.iterdir() if p.name.startswith(prefix)]
        if netns_dir.is_dir()
        else []
    )
    found += [f"link {p.name}" for p in pathlib.Path("/sys/class/net").iterdir() if p.name.startswith(prefix)]
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout
    found += [f"nft {line.strip()}" for line in tables.splitlines() if line.strip().endswith(f"space_{tag}")]
    return found


def runtime_id(data_dir: pathlib.Path, sandbox_id: str) -> str:
    """The runtime id behind `sandbox_id` on the node of `data_dir`: the one its host files are named after
    (a sandbox bound from a warm pool runs under a runtime id of its own, ADR 0047)."""
    from space.node.agent.runtime_names import RuntimeNames

    return RuntimeNames(data_dir / "identity" / "runtime-names.json").to_runtime(sandbox_id)
