"""`space status`: the installation `space up` runs from a data directory, as its supervisor and its
control plane see it.

Where each part comes from (the report says so in `sources`):
- components (pid, state, uptime, restarts, last exit): DATA_DIR/status.json, which the supervisor
  rewrites on every change (ADR 0037); uptime is computed now from the recorded start time, and only
  while the supervisor is alive (a dead supervisor's file is shown as it was left, `running: false`);
- versions (ADR 0079): this command's, the control plane's (its /healthz answer) and each node's (its
  heartbeats, kept in the database);
- the control plane's health: GET /healthz at the url the supervisor recorded (no key needed), and the
  E2B front's: GET /health of its control API (docs/e2b.md; a port it could not bind shows here);
- the nodes (status, capacity, use, ready warm-pool members per template, last heartbeat): the control
  plane's own database in DATA_DIR, read directly, so they are shown even when the API is down (`space
  node list` asks the API, with an org admin key); with the operator's hold on each (`admin`: active,
  cordoned, draining, drained, ADR 0065).

Exit code 0 when the supervisor runs, 6 (unavailable) when it does not; `--json` prints JSON only.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Annotated, Any

import httpx
import typer

from space.cli._common import EXIT_OK, EXIT_UNAVAILABLE
from space.cli.installation import DEFAULT_DATA_DIR, read_state, rows_of, supervisor_pid
from space.controlplane.supervisor import read_status
from space.core import errors, versions

HEALTH_TIMEOUT_S = 2.0


def collect(data_dir: pathlib.Path, *, now: float | None = None) -> dict[str, Any]:
    """The whole report (what `--json` prints)."""
    now = time.time() if now is None else now
    pid = supervisor_pid(data_dir)
    recorded = read_status(data_dir) or {}
    url = recorded.get("url") or (read_state(data_dir) or {}).get("url")
    components = []
    for row in rows_of(recorded):
        started = row.get("started_at")
        uptime = None
        if pid is not None and row.get("state") == "running" and isinstance(started, (int, float)):
            uptime = round(now - started, 1)
        components.append({**row, "uptime_s": uptime})
    return {
        "data_dir": str(data_dir),
        "running": pid is not None,
        "supervisor_pid": pid,
        "url": url,
        "components": components,
        "controlplane": _health(str(url)) if url and pid is not None else {"health": "not running"},
        "e2b": _e2b(recorded, running=pid is not None),
        "nodes": _nodes(data_dir),
        "sources": {
            "components": "status file",
            "controlplane": "api /healthz",
            "e2b": "e2b api /health",
            "nodes": "database",
        },
    }


def _e2b(recorded: dict[str, Any], *, running: bool) -> dict[str, Any]:
    """The E2B front (docs/e2b.md): its URLs and whether its control API answers (an E2B port that could
    not be bound leaves SPACE's API running without it: this is where that shows)."""
    api, sandbox = recorded.get("e2b_api_url"), recorded.get("e2b_sandbox_url")
    if not api:
        return {"health": "not served"}
    health = _health(str(api), "/health") if running else {"health": "not running"}
    return {"api_url": api, "sandbox_url": sandbox, **health}


def _health(url: str, path: str = "/healthz") -> dict[str, Any]:
    try:
        answer = httpx.get(f"{url}{path}", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return {"health": "unreachable", "error": f"{type(exc).__name__}: {exc}"[:200]}
    if answer.status_code == 200:
        reported = answer.json() if "json" in answer.headers.get("content-type", "") else {}
        version = versions.parse_reported(reported.get("version") if isinstance(reported, dict) else None)
        return {"health": "ok", "version": version}  # the control plane's own SPACE version (ADR 0079)
    return {"health": "unhealthy", "status_code": answer.status_code}


def _nodes(data_dir: pathlib.Path) -> list[dict[str, Any]] | None:
    """Every node the control plane knows (None: no database here, or it cannot be read)."""
    # Imported here: SQLAlchemy and the store cost every other `space` command ~0.4 s of start-up.
    from space.controlplane.store.engine import SQLITE_FILENAME, sqlite_url
    from space.controlplane.store.store import Store
    from space.core import node_states

    if not (data_dir / SQLITE_FILENAME).is_file():
        return None
    try:
        store = Store(sqlite_url(data_dir))
    except errors.SpaceError:
        return None
    try:
        nodes = store.list_nodes(None)
    except errors.SpaceError:
        return None
    finally:
        store.close()
    return [
        {"id": node.id, "url": node.url, "status": node.status,
         "admin": node_states.of_labels(node.labels).value, "capacity": node.capacity, "used": node.used,
         "space_version": node.space_version, "pools": node.pools or {},
         "last_heartbeat_at": node.last_heartbeat_at.isoformat()}
        for node in nodes
    ]  # fmt: skip


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _e2b_line(e2b: dict[str, Any]) -> str:
    if "api_url" not in e2b:
        return f"E2B front: {e2b.get('health', 'not served')}"
    return (
        f"E2B front: {e2b.get('health')} (E2B_API_URL={e2b['api_url']} E2B_SANDBOX_URL={e2b['sandbox_url']})"
    )


def _own_version() -> str:
    try:
        return versions.space_version()
    except errors.InvalidArgument:  # a bad SPACE_VERSION_OVERRIDE: the report is still worth showing
        return "?"


def render(report: dict[str, Any]) -> str:
    head = "running" if report["running"] else "NOT running"
    lines = [
        f"SPACE {head} from {report['data_dir']}"
        + (f" (supervisor pid {report['supervisor_pid']}, {report['url']})" if report["running"] else ""),
        f"SPACE {_own_version()} (this command); control plane: "
        f"{report['controlplane'].get('health')}"
        + (f" ({report['controlplane']['version']})" if report["controlplane"].get("version") else ""),
        _e2b_line(report.get("e2b") or {}),
        "",
        f"{'COMPONENT':<13}{'PID':>8}  {'STATE':<9}{'UPTIME':>10}{'RESTARTS':>10}  LAST EXIT",
    ]
    for row in report["components"]:
        lines.append(
            f"{row['name']:<13}{row.get('pid') or '-':>8}  {row['state']:<9}{_duration(row['uptime_s']):>10}"
            f"{row['restarts']:>10}  {row.get('last_exit') or '-'}"
        )
    lines.append("")
    nodes = report["nodes"]
    if nodes is None:
        lines.append("nodes: (no database in the data directory)")
    for node in nodes or []:
        cap, used = node["capacity"], node["used"]
        lines.append(
            f"node {node['id']} {node['status']} ({node.get('admin', 'active')}) at {node['url']}: "
            f"sandboxes {used.get('sandboxes', 0)}/"
            f"{cap.get('sandboxes', '?')}, cpus {cap.get('cpus', '?')}, mem {cap.get('memory_mb', '?')} MiB, "
            f"SPACE {node.get('space_version') or '?'}"
            + "".join(f", pool {name} {count}" for name, count in sorted((node.get("pools") or {}).items()))
        )
    return "\n".join(lines)


def status(
    data_dir: Annotated[
        pathlib.Path, typer.Option("--data-dir", help="where SPACE keeps its state")
    ] = DEFAULT_DATA_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON only")] = False,
) -> None:
    """Each component `space up` supervises (pid, state, uptime, restarts, last exit), the control
    plane's health and the nodes it knows."""
    report = collect(data_dir.resolve())
    typer.echo(json.dumps(report, indent=2) if as_json else render(report))
    raise typer.Exit(EXIT_OK if report["running"] else EXIT_UNAVAILABLE)
