"""`space exec ...` and `space files ...`: the data plane, streamed both ways."""

import contextlib
import signal as signal_module
from typing import Annotated, Any

import typer

from space.cli._common import (
    EXIT_USAGE,
    binary_stream,
    client,
    handles_errors,
    parse_pairs,
    print_json,
    table,
)
from space.core.errors import SpaceError
from space.sdk import ExecResult

files_app = typer.Typer(help="Read, write and list files in a sandbox.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
SandboxId = Annotated[str, typer.Argument(metavar="ID", help="The sandbox id (sb-…).")]
PathArg = Annotated[str, typer.Argument(metavar="PATH", help="Absolute path inside the sandbox.")]

EXIT_TIMED_OUT = 124


def command_exit_code(result: ExecResult) -> int:
    """The exit code a shell would give: the command's own, 124 for a timeout, 128+N for signal N."""
    if result.exit_code is not None:
        return result.exit_code
    if result.timed_out:
        return EXIT_TIMED_OUT
    sig = result.signal
    if isinstance(sig, int):
        return 128 + sig
    if isinstance(sig, str):
        name = sig.upper() if sig.upper().startswith("SIG") else f"SIG{sig.upper()}"
        try:
            return 128 + int(signal_module.Signals[name])
        except KeyError:
            pass
    return 1


@handles_errors
def exec_command(  # noqa: PLR0917
    sandbox_id: SandboxId,
    cmd: Annotated[
        list[str], typer.Argument(metavar="-- CMD [ARG...]", help="The command and its arguments.")
    ],
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", metavar="K=V", help="Environment variable (repeat).")
    ] = None,
    cwd: Annotated[str | None, typer.Option("--cwd", help="Working directory.")] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Run as this user.")] = None,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Kill the command after N seconds.")
    ] = None,
    stdin: Annotated[
        bool, typer.Option("--stdin", "-i", help="Send this process's stdin to the command.")
    ] = False,
) -> None:
    """Run a command in a sandbox, streaming its stdout/stderr; exits with the command's exit code."""
    if cmd and cmd[0] == "--":
        # options stop at the sandbox id (so `space exec ID ls -la` works); the `--` after it is ours
        cmd = cmd[1:]
    if not cmd:
        typer.echo("error: no command given (space exec ID -- CMD [ARG...])", err=True)
        raise typer.Exit(EXIT_USAGE)
    env_vars = parse_pairs(env, "--env")
    data = binary_stream("stdin").read() if stdin else None
    out = binary_stream("stdout")
    err = binary_stream("stderr")
    started: list[str] = []

    def write(stream: Any, chunk: bytes) -> None:
        stream.write(chunk)
        stream.flush()

    sb = client().sandboxes.ref(sandbox_id)
    try:
        result = sb.exec_stream(
            cmd,
            env=env_vars,
            cwd=cwd,
            user=user,
            timeout=timeout,
            stdin=data,
            on_stdout=lambda chunk: write(out, chunk),
            on_stderr=lambda chunk: write(err, chunk),
            on_started=started.append,
        )
    except KeyboardInterrupt:
        if started:
            with contextlib.suppress(SpaceError):
                sb.processes.signal(started[0], "SIGINT")
        raise typer.Exit(130) from None
    raise typer.Exit(command_exit_code(result))


@files_app.command("write")
@handles_errors
def files_write(
    sandbox_id: SandboxId,
    path: PathArg,
    mode: Annotated[str | None, typer.Option("--mode", help="File mode in octal, e.g. 0644.")] = None,
    user: Annotated[
        str | None,
        typer.Option("--user", help="Who a new file belongs to (default: the template's user)."),
    ] = None,
) -> None:
    """Write stdin to a file in the sandbox (streamed): space files write ID PATH < data."""
    file_mode: int | None = None
    if mode is not None:
        try:
            file_mode = int(mode, 8)
        except ValueError:
            raise typer.BadParameter(f"not an octal mode: {mode!r}", param_hint="--mode") from None
    client().sandboxes.ref(sandbox_id).files.write(path, binary_stream("stdin"), mode=file_mode, user=user)


@files_app.command("read")
@handles_errors
def files_read(sandbox_id: SandboxId, path: PathArg) -> None:
    """Write a file of the sandbox to stdout (streamed): space files read ID PATH > data."""
    out = binary_stream("stdout")
    for chunk in client().sandboxes.ref(sandbox_id).files.read_stream(path):
        out.write(chunk)
    out.flush()


@files_app.command("ls")
@handles_errors
def files_ls(
    sandbox_id: SandboxId, path: PathArg, as_json: JsonFlag = False,
    depth: Annotated[int, typer.Option("--depth", min=1, max=16, help="Levels to list (1-16).")] = 1,
    long: Annotated[bool, typer.Option("--long", "-l", help="Show permissions, owner and group.")] = False,
) -> None:  # fmt: skip
    """List a directory in the sandbox (with --depth, its subdirectories too: paths below PATH)."""
    entries = client().sandboxes.ref(sandbox_id).files.list(path, depth=depth)
    if as_json:
        print_json(entries)
        return
    rows = [_ls_row(entry, path, depth=depth, long=long) for entry in entries]
    extra = ["PERMISSIONS", "OWNER", "GROUP"] if long else []
    table(rows, ["TYPE", "MODE", *extra, "SIZE", "NAME"])
    if getattr(entries, "truncated", False):
        typer.echo("(listing truncated: more entries than the limit)", err=True)


def _ls_row(entry: dict[str, Any], base: str, *, depth: int, long: bool) -> list[Any]:
    mode = entry.get("mode")
    name = entry.get("name")
    if depth > 1 and isinstance(entry.get("path"), str):
        name = entry["path"].removeprefix(base.rstrip("/") + "/")
    if entry.get("target") is not None:
        name = f"{name} -> {entry['target']}"
    extra = [
        entry.get("permissions"),
        entry.get("owner") or entry.get("uid"),
        entry.get("group") or entry.get("gid"),
    ]
    return [
        entry.get("type"),
        oct(mode)[2:].rjust(4, "0") if isinstance(mode, int) else mode,
        *(extra if long else []),
        entry.get("size"),
        name,
    ]
