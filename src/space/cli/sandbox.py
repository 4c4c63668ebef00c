"""`space sandbox ...` and `space snapshot ...`."""

import time
from typing import Annotated, Any

import typer

from space.cli._common import client, fields, handles_errors, parse_pairs, print_json, progress, table
from space.sdk import Sandbox, Snapshot

sandbox_app = typer.Typer(help="Create, inspect and drive sandboxes.", no_args_is_help=True)
snapshot_app = typer.Typer(
    help="Disk snapshots and full checkpoints of a sandbox; named ones outlive it.", no_args_is_help=True
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
SandboxId = Annotated[str, typer.Argument(metavar="ID", help="The sandbox id (sb-…).")]


def _summary_rows(sandboxes: list[Sandbox]) -> list[list[Any]]:
    return [
        [sb.id, sb.state, sb.data.get("template"), sb.data.get("node_id"), sb.data.get("created_at")]
        for sb in sandboxes
    ]


def _state_line(sb: Sandbox, as_json: bool) -> None:
    if as_json:
        print_json(sb.data)
    else:
        typer.echo(f"{sb.id} {sb.state}")


@sandbox_app.command("create")
@handles_errors
def create(  # noqa: PLR0917
    template: Annotated[str, typer.Option("--template", "-t", help="Template to start from.")] = "python",
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", metavar="K=V", help="Environment variable (repeat).")
    ] = None,
    allow: Annotated[
        list[str] | None,
        typer.Option("--allow", metavar="DOMAIN_OR_CIDR", help="Allow egress to a domain or CIDR (repeat)."),
    ] = None,
    credential: Annotated[
        list[str] | None,
        typer.Option("--credential", metavar="NAME", help="Bind a stored credential (repeat)."),
    ] = None,
    deny: Annotated[
        list[str] | None,
        typer.Option("--deny", metavar="DOMAIN_OR_CIDR", help="Deny egress to a domain or CIDR (repeat)."),
    ] = None,
    cpus: Annotated[float | None, typer.Option("--cpus", help="CPU limit.")] = None,
    memory_mb: Annotated[int | None, typer.Option("--memory-mb", help="Memory limit in MiB.")] = None,
    disk_mb: Annotated[int | None, typer.Option("--disk-mb", help="Disk limit in MiB.")] = None,
    storage_mb: Annotated[
        int | None,
        typer.Option("--storage-mb", help="Files + snapshots + checkpoint images, in MiB (default 2x disk)."),
    ] = None,
    idle_timeout_s: Annotated[
        int | None, typer.Option("--idle-timeout", help="Pause after this many idle seconds.")
    ] = None,
    ttl_s: Annotated[
        int | None, typer.Option("--ttl", help="Deadline in seconds (then --on-timeout; reset: `timeout`).")
    ] = None,
    on_timeout: Annotated[
        str | None,
        typer.Option(
            "--on-timeout", metavar="delete|pause", help="At the deadline: delete, or pause (kept)."
        ),
    ] = None,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", metavar="K=V", help="A label to list by (repeat).")
    ] = None,
    disk_snapshot_every: Annotated[
        int | None, typer.Option("--disk-snapshot-every", metavar="S", help="Scheduled disk snapshots.")
    ] = None,
    checkpoint_every: Annotated[
        int | None, typer.Option("--checkpoint-every", metavar="S", help="Scheduled full checkpoints.")
    ] = None,
    upload_checkpoints: Annotated[
        bool,
        typer.Option("--upload-checkpoints", help="Upload scheduled checkpoints (recovery on any node)."),
    ] = False,
    from_snapshot: Annotated[
        str | None,
        typer.Option(
            "--from-snapshot", metavar="ID|NAME", help="Start from a full snapshot (its source's template)."
        ),
    ] = None,
    isolation: Annotated[
        str | None,
        typer.Option(
            "--isolation",
            metavar="gvisor|microvm",
            help="gVisor (the default) or a QEMU microVM on its own kernel (a node must run them).",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a sandbox and wait until it runs; prints its id."""
    env_vars = parse_pairs(env, "--env")
    limits: dict[str, Any] = {}
    if cpus is not None:
        limits["cpus"] = cpus
    if memory_mb is not None:
        limits["memory_mb"] = memory_mb
    if disk_mb is not None:
        limits["disk_mb"] = disk_mb
    if storage_mb is not None:
        limits["storage_mb"] = storage_mb
    sp = client()
    source = f"snapshot {from_snapshot}" if from_snapshot else f"template {template}"
    with progress(f"creating a sandbox from {source}…"):
        sb = sp.sandboxes.create(
            template=template,
            env=env_vars,
            limits=limits or None,
            idle_timeout_s=idle_timeout_s,
            ttl_s=ttl_s,
            allow=allow,
            credentials=credential,
            deny=deny,
            snapshot_policy=_policy(disk_snapshot_every, checkpoint_every, upload_checkpoints),
            metadata=parse_pairs(metadata, "--metadata") if metadata else None,
            on_timeout=on_timeout,
            from_snapshot=from_snapshot,
            isolation=isolation,
        )
    if as_json:
        print_json(sb.data)
    else:
        typer.echo(sb.id)


def _policy(disk_every_s: int | None, full_every_s: int | None, upload: bool) -> dict[str, Any] | None:
    if disk_every_s is None and full_every_s is None:
        if upload:
            raise typer.BadParameter("--upload-checkpoints needs --checkpoint-every")
        return None
    return {"disk_every_s": disk_every_s, "full_every_s": full_every_s, "upload_full": upload}


@sandbox_app.command("list")
@handles_errors
def list_(
    state: Annotated[list[str] | None, typer.Option("--state", help="Only in this state (repeat).")] = None,
    template: Annotated[str | None, typer.Option("--template", "-t", help="Only of this template.")] = None,
    metadata: Annotated[
        list[str] | None,
        typer.Option("--metadata", "-m", metavar="K=V", help="Only with this label (repeat)."),
    ] = None,
    oldest_first: Annotated[
        bool, typer.Option("--oldest-first", help="Oldest first (default newest).")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """List the sandboxes of the key's project (every page), newest first."""
    sandboxes = client().sandboxes.list(
        state=state, template=template, metadata=parse_pairs(metadata, "--metadata") if metadata else None,
        order="asc" if oldest_first else "desc",
    )  # fmt: skip
    if as_json:
        print_json([sb.data for sb in sandboxes])
        return
    rows = [[*row, sb.expires_at] for row, sb in zip(_summary_rows(sandboxes), sandboxes, strict=True)]
    table(rows, ["ID", "STATE", "TEMPLATE", "NODE", "CREATED", "EXPIRES"])


@sandbox_app.command("timeout")
@handles_errors
def timeout(
    sandbox_id: SandboxId,
    seconds: Annotated[int, typer.Argument(min=0, help="The deadline, in seconds from now (0: now).")],
    extend_only: Annotated[
        bool, typer.Option("--extend-only", help="Only move the deadline later, never earlier.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Set a sandbox's deadline (what happens then is its on_timeout); prints the new deadline."""
    sb = client().sandboxes.ref(sandbox_id).set_timeout(seconds, extend_only=extend_only)
    if as_json:
        print_json(sb.data)
    else:
        typer.echo(f"{sb.id} expires {sb.expires_at or 'never'} ({sb.data.get('on_timeout', 'delete')})")


@sandbox_app.command("get")
@handles_errors
def get(sandbox_id: SandboxId, as_json: JsonFlag = False) -> None:
    """Show one sandbox."""
    sb = client().sandboxes.get(sandbox_id)
    if as_json:
        print_json(sb.data)
    else:
        fields(sb.data)


@sandbox_app.command("events")
@handles_errors
def events(
    sandbox_id: SandboxId,
    after: Annotated[int, typer.Option("--after", min=0, help="Only events with a larger id.")] = 0,
    limit: Annotated[int, typer.Option("--limit", min=1, max=500, help="At most this many.")] = 100,
    kind: Annotated[
        str | None, typer.Option("--kind", help="Only events of this kind (e.g. sandbox.recovered).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """What happened to a sandbox beyond its state (crashes and their reasons, recoveries), oldest first."""
    found = client().sandboxes.ref(sandbox_id).events(after=after, limit=limit, kind=kind)
    if as_json:
        print_json([e.data for e in found])
        return
    table([[e.id, e.data.get("at"), e.kind, e.message] for e in found], ["ID", "AT", "KIND", "MESSAGE"])


@sandbox_app.command("metrics")
@handles_errors
def metrics(
    sandbox_id: SandboxId,
    since: Annotated[
        float | None, typer.Option("--since", min=0, help="Only the last this many seconds.")
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", min=1, max=1000, help="At most this many (newest).")
    ] = 1000,
    as_json: JsonFlag = False,
) -> None:
    """A sandbox's CPU, memory and disk every few seconds (the last hour), oldest first."""
    start = time.time() - since if since is not None else None
    found = client().sandboxes.ref(sandbox_id).metrics(start=start, limit=limit)
    if as_json:
        print_json([m.data for m in found])
        return
    rows = [
        [m.at.strftime("%H:%M:%S"), f"{m.cpu_used_pct:.1f}% of {m.data.get('cpu_count')}",
         f"{_mib(m.data.get('mem_used_bytes'))} / {_mib(m.data.get('mem_total_bytes'))}",
         f"{_mib(m.data.get('disk_used_bytes'))} / {_mib(m.data.get('disk_total_bytes'))}"]
        for m in found
    ]  # fmt: skip
    table(rows, ["TIME (UTC)", "CPU", "MEMORY MiB", "DISK MiB"])


def _mib(value: Any) -> str:
    return "?" if value is None else f"{int(value) / (1 << 20):.1f}"


def _lifecycle(action: str, doc: str, message: str | None = None) -> None:
    @handles_errors
    def command(sandbox_id: SandboxId, as_json: JsonFlag = False) -> None:
        sb = client().sandboxes.ref(sandbox_id)
        with progress(message or f"{action} {sandbox_id}…"):
            sb = getattr(sb, action)()
        _state_line(sb, as_json)

    command.__doc__ = doc
    command.__name__ = action
    sandbox_app.command(action)(command)


_lifecycle("pause", "Pause a running sandbox (processes frozen, memory kept).", "pausing…")
_lifecycle("resume", "Resume a paused sandbox.", "resuming…")
_lifecycle("stop", "Stop a sandbox: processes end, the disk is kept.", "stopping…")
_lifecycle("start", "Start a stopped sandbox.", "starting…")
_lifecycle("suspend", "Suspend a sandbox to object storage, freeing its node.", "suspending…")
_lifecycle("restore", "Restore a suspended sandbox onto a node.", "restoring…")
_lifecycle("delete", "Delete a sandbox.", "deleting…")


@sandbox_app.command("fork")
@handles_errors
def fork(
    sandbox_id: SandboxId,
    count: Annotated[int, typer.Option("--count", "-n", min=1, help="How many children.")] = 1,
    as_json: JsonFlag = False,
) -> None:
    """Fork a sandbox (processes and files); prints the child's id (one per line with --count)."""
    parent = client().sandboxes.ref(sandbox_id)
    with progress(f"forking {sandbox_id}…"):
        children = parent.fork(count=count)
    if as_json:
        print_json(children[0].data if count == 1 else [child.data for child in children])
        return
    for child in children:
        typer.echo(child.id)


@sandbox_app.command("rollback")
@handles_errors
def rollback(
    sandbox_id: SandboxId,
    snapshot_id: Annotated[str, typer.Argument(metavar="SNAPSHOT_ID", help="The snapshot (snap-…).")],
    as_json: JsonFlag = False,
) -> None:
    """Roll a sandbox back to one of its snapshots."""
    sb = client().sandboxes.ref(sandbox_id)
    with progress(f"rolling {sandbox_id} back to {snapshot_id}…"):
        sb.rollback(snapshot_id)
    _state_line(sb, as_json)


@sandbox_app.command("egress")
@handles_errors
def egress(
    sandbox_id: SandboxId,
    allow: Annotated[
        list[str] | None,
        typer.Option(
            "--allow", metavar="DOMAIN_OR_CIDR", help="Allowed destination (repeat; replaces the list)."
        ),
    ] = None,
    deny: Annotated[
        list[str] | None,
        typer.Option(
            "--deny", metavar="DOMAIN_OR_CIDR", help="Denied destination (repeat; replaces the list)."
        ),
    ] = None,
    credential: Annotated[
        list[str] | None,
        typer.Option("--credential", metavar="NAME", help="Bound credential (repeat; replaces the list)."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Show a sandbox's egress policy, or change it at run time (lists not given are kept)."""
    sb = client().sandboxes.ref(sandbox_id)
    if allow is None and deny is None and credential is None:
        policy = sb.egress()
    else:
        policy = sb.set_egress(allow=allow, deny=deny, credentials=credential)
    if as_json:
        print_json(policy)
    else:
        fields(policy)


def _snapshot_rows(snapshots: list[Snapshot]) -> list[list[Any]]:
    return [
        [s.id, s.kind, s.data.get("created_at"), _size(s.exclusive_bytes), _size(s.data.get("size_bytes")),
         ",".join(s.locations) or "-"]
        for s in snapshots
    ]  # fmt: skip


def _size(value: Any) -> str:
    if value is None:
        return "-"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return str(value)


@snapshot_app.command("create")
@handles_errors
def snapshot_create(
    sandbox_id: SandboxId,
    full: Annotated[
        bool, typer.Option("--full", help="A full checkpoint (processes and memory too).")
    ] = False,
    name: Annotated[
        str | None,
        typer.Option("--name", help="Name a full snapshot (`sandbox create --from-snapshot NAME`)."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Snapshot a sandbox; prints the snapshot's id."""
    sb = client().sandboxes.ref(sandbox_id)
    with progress("checkpointing…" if full else "snapshotting…"):
        snap = sb.snapshots.create(full=full, name=name)
    if as_json:
        print_json(snap.data)
    else:
        typer.echo(snap.id)


@snapshot_app.command("list")
@handles_errors
def snapshot_list(
    sandbox_id: Annotated[
        str | None, typer.Argument(metavar="[ID]", help="The sandbox id (sb-…); none: the project's.")
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Only the project's full snapshots of this name (or id).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """List a sandbox's snapshots, or the project's full ones (named ones outlive their sandbox)."""
    if sandbox_id is not None and name is None:
        snapshots = client().sandboxes.ref(sandbox_id).snapshots.list()
    else:
        snapshots = client().snapshots.list(name=name)
        if sandbox_id is not None:
            snapshots = [s for s in snapshots if s.sandbox_id == sandbox_id]
    if as_json:
        print_json([s.data for s in snapshots])
        return
    table(_snapshot_rows(snapshots), ["ID", "KIND", "CREATED", "EXCLUSIVE", "SIZE", "LOCATION"])


@snapshot_app.command("delete")
@handles_errors
def snapshot_delete(
    ref: Annotated[str, typer.Argument(metavar="ID|NAME", help="A snapshot id, or a name (all of it).")],
) -> None:
    """Delete a snapshot by id, or every snapshot of a name (also after its sandbox was deleted); prints
    the ids deleted."""
    for snapshot_id in client().snapshots.delete(ref):
        typer.echo(snapshot_id)
