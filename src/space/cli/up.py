"""`space up` / `space down`: the whole installation on this machine, in the foreground or detached.

`space up` prints `SPACE_URL=…` and `SPACE_API_KEY=…` lines and writes the CLI config file, so every other
command works right after it with nothing exported. The key goes to the terminal of whoever ran `space up`
only: the detached supervisor, whose output is `space.log`, never prints it (ADR 0022), and every file
`space up` creates is owner-only (umask 077). `space down` stops what `space up` started (sandboxes
stay on disk and are adopted by the next `space up`); `space down --purge` removes everything.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Annotated

import typer
from rich.console import Console

from space.controlplane.local import LocalCluster
from space.core import errors
from space.node import filemodes
from space.sdk.config import write_config_file

DEFAULT_DATA_DIR = pathlib.Path("/var/lib/space")
stderr = Console(stderr=True)


def _state_file(data_dir: pathlib.Path) -> pathlib.Path:
    return data_dir / "up.json"


def _announce(cluster: LocalCluster) -> None:
    config = write_config_file(cluster.url, cluster.api_key)
    typer.echo(f"SPACE_URL={cluster.url}")
    typer.echo(f"SPACE_API_KEY={cluster.api_key}")
    stderr.print(f"[dim]config written to {config}; `space down` stops SPACE[/dim]")


def _supervise(data_dir: pathlib.Path, port: int, *, announce: bool = True) -> int:
    """Run SPACE in this process until SIGTERM/SIGINT. `announce=False` (the detached supervisor, whose
    output is a log file): say where SPACE listens, never the key."""
    cluster = LocalCluster(data_dir, port=port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        with stderr.status("starting SPACE") as status:
            cluster.start(progress=lambda line: status.update(line[:100]))
    except errors.SpaceError as exc:
        stderr.print(f"error: {exc.code}: {exc.message}")
        cluster.stop(purge=False)
        return 1
    _state_file(data_dir).write_text(json.dumps({"pid": os.getpid(), "url": cluster.url, "port": port}))
    if announce:
        _announce(cluster)
    else:
        typer.echo(f"SPACE ready at {cluster.url} (the admin key is in {data_dir / 'admin.key'})")
    sys.stdout.flush()
    try:
        while not stop.wait(1.0):
            for name, proc in list(cluster.processes.items()):
                if name != "helper" and proc.poll() is not None:
                    stderr.print(
                        f"warning: {name} exited ({proc.returncode}); see {data_dir / (name + '.log')}"
                    )
                    cluster.processes.pop(name)
    finally:
        purge = (data_dir / "purge-request").exists()
        cluster.stop(purge=purge)
        if not purge:
            _state_file(data_dir).unlink(missing_ok=True)
    return 0


def up(
    data_dir: Annotated[
        pathlib.Path, typer.Option("--data-dir", help="where SPACE keeps its state")
    ] = DEFAULT_DATA_DIR,
    port: Annotated[int, typer.Option("--port", help="port of the API on 127.0.0.1")] = 8470,
    detach: Annotated[bool, typer.Option("--detach", help="return once SPACE is ready")] = False,
    supervisor: Annotated[
        bool, typer.Option("--supervisor", hidden=True, help="the detached supervisor: output is a log")
    ] = False,
) -> None:
    """Start the control plane, the node agent and the root helper on this machine."""
    filemodes.set_owner_only_umask()
    data_dir = data_dir.resolve()
    state = _state_file(data_dir)
    if state.exists():
        info = json.loads(state.read_text())
        if _alive(int(info.get("pid", 0))):
            stderr.print(f"SPACE is already running from {data_dir} (pid {info['pid']})")
            cluster = LocalCluster(data_dir, port=int(info["port"]))
            cluster.api_key = (data_dir / "admin.key").read_text().strip()
            _announce(cluster)
            return
        state.unlink()
    (data_dir / "purge-request").unlink(missing_ok=True)
    if not detach:
        raise typer.Exit(_supervise(data_dir, port, announce=not supervisor))
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = filemodes.open_private_log(data_dir / "space.log")
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "space.cli.main", "up", "--data-dir", str(data_dir), "--port", str(port),
             "--supervisor"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    finally:
        os.close(log)
    with stderr.status("starting SPACE (log: " + str(data_dir / "space.log") + ")"):
        while not state.exists():
            if child.poll() is not None:
                stderr.print((data_dir / "space.log").read_text(errors="replace")[-3000:])
                raise typer.Exit(1)
            time.sleep(0.2)
    cluster = LocalCluster(data_dir, port=port)
    cluster.api_key = (data_dir / "admin.key").read_text().strip()
    _announce(cluster)


def down(
    data_dir: Annotated[pathlib.Path, typer.Option("--data-dir")] = DEFAULT_DATA_DIR,
    purge: Annotated[bool, typer.Option("--purge", help="also destroy every sandbox and the data")] = False,
) -> None:
    """Stop what `space up` started."""
    filemodes.set_owner_only_umask()
    data_dir = data_dir.resolve()
    state = _state_file(data_dir)
    if not state.exists():
        stderr.print(f"SPACE is not running from {data_dir}")
        raise typer.Exit(0)
    pid = int(json.loads(state.read_text())["pid"])
    if purge:
        (data_dir / "purge-request").write_text("1")
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 300
        with stderr.status("stopping SPACE"):
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
    state.unlink(missing_ok=True)
    stderr.print("SPACE stopped" + (" and purged" if purge else ""))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("down")(down)
