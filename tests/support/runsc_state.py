"""What runsc and the kernel say about a sandbox's runtime on a real node (tests that need root).

Read from runsc's state files, /proc and the cgroup tree directly, never through the helper under test.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
from typing import Any

CGROUP_V1 = pathlib.Path("/sys/fs/cgroup")


def runsc_state(data_dir: pathlib.Path, container: str) -> dict[str, Any]:
    """runsc's own state file of `container` (what runsc itself records, a freeze not included)."""
    value: dict[str, Any] = json.loads(
        (data_dir / "runsc" / f"{container}_sandbox:{container}.state").read_text()
    )
    return value


def controller_file(container: str, controller: str, name: str) -> pathlib.Path:
    """The one cgroup v1 file `name` of `container` under `controller` (whatever its cgroup parent)."""
    found = list((CGROUP_V1 / controller).glob(f"*/{container}/{name}"))
    assert len(found) == 1, f"{controller}/{name} of {container}: {found}"
    return found[0]


def runtime_processes(data_dir: pathlib.Path, sandbox_id: str) -> tuple[str, dict[str, int]]:
    """The current container of `sandbox_id` and its host processes (sandbox, gofer, holder) by role."""
    run_dir = data_dir / "run" / sandbox_id
    container = (run_dir / "container").read_text().strip()
    state = runsc_state(data_dir, container)
    holder = json.loads((run_dir / "holder.json").read_text())
    pids = {"sandbox": state["sandbox"]["pid"], "gofer": state["goferPid"], "holder": holder["holder_pid"]}
    return container, {role: int(pid) for role, pid in pids.items()}


def alive(pid: int) -> bool:
    """Running (a zombie not yet reaped counts as gone: it runs nothing)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def runsc_knows(data_dir: pathlib.Path, container: str) -> bool:
    listing = subprocess.run(
        ["runsc", "--root", str(data_dir / "runsc"), "list", "-quiet"],
        capture_output=True,
        text=True,
        check=False,
    )
    return container in listing.stdout.split()


def cgroup_left(container: str) -> list[str]:
    found = subprocess.run(
        ["find", "/sys/fs/cgroup", "-maxdepth", "3", "-type", "d", "-name", container],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return found.stdout.split()


def runtime_status(data_dir: pathlib.Path, sandbox_id: str) -> str:
    """runsc's own status, or "paused" when the container's cgroup is frozen (ADR 0082) or a checkpoint
    holds it through the control socket, which runsc is not told of (the helper's mark, ADR 0084)."""
    run_dir = data_dir / "run" / sandbox_id
    container = (run_dir / "container").read_text().strip()
    held = (run_dir / "held").exists() and (run_dir / "held").read_text() == container
    if container_frozen(container) or held:
        return "paused"
    return str(runsc_state(data_dir, container)["status"])


def container_frozen(container: str) -> bool:
    return any(
        path.read_text().strip() in {"FROZEN", "FREEZING"}
        for path in (CGROUP_V1 / "freezer").glob(f"*/{container}/freezer.state")
    )
