"""`space template build|list|get|logs|delete`: a project's templates (ADR 0055, docs/templates.md).

`build` streams the build log to stderr as the node writes it (with a spinner on a terminal), prints the
template's id on stdout when it is ready, and exits non-zero with the reason when the build fails
(`error: build_failed: ...`, exit 1) or is refused (the documented exit codes of space.cli._common).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from space.cli._common import client, fields, handles_errors, print_json, stderr_console, table, usage_error
from space.cli.template_file import TemplateFile, is_archive, load
from space.core.errors import InvalidArgument
from space.sdk.template_models import Template, build_spec, parse_env

template_app = typer.Typer(
    help="Templates of your project: build one from a built-in, another template or an OCI archive.",
    no_args_is_help=True,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
Many = Annotated[list[str] | None, typer.Option()]


def _files(pairs: list[str]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for pair in pairs:
        src, sep, dst = pair.rpartition(":")
        if not sep or not src or not dst:
            raise usage_error(f"--file expects SRC:DST, got {pair!r}")
        try:
            files[dst] = Path(src).read_bytes()
        except OSError as exc:
            raise usage_error(f"--file {src}: {exc.strerror or exc}") from exc
    return files


def _from_options(
    name: str | None, from_: str | None, *, files: list[str], apt: list[str], pip: list[str], run: list[str],
    env: list[str], workdir: str | None, user: str | None, start_cmd: str | None,
) -> TemplateFile:  # fmt: skip
    if name is None or from_ is None:
        raise usage_error("give NAME and --from (or -f space-template.toml)")
    try:
        spec = build_spec(
            from_, files=_files(files), apt=apt, pip=pip, env=parse_env(env), workdir=workdir, run=run,
            user=user, start_cmd=start_cmd,
        )  # fmt: skip
    except InvalidArgument as exc:
        raise usage_error(exc.message) from exc
    return TemplateFile(name, spec, Path(from_) if is_archive(from_) else None)


@template_app.command("build")
@handles_errors
def template_build(  # noqa: PLR0917 - typer options
    name: Annotated[
        str | None, typer.Argument(metavar="NAME", help="The template's name in your project.")
    ] = None,
    from_: Annotated[
        str | None,
        typer.Option("--from", help="python, base, one of your templates, or an OCI archive file."),
    ] = None,
    apt: Annotated[
        list[str] | None, typer.Option("--apt", metavar="PKG", help="Debian package (repeatable).")
    ] = None,
    pip: Annotated[
        list[str] | None, typer.Option("--pip", metavar="REQ", help="Python requirement (repeatable).")
    ] = None,
    file: Annotated[
        list[str] | None, typer.Option("--file", metavar="SRC:DST", help="Copy a local file in.")
    ] = None,
    run: Annotated[
        list[str] | None, typer.Option("--run", metavar="CMD", help="Shell command, in order.")
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", metavar="K=V", help="Environment of its sandboxes.")
    ] = None,
    workdir: Annotated[str | None, typer.Option("--workdir", metavar="PATH")] = None,
    user: Annotated[
        str | None, typer.Option("--user", metavar="NAME", help="Default user (created).")
    ] = None,
    start_cmd: Annotated[str | None, typer.Option("--start-cmd", metavar="CMD")] = None,
    spec_file: Annotated[
        Path | None, typer.Option("-f", "--file-spec", metavar="TOML", help="A space-template.toml to build.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Do not stream the build log.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Build a template (its steps run inside a sandbox, never on this machine) and wait for it."""
    if spec_file is not None:
        try:
            described = load(spec_file)
        except InvalidArgument as exc:
            raise usage_error(exc.message) from exc
    else:
        described = _from_options(
            name, from_, files=file or [], apt=apt or [], pip=pip or [], run=run or [], env=env or [],
            workdir=workdir, user=user, start_cmd=start_cmd,
        )  # fmt: skip
    console = stderr_console()

    def show(line: str) -> None:
        if not quiet:
            console.print(f"[dim]{escape(line)}[/dim]", highlight=False, soft_wrap=True)

    sp = client()
    if console.is_terminal:
        with console.status(f"building template {described.name}..."):
            ready = sp.templates.build(described.name, described.spec, source=described.archive, on_log=show)
    else:
        ready = sp.templates.build(described.name, described.spec, source=described.archive, on_log=show)
    if as_json:
        print_json(ready.data)
    else:
        typer.echo(ready.id)


def _row(t: Template) -> list[object]:
    return [t.id, t.name, t.status, t.data.get("source"), t.data.get("size_bytes")]


@template_app.command("list")
@handles_errors
def template_list(as_json: JsonFlag = False) -> None:
    """The built-in templates and your project's."""
    templates = client().templates.list()
    if as_json:
        print_json([t.data for t in templates])
        return
    table([_row(t) for t in templates], ["ID", "NAME", "STATUS", "SOURCE", "SIZE"])


@template_app.command("get")
@handles_errors
def template_get(
    template: Annotated[str, typer.Argument(metavar="NAME|ID")], as_json: JsonFlag = False
) -> None:
    """One template, by name or id."""
    found = client().templates.get(template)
    if as_json:
        print_json(found.data)
    else:
        fields({k: v for k, v in found.data.items() if k != "spec"})


@template_app.command("logs")
@handles_errors
def template_logs(
    template: Annotated[str, typer.Argument(metavar="NAME|ID")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Wait for the build's end.")] = False,
) -> None:
    """A template's build log (the newest 256 KiB are kept)."""
    for item in client().templates.logs(template, follow=follow):
        if "log" in item:
            typer.echo(str(item["log"]))


@template_app.command("delete")
@handles_errors
def template_delete(template: Annotated[str, typer.Argument(metavar="NAME|ID")]) -> None:
    """Delete a template (refused while sandboxes made from it exist)."""
    client().templates.delete(template)
