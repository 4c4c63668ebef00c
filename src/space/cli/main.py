"""`space`: the command line of SPACE, thin over the SDK (entry point `space.cli.main:app`).

Commands: sandbox, snapshot, exec, files, project, key, credential, template, bench, trace, status (the local
installation); `up`/`down` come from space.cli.up when that module exists. Exit codes are documented
in space.cli._common.
"""

import importlib
from typing import Annotated, Any

import typer

from space.cli._common import EXIT_USAGE, state
from space.cli.admin import bench, credential_app, key_app, project_app
from space.cli.backup import backup_app
from space.cli.controlplane_role import controlplane_app
from space.cli.data import exec_command, files_app
from space.cli.logs import logs_command
from space.cli.mcp_server import mcp_command
from space.cli.node_join import join as node_join
from space.cli.nodes import node_app
from space.cli.sandbox import sandbox_app, snapshot_app
from space.cli.service import service_app
from space.cli.status import status
from space.cli.templates import template_app
from space.cli.trace import trace_command
from space.core import errors, versions

app = typer.Typer(
    name="space",
    help="SPACE: self-hostable sandboxes for long-running AI agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(wanted: bool) -> None:
    """`space --version`: the version every component of this installation reports (ADR 0079)."""
    if wanted:
        try:
            typer.echo(f"space {versions.space_version()}")
        except errors.InvalidArgument as exc:
            typer.echo(f"error: {exc.message}", err=True)
            raise typer.Exit(EXIT_USAGE) from exc
        raise typer.Exit(0)


@app.callback()
def main(
    url: Annotated[
        str | None, typer.Option("--url", metavar="URL", help="Server URL (default: $SPACE_URL or config).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", metavar="KEY", help="API key (default: $SPACE_API_KEY or config)."),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_print_version, help="Print SPACE's version and exit."
        ),
    ] = False,
) -> None:
    """SPACE: self-hostable sandboxes for long-running AI agents."""
    state.url = url
    state.api_key = api_key


app.add_typer(sandbox_app, name="sandbox")
app.add_typer(snapshot_app, name="snapshot")
app.add_typer(files_app, name="files")
app.add_typer(project_app, name="project")
app.add_typer(key_app, name="key")
app.add_typer(credential_app, name="credential")
app.add_typer(template_app, name="template")
app.add_typer(backup_app, name="backup")
app.add_typer(controlplane_app, name="controlplane")
app.add_typer(service_app, name="service")  # systemd units of this machine's roles (ADR 0071)
app.command(
    "exec",
    context_settings={"allow_interspersed_args": False},
)(exec_command)
app.command("bench")(bench)
app.command("status")(status)
app.command("logs")(logs_command)  # this machine's logs, merged (ADR 0071)
app.command("mcp")(mcp_command)
app.command("trace")(trace_command)  # a sandbox's operations as waterfalls (ADR 0072)
node_app.command("join")(node_join)  # node_app joins `space` with `up` (space.cli.up.register)


def _register_up(target: typer.Typer) -> None:
    """Add `space up`/`space down` from space.cli.up (written separately) when it exists.

    The module may offer `register(app)`, a typer app `app` whose commands are merged, or functions named
    `up` and `down`. A missing module means no such commands; a module that fails to import gets stand-ins
    that report why, instead of vanishing silently."""
    try:
        module: Any = importlib.import_module("space.cli.up")
    except ModuleNotFoundError as exc:
        if exc.name == "space.cli.up":
            return
        _broken_up(target, exc)
        return
    except ImportError as exc:
        _broken_up(target, exc)
        return
    register = getattr(module, "register", None)
    if callable(register):
        register(target)
        return
    sub = getattr(module, "app", None)
    if isinstance(sub, typer.Typer):
        target.registered_commands.extend(sub.registered_commands)
        return
    for name in ("up", "down"):
        command = getattr(module, name, None)
        if callable(command):
            target.command(name)(command)


def _broken_up(target: typer.Typer, exc: ImportError) -> None:
    def unavailable() -> None:
        typer.echo(f"error: `space up`/`space down` are unavailable: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE)

    for name in ("up", "down"):
        target.command(name, help="(unavailable: space.cli.up failed to import)")(unavailable)


_register_up(app)


if __name__ == "__main__":
    app()
