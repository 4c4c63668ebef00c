"""`space project ...`, `space key ...`, `space credential ...` and `space bench`."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from space.cli._common import EXIT_USAGE, binary_stream, client, handles_errors, print_json, state, table

project_app = typer.Typer(help="Projects (org admin keys only).", no_args_is_help=True)
key_app = typer.Typer(help="API keys.", no_args_is_help=True)
credential_app = typer.Typer(
    help="Credentials the egress gateway injects; sandboxes never see them.", no_args_is_help=True
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]


@project_app.command("create")
@handles_errors
def project_create(name: Annotated[str, typer.Argument(metavar="NAME")], as_json: JsonFlag = False) -> None:
    """Create a project; prints its id."""
    project = client().projects.create(name)
    if as_json:
        print_json(project.data)
    else:
        typer.echo(project.id)


@project_app.command("list")
@handles_errors
def project_list(as_json: JsonFlag = False) -> None:
    """List projects."""
    projects = client().projects.list()
    if as_json:
        print_json([p.data for p in projects])
        return
    for project in projects:
        typer.echo(f"{project.id}  {project.name}")


@key_app.command("create")
@handles_errors
def key_create(
    project: Annotated[str, typer.Option("--project", metavar="NAME", help="Project name or id.")],
    role: Annotated[str, typer.Option("--role", help="admin, member or read-only.")] = "member",
    e2b: Annotated[
        bool, typer.Option("--e2b", help="in E2B's key shape (e2b_ + hex), for E2B SDKs that check it")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Create an API key; prints the key (shown only this once)."""
    if role not in {"admin", "member", "read-only"}:
        raise typer.BadParameter("must be admin, member or read-only", param_hint="--role")
    key = client().keys.create(project=project, role=role, e2b=e2b)
    if as_json:
        print_json(key.data)
    else:
        typer.echo(key.key or "")


@key_app.command("delete")
@handles_errors
def key_delete(key_id: Annotated[str, typer.Argument(metavar="KEY_ID")]) -> None:
    """Revoke an API key."""
    client().keys.delete(key_id)


@credential_app.command("set")
@handles_errors
def credential_set(  # noqa: PLR0917
    name: Annotated[str, typer.Argument(metavar="NAME")],
    value: Annotated[
        str | None, typer.Option("--value", help="The secret ('-' reads it from stdin); omit to keep it.")
    ] = None,
    host: Annotated[
        list[str] | None, typer.Option("--host", help="Host the credential is bound to (repeat; *.x.y ok).")
    ] = None,
    header: Annotated[
        str | None,
        typer.Option("--header", help="Header to inject, e.g. 'Authorization: Bearer {value}'."),
    ] = None,
    method: Annotated[
        str | None, typer.Option("--method", help="bearer (default), basic, query or header.")
    ] = None,
    query_param: Annotated[str | None, typer.Option("--query-param", help="For --method query.")] = None,
    scope: Annotated[str | None, typer.Option("--scope", help="project (default), org or sandbox.")] = None,
    sandbox: Annotated[
        str | None, typer.Option("--sandbox", metavar="ID", help="For --scope sandbox.")
    ] = None,
    env_var: Annotated[
        str | None, typer.Option("--env-var", help="Where sandboxes find the placeholder (default: NAME).")
    ] = None,
    expires_at: Annotated[
        str | None, typer.Option("--expires-at", help="ISO 8601 time with zone, e.g. 2027-01-01T00:00:00Z.")
    ] = None,
    rate_per_minute: Annotated[
        int | None, typer.Option("--rate-per-minute", help="Uses allowed per minute at the gateway.")
    ] = None,
    project: Annotated[str | None, typer.Option("--project", metavar="P", help="Project name or id.")] = None,
    login_origin: Annotated[
        str | None, typer.Option("--login-origin", help="A login credential's https://host[:port].")
    ] = None,
    username_field: Annotated[str | None, typer.Option("--username-field", help="Its form's field.")] = None,
    password_field: Annotated[str | None, typer.Option("--password-field", help="Its form's field.")] = None,
    form_action: Annotated[str | None, typer.Option("--form-action", help="The path it posts to.")] = None,
    username: Annotated[str | None, typer.Option("--username", help="A login's username.")] = None,
    password: Annotated[
        str | None, typer.Option("--password", help="A login's password ('-' reads it from stdin).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Store, update or rotate a credential; sandboxes see a placeholder, the gateway injects the value.
    A login (ADR 0063): --login-origin, --username-field, --password-field [--form-action], --username and
    --password instead of --value and --host."""
    secret = value
    if value == "-":
        secret = binary_stream("stdin").read().decode("utf-8").rstrip("\r\n")
    if password == "-":  # noqa: S105 - "-" means "read it from stdin", not a password
        password = binary_stream("stdin").read().decode("utf-8").rstrip("\r\n")
    login = None
    if login_origin is not None or username_field is not None or password_field is not None:
        login = {"origin": login_origin, "username_field": username_field, "password_field": password_field,
                 "form_action": form_action}  # fmt: skip
    credential = client().credentials.set(
        name, value=secret, hosts=host or None, header=header, project=project, method=method,
        query_param=query_param, scope=scope, sandbox_id=sandbox, env_var=env_var, expires_at=expires_at,
        rate_per_minute=rate_per_minute, login=login, username=username, password=password,
    )  # fmt: skip
    if as_json:
        print_json(credential.data)
    else:
        typer.echo(f"{credential.data.get('name', name)} {credential.data.get('placeholder', '')}".strip())


@credential_app.command("list")
@handles_errors
def credential_list(
    project: Annotated[str | None, typer.Option("--project", metavar="P", help="Project name or id.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """List credentials (metadata only: values are never shown)."""
    credentials = client().credentials.list(project=project)
    if as_json:
        print_json([c.data for c in credentials])
        return
    rows = [
        [c.data.get("name"), c.data.get("scope"), ",".join(c.data.get("hosts") or []), c.data.get("method"),
         c.data.get("version"), c.data.get("expires_at") or "-", _usage(c.data.get("usage")),
         c.data.get("placeholder")]
        for c in credentials
    ]  # fmt: skip
    table(rows, ["NAME", "SCOPE", "HOSTS", "METHOD", "VERSION", "EXPIRES", "USED", "PLACEHOLDER"])


def _usage(usage: Any) -> str:
    """Injections (and refusals) as the list counts them from the audit log; '-' from an older server."""
    if not isinstance(usage, dict):
        return "-"
    refused = usage.get("refused") or 0
    return f"{usage.get('injected', 0)}" + (f" ({refused} refused)" if refused else "")


@credential_app.command("delete")
@handles_errors
def credential_delete(
    name: Annotated[str, typer.Argument(metavar="NAME")],
    scope: Annotated[str, typer.Option("--scope", help="project (default), org or sandbox.")] = "project",
    sandbox: Annotated[
        str | None, typer.Option("--sandbox", metavar="ID", help="For --scope sandbox.")
    ] = None,
    project: Annotated[str | None, typer.Option("--project", metavar="P", help="Project name or id.")] = None,
) -> None:
    """Delete a credential (its value is destroyed; the audit log keeps its history)."""
    client().credentials.delete(name, scope=scope, sandbox_id=sandbox, project=project)


@credential_app.command("audit")
@handles_errors
def credential_audit(
    name: Annotated[str, typer.Argument(metavar="NAME")],
    scope: Annotated[str, typer.Option("--scope", help="project (default), org or sandbox.")] = "project",
    sandbox: Annotated[
        str | None, typer.Option("--sandbox", metavar="ID", help="For --scope sandbox.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """The audit log of a credential: every change and use."""
    entries = client().credentials.audit(name, scope=scope, sandbox_id=sandbox, limit=1000)
    if as_json:
        print_json(entries)
        return
    rows = [[e.get("at"), e.get("action"), e.get("actor"), e.get("sandbox_id") or "-", e.get("host") or "-"]
            for e in entries]  # fmt: skip
    table(rows, ["AT", "ACTION", "ACTOR", "SANDBOX", "HOST"])


def find_bench_module() -> Path | None:
    """bench/api_bench.py where `python -m bench.api_bench` would find it (the current directory first)."""
    for entry in [Path.cwd(), *(Path(p) for p in sys.path if p)]:
        candidate = entry / "bench" / "api_bench.py"
        if candidate.is_file():
            return candidate
    return None


def bench(  # noqa: PLR0917
    quick: Annotated[bool, typer.Option("--quick", help="Few samples (under a minute).")] = False,
    as_json: JsonFlag = False,
    embedded: Annotated[
        bool, typer.Option("--embedded", help="Start an installation of its own (root), purged at the end.")
    ] = False,
    template: Annotated[str, typer.Option("--template", help="Template to create sandboxes of.")] = "python",
    node_url: Annotated[
        str | None, typer.Option("--node-url", metavar="URL", help="The node agent's RPC (exec_true_node).")
    ] = None,
    node_data_dir: Annotated[
        Path | None,
        typer.Option("--node-data-dir", metavar="DIR", help="The node's data directory on this host."),
    ] = None,
    results_dir: Annotated[
        Path | None, typer.Option("--results-dir", metavar="DIR", help="Default: bench/results.")
    ] = None,
    rate: Annotated[
        float | None, typer.Option("--rate", help="Creations per second at most (default 5; 0: no pacing).")
    ] = None,
    pool_size: Annotated[
        int | None, typer.Option("--pool-size", help="--embedded: the node's pool size (default 6).")
    ] = None,
    samples: Annotated[int | None, typer.Option("--samples", hidden=True, min=1)] = None,
) -> None:
    """Benchmark a SPACE through its API ($SPACE_URL or config; --embedded: one of its own) against a plain
    runsc baseline; writes JSON and a chart under bench/results (runs `python -m bench.api_bench`)."""
    module = find_bench_module()
    if module is None:
        typer.echo(
            "error: the API benchmark (bench/api_bench.py) is not available here; "
            "run `space bench` from a SPACE source checkout",
            err=True,
        )
        raise typer.Exit(EXIT_USAGE)
    argv = [sys.executable, "-m", "bench.api_bench", "--template", template]
    flags = {"--quick": quick, "--json": as_json, "--embedded": embedded}
    argv += [flag for flag, on in flags.items() if on]
    options = {"--node-url": node_url, "--node-data-dir": node_data_dir, "--results-dir": results_dir,
               "--rate": rate, "--pool-size": pool_size, "--samples": samples}  # fmt: skip
    for option, value in options.items():
        if value is not None:
            argv += [option, str(value)]
    env = dict(os.environ)
    if state.url:
        env["SPACE_URL"] = state.url
    if state.api_key:
        env["SPACE_API_KEY"] = state.api_key
    completed = subprocess.run(argv, cwd=module.parent.parent, env=env, check=False)
    raise typer.Exit(completed.returncode)
