"""`space project ...`, `space key ...`, `space credential ...` and `space bench`."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from space.cli._common import EXIT_USAGE, binary_stream, client, handles_errors, print_json, state

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
    as_json: JsonFlag = False,
) -> None:
    """Create an API key; prints the key (shown only this once)."""
    if role not in {"admin", "member", "read-only"}:
        raise typer.BadParameter("must be admin, member or read-only", param_hint="--role")
    key = client().keys.create(project=project, role=role)
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
    value: Annotated[str, typer.Option("--value", help="The secret ('-' reads it from stdin).")],
    host: Annotated[list[str], typer.Option("--host", help="Host the credential is bound to (repeat).")],
    header: Annotated[
        str | None,
        typer.Option("--header", help="Header to inject, e.g. 'Authorization: Bearer {value}'."),
    ] = None,
    project: Annotated[str | None, typer.Option("--project", metavar="P", help="Project name or id.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Store (or replace) a credential; the sandbox sees a placeholder, the gateway injects the value."""
    secret = value
    if value == "-":
        secret = binary_stream("stdin").read().decode("utf-8").rstrip("\r\n")
    credential = client().credentials.set(name, value=secret, hosts=host, header=header, project=project)
    if as_json:
        print_json(credential.data)
    else:
        typer.echo(credential.data.get("id") or name)


def find_bench_module() -> Path | None:
    """bench/api_bench.py where `python -m bench.api_bench` would find it (the current directory first)."""
    for entry in [Path.cwd(), *(Path(p) for p in sys.path if p)]:
        candidate = entry / "bench" / "api_bench.py"
        if candidate.is_file():
            return candidate
    return None


def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Fewer iterations.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Benchmark the API (runs `python -m bench.api_bench`)."""
    module = find_bench_module()
    if module is None:
        typer.echo(
            "error: the API benchmark (bench/api_bench.py) is not available here; "
            "run `space bench` from a SPACE source checkout",
            err=True,
        )
        raise typer.Exit(EXIT_USAGE)
    argv = [sys.executable, "-m", "bench.api_bench"]
    if quick:
        argv.append("--quick")
    if as_json:
        argv.append("--json")
    env = dict(os.environ)
    if state.url:
        env["SPACE_URL"] = state.url
    if state.api_key:
        env["SPACE_API_KEY"] = state.api_key
    completed = subprocess.run(argv, cwd=module.parent.parent, env=env, check=False)
    raise typer.Exit(completed.returncode)
