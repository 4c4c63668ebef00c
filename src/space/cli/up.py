"""`space up` / `space down`: the whole installation on this machine, in the foreground or detached.

`space up` prints `SPACE_URL=…`, `SPACE_CONSOLE_URL=…` (the web console, ADR 0061) and `SPACE_API_KEY=…` lines
(and `E2B_API_URL=…`, `E2B_SANDBOX_URL=…` for the E2B front it serves by default, docs/e2b.md) and writes the
CLI config file, so every other command works right after it with nothing exported. The key goes to the
terminal of whoever ran `space up` only: the detached supervisor, whose output is `space.log`, never prints it
(ADR 0022), and every file `space up` creates is owner-only (umask 077). `space down` stops what `space up`
started (sandboxes stay on disk and are adopted by the next `space up`); `space down --purge` removes
everything, also when SPACE is not running (a helper is started just for that).

The process that runs `space up` (in the foreground, or the detached `--supervisor`) supervises what it
started (ADR 0037, space.controlplane.supervisor): a component that dies is started again with back-off,
each death and restart is a JSON line in DATA_DIR/space.log, and DATA_DIR/status.json (for `space status`)
follows every change. SIGTERM (`space down`) ends supervision before anything is stopped, so no restart
fights the shutdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from space.cli.installation import DEFAULT_DATA_DIR, alive, state_file, stop_leftovers, supervisor_pid
from space.cli.nodes import node_app
from space.controlplane.supervisor import Emit
from space.core import errors
from space.node import filemodes
from space.sdk.config import write_config_file

if TYPE_CHECKING:  # the installation's machinery is imported by the commands that run it, so that every
    # other `space` command starts without loading the control plane, the node agent and SQLAlchemy.
    from space.controlplane.local import LocalCluster

#: Warm pools of a one-machine installation (ADR 0047): two python sandboxes and one `base` (E2B's default
#: template, ADR 0057) ready, about 105 MB of memory.
DEFAULT_POOLS = "python=2,base=1"
#: Built-in templates `space up` prepares with their warm starts (a template without one boots cold: ~1.5 s).
TEMPLATES = ("python", "base")
#: Where the E2B front listens by default: the two ports after SPACE's (8471 and 8472 beside 8470), so
#: that two installations on two ports do not collide (docs/e2b.md).
E2B_API_PORT_OFFSET = 1
E2B_SANDBOX_PORT_OFFSET = 2
#: How often the supervisor looks at its components (a death is noticed within this).
TICK_S = 0.5
stderr = Console(stderr=True)


def _local_cluster(data_dir: pathlib.Path, **options: Any) -> LocalCluster:
    from space.controlplane.local import LocalCluster

    return LocalCluster(data_dir, **options)


def _announce(cluster: LocalCluster) -> None:
    config = write_config_file(cluster.url, cluster.api_key)
    typer.echo(f"SPACE_URL={cluster.url}")
    typer.echo(f"SPACE_CONSOLE_URL={cluster.url}/console/")  # sign in there with the key below (ADR 0061)
    typer.echo(f"SPACE_API_KEY={cluster.api_key}")
    if cluster.e2b_api_url and cluster.e2b_sandbox_url:  # E2B's SDK: E2B_API_KEY is the same key
        typer.echo(f"E2B_API_URL={cluster.e2b_api_url}")
        typer.echo(f"E2B_SANDBOX_URL={cluster.e2b_sandbox_url}")
    stderr.print(f"[dim]config written to {config}; `space down` stops SPACE[/dim]")


def _event_log(data_dir: pathlib.Path, *, echo: bool) -> Emit:
    """Supervision events as JSON lines appended to DATA_DIR/space.log (the detached supervisor's own
    output goes there too); `echo`: also a short line on the terminal of a foreground `space up`."""
    path = data_dir / "space.log"

    def emit(event: dict[str, Any]) -> None:
        stamp = datetime.now(UTC).isoformat(timespec="milliseconds")
        line = json.dumps({"ts": stamp, "source": "supervisor", **event}) + "\n"
        with contextlib.suppress(OSError):  # purged: the directory is gone, and so is the log
            fd = filemodes.open_private_log(path)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        if echo:
            details = " ".join(f"{k}={v}" for k, v in event.items() if k != "event")
            stderr.print(f"[dim]{event['event']} {details}[/dim]")

    return emit


def _supervise(
    data_dir: pathlib.Path, port: int, pools: str, e2b_ports: tuple[int, int], *, announce: bool = True
) -> int:
    """Run SPACE in this process until SIGTERM/SIGINT, restarting what dies. `announce=False` (the
    detached supervisor, whose output is a log file): say where SPACE listens, never the key."""
    cluster = _local_cluster(
        data_dir,
        port=port,
        pools=pools,
        templates=TEMPLATES,
        e2b_api_port=e2b_ports[0],
        e2b_sandbox_port=e2b_ports[1],
    )
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
    emit = _event_log(data_dir, echo=announce)
    supervisor = cluster.supervisor(emit)
    emit({"event": "supervisor.started", "pid": os.getpid(), "url": cluster.url})
    state_file(data_dir).write_text(
        json.dumps({"pid": os.getpid(), "url": cluster.url, "port": port, "e2b_ports": list(e2b_ports)})
    )
    if announce:
        _announce(cluster)
    else:
        typer.echo(f"SPACE ready at {cluster.url} (the admin key is in {data_dir / 'admin.key'})")
        typer.echo(f"SPACE console at {cluster.url}/console/")
    sys.stdout.flush()
    try:
        while not stop.wait(TICK_S):
            supervisor.tick()
    finally:
        supervisor.stop()  # first: nothing is restarted while (or after) it is stopped
        purge = (data_dir / "purge-request").exists()
        cluster.stop(purge=purge)
        supervisor.stopped()  # a purged directory is gone: nothing is written then
        if not purge:
            state_file(data_dir).unlink(missing_ok=True)
        emit({"event": "supervisor.stopped", "pid": os.getpid(), "purged": purge})
    return 0


def _apply_config(path: pathlib.Path | None) -> None:
    """The file's [controlplane] and [node] tunables, checked, as this process's variables where unset:
    the processes `space up` starts read them (LocalCluster passes the settings variables on). The roles'
    own options of those sections (listen, database, ...) are `space controlplane run`'s and
    `space node join`'s; `space up` has its flags."""
    if path is None:
        return
    from space.cli.config_file import export_to_environment, read_config, settings
    from space.controlplane.settings import ControlPlaneSettings
    from space.node.agent.settings import NodeAgentSettings

    loaded = read_config(path)
    for section, model in (("controlplane", ControlPlaneSettings), ("node", NodeAgentSettings)):
        settings(model, loaded, section)
        export_to_environment(loaded, section, model)


def up(
    data_dir: Annotated[
        pathlib.Path, typer.Option("--data-dir", help="where SPACE keeps its state")
    ] = DEFAULT_DATA_DIR,
    *,
    port: Annotated[int, typer.Option("--port", help="port of the API on 127.0.0.1")] = 8470,
    detach: Annotated[bool, typer.Option("--detach", help="return once SPACE is ready")] = False,
    pools: Annotated[
        str,
        typer.Option(
            "--pools",
            help="warm pools: sandboxes kept started per template, so a create binds one "
            "(TEMPLATE=N,...; empty: none)",
        ),
    ] = DEFAULT_POOLS,
    e2b_api_port: Annotated[
        int | None,
        typer.Option("--e2b-api-port", help="port of E2B's control API (default PORT+1; 0: off)"),
    ] = None,
    e2b_sandbox_port: Annotated[
        int | None,
        typer.Option("--e2b-sandbox-port", help="port of E2B's in-sandbox API (default PORT+2; 0: off)"),
    ] = None,
    supervisor: Annotated[
        bool, typer.Option("--supervisor", hidden=True, help="the detached supervisor: output is a log")
    ] = False,
    config: Annotated[
        pathlib.Path | None,
        typer.Option(
            "--config",
            metavar="FILE",
            help="TOML file whose [controlplane] and [node] tunables apply (docs/operations.md; the "
            "environment wins over it)",
        ),
    ] = None,
) -> None:
    """Start the control plane, the node agent and the root helper on this machine."""
    from space.node.agent.pools import parse_pool_sizes

    try:
        parse_pool_sizes(pools)
        _apply_config(config)
    except errors.InvalidArgument as exc:
        stderr.print(f"error: {'' if config else '--pools: '}{exc.message}")
        raise typer.Exit(2) from exc
    filemodes.set_owner_only_umask()
    e2b_api_port = port + E2B_API_PORT_OFFSET if e2b_api_port is None else e2b_api_port
    e2b_sandbox_port = port + E2B_SANDBOX_PORT_OFFSET if e2b_sandbox_port is None else e2b_sandbox_port
    data_dir = data_dir.resolve()
    state = state_file(data_dir)
    if state.exists():
        info = json.loads(state.read_text())
        if alive(int(info.get("pid", 0))):
            stderr.print(f"SPACE is already running from {data_dir} (pid {info['pid']})")
            cluster = _described(data_dir, info)
            cluster.api_key = (data_dir / "admin.key").read_text().strip()
            _announce(cluster)
            return
        stop_leftovers(data_dir)  # its supervisor died: what it supervised would hold ports and sockets
        state.unlink()
    (data_dir / "purge-request").unlink(missing_ok=True)
    if not detach:
        e2b_ports = (e2b_api_port, e2b_sandbox_port)
        raise typer.Exit(_supervise(data_dir, port, pools, e2b_ports, announce=not supervisor))
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = filemodes.open_private_log(data_dir / "space.log")
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "space.cli.main", "up", "--data-dir", str(data_dir), "--port", str(port),
             "--pools", pools, "--e2b-api-port", str(e2b_api_port), "--e2b-sandbox-port",
             str(e2b_sandbox_port), "--supervisor"],
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
    cluster = _described(data_dir, json.loads(state.read_text()))
    cluster.api_key = (data_dir / "admin.key").read_text().strip()
    _announce(cluster)


def _described(data_dir: pathlib.Path, info: dict[str, Any]) -> LocalCluster:
    """The running installation as its supervisor's state file describes it (ports)."""
    api_port, sandbox_port = (int(p) for p in info.get("e2b_ports") or (0, 0))
    return _local_cluster(
        data_dir, port=int(info["port"]), e2b_api_port=api_port, e2b_sandbox_port=sandbox_port
    )


def down(
    data_dir: Annotated[pathlib.Path, typer.Option("--data-dir")] = DEFAULT_DATA_DIR,
    purge: Annotated[bool, typer.Option("--purge", help="also destroy every sandbox and the data")] = False,
) -> None:
    """Stop what `space up` started."""
    filemodes.set_owner_only_umask()
    data_dir = data_dir.resolve()
    pid = supervisor_pid(data_dir)
    if pid is None:
        _down_without_supervisor(data_dir, purge=purge)
        return
    if purge:
        (data_dir / "purge-request").write_text("1")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 300
    with stderr.status("stopping SPACE"):
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    state_file(data_dir).unlink(missing_ok=True)
    stderr.print("SPACE stopped" + (" and purged" if purge else ""))


def _down_without_supervisor(data_dir: pathlib.Path, *, purge: bool) -> None:
    """No live supervisor: stop what a dead one left running; `--purge` still destroys everything."""
    left = stop_leftovers(data_dir) if data_dir.is_dir() else []
    state_file(data_dir).unlink(missing_ok=True)
    if left:
        stderr.print(f"stopped {len(left)} process(es) a dead supervisor left running: {left}")
    if not purge or not data_dir.is_dir():
        stderr.print(f"SPACE is not running from {data_dir}")
        return
    try:
        with stderr.status("purging SPACE (not running)"):
            _local_cluster(data_dir).purge_offline()
    except errors.SpaceError as exc:
        stderr.print(f"error: {exc.code}: {exc.message}")
        raise typer.Exit(1) from exc
    stderr.print(f"SPACE was not running; {data_dir} purged")


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("down")(down)
    app.add_typer(node_app, name="node")
