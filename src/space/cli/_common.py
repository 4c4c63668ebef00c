"""What every `space` command shares: the client, exit codes, error printing, JSON and progress output.

Exit codes scripts can rely on: 0 ok; 1 an API error (`error: <code>: <message>` on stderr); 2 a usage or
configuration error; 3 not found; 4 invalid state or conflict; 5 unauthenticated or permission denied;
6 unavailable (server unreachable, timeouts). `space exec` exits with the command's own exit code.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, Literal, ParamSpec, TypeVar, cast

import typer
from rich.console import Console

from space.core.errors import (
    AlreadyExists,
    Conflict,
    InvalidState,
    NotFound,
    PermissionDenied,
    SpaceError,
    Timeout,
    Unauthenticated,
    Unavailable,
)
from space.sdk import Space
from space.sdk.errors import ConfigurationError

EXIT_OK = 0
EXIT_API = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INVALID_STATE = 4
EXIT_AUTH = 5
EXIT_UNAVAILABLE = 6

P = ParamSpec("P")
R = TypeVar("R")


def _default_factory(url: str | None, api_key: str | None) -> Space:
    return Space(url=url, api_key=api_key)


class State:
    """Global options (`space --url U --api-key K ...`) and the client factory (tests replace it)."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.api_key: str | None = None
        self.factory: Callable[[str | None, str | None], Space] = _default_factory


state = State()


def client() -> Space:
    return state.factory(state.url, state.api_key)


def stderr_console() -> Console:
    return Console(stderr=True)


def exit_code_for(error: SpaceError) -> int:
    if isinstance(error, ConfigurationError):
        return EXIT_USAGE
    if isinstance(error, NotFound):
        return EXIT_NOT_FOUND
    if isinstance(error, InvalidState | Conflict | AlreadyExists):
        return EXIT_INVALID_STATE
    if isinstance(error, Unauthenticated | PermissionDenied):
        return EXIT_AUTH
    if isinstance(error, Unavailable | Timeout):
        return EXIT_UNAVAILABLE
    return EXIT_API


def fail(error: SpaceError) -> typer.Exit:
    """Print `error: <code>: <message>` on stderr; the Exit to raise."""
    typer.echo(f"error: {error.code}: {error.message}", err=True)
    return typer.Exit(exit_code_for(error))


def usage_error(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def handles_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn SpaceErrors into the documented exit codes (the command's signature is kept for typer)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except SpaceError as error:
            raise fail(error) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


@contextlib.contextmanager
def progress(message: str) -> Iterator[None]:
    """A spinner on stderr while waiting (only when stderr is a terminal)."""
    console = stderr_console()
    if not console.is_terminal:
        yield
        return
    with console.status(message):
        yield


def parse_pairs(pairs: Sequence[str] | None, option: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint=option)
        found[key] = value
    return found


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> None:
    """Plain aligned columns on stdout (no colours, nothing truncated: easy to grep and cut)."""
    text = [[_cell(value) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = [headers, *text]
    for line in lines:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())


def fields(data: Mapping[str, Any]) -> None:
    width = max((len(k) for k in data), default=0)
    for key, value in data.items():
        typer.echo(f"{key.ljust(width)}  {_cell(value)}")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def binary_stream(name: Literal["stdin", "stdout", "stderr"]) -> BinaryIO:
    """stdin, stdout or stderr as bytes."""
    stream = getattr(sys, name)
    return cast(BinaryIO, getattr(stream, "buffer", stream))
