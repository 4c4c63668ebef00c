"""OCI runtime bundle configuration for a sandbox (written by the root helper only).

Invariants:
- The guest's init is always the template's daemon command; callers choose env and limits, never argv,
  mounts or capabilities.
- Limits apply to the whole sandbox (application kernel included) through its cgroup, so a fork bomb or a
  memory hog is contained by the host kernel even if it overwhelms the guest.
- The process budget is enforced INSIDE the sandbox first (ADR 0036): every guest process inherits
  RLIMIT_NPROC = `pids` from the init, which gVisor's kernel enforces (fork and clone fail with EAGAIN in the
  guest, the sandbox lives on); the host cgroup's `pids.max` is set above what any guest budget a sandbox
  can carry costs on the host (`host_pids`), so it is only the node's last line.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from space.core.settings import SandboxLimits

CPU_PERIOD_US = 100_000
# Docker's default capability set: enough for the daemon (root in the guest) to switch users and manage
# processes, nothing that matters to the host (the Sentry implements these inside the sandbox).
DEFAULT_CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]  # fmt: skip
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
}


# Host tasks one guest task may cost (measured under the ptrace platform: a fork bomb held at 40 guest
# tasks by RLIMIT_NPROC had 297 host tasks in the sandbox's cgroup, ~7 each) and the application kernel's
# own (Sentry, gofer: ~20 idle, more under load). ADR 0036.
HOST_TASKS_PER_GUEST_TASK = 8
SANDBOX_BASE_TASKS = 256
DEFAULT_PIDS = SandboxLimits().pids  # what a template's warm checkpoint was made with


def host_pids(limits: SandboxLimits) -> int:
    """The host cgroup's task limit: above anything the guest's own limit (RLIMIT_NPROC, enforced by the
    application kernel) lets its tasks cost, so that limit is always reached first. A sandbox restored from
    its template's warm checkpoint carries the warm sandbox's budget (the default `pids`) in its image,
    hence the larger of the two."""
    guest_tasks = max(limits.pids, DEFAULT_PIDS)
    return guest_tasks * HOST_TASKS_PER_GUEST_TASK + SANDBOX_BASE_TASKS


def resources(limits: SandboxLimits) -> dict[str, Any]:
    return {
        "memory": {"limit": limits.memory_mb << 20},
        "cpu": {"quota": int(limits.cpus * CPU_PERIOD_US), "period": CPU_PERIOD_US},
        "pids": {"limit": host_pids(limits)},
    }


def rlimits(limits: SandboxLimits) -> list[dict[str, Any]]:
    """The init's resource limits, inherited by every guest process. RLIMIT_NPROC (tasks per user, threads
    included) is gVisor's in-sandbox process limit: a fork bomb fails inside with EAGAIN."""
    return [
        {"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536},
        {"type": "RLIMIT_NPROC", "hard": limits.pids, "soft": limits.pids},
    ]


def bundle_config(
    *,
    rootfs: pathlib.Path,
    init_argv: Sequence[str],
    init_env: Mapping[str, str],
    limits: SandboxLimits,
) -> dict[str, Any]:
    env = {**BASE_ENV, **init_env}
    return {
        "ociVersion": "1.0.0",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": list(init_argv),
            "env": [f"{key}={value}" for key, value in env.items()],
            "cwd": "/",
            "capabilities": {
                kind: DEFAULT_CAPABILITIES for kind in ("bounding", "effective", "inheritable", "permitted")
            },
            "rlimits": rlimits(limits),
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
        ],
        "linux": {
            "namespaces": [{"type": kind} for kind in ("pid", "network", "ipc", "uts", "mount")],
            # cgroupsPath is set per container incarnation at launch (space.node.helper.runtime).
            "resources": resources(limits),
        },
    }


def write_bundle_config(bundle_dir: pathlib.Path, config: dict[str, Any]) -> pathlib.Path:
    path = bundle_dir / "config.json"
    tmp = bundle_dir / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=1))
    tmp.replace(path)
    return path
