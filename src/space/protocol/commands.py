"""The one description of a command to run in a sandbox, as it crosses every boundary (standard library only).

The SDK's request bodies, the gateway's and the node RPC's bodies (pydantic models whose fields are these),
and spaced's `process.start` params all describe a command with the same fields, built here:

- exactly one of `cmd` (a shell command line, run as `/bin/sh -c cmd`) or `argv` (a non-empty list);
- `env` (added over the sandbox's environment), `cwd`, `user` (a name or a uid) and `timeout` (seconds, > 0).

Invariant: absent fields are omitted, never sent as null, so each receiver applies its own defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CMD = "cmd"
ARGV = "argv"
ENV = "env"
CWD = "cwd"
USER = "user"
TIMEOUT = "timeout"
#: Every field of a command description, in the order receivers check them.
FIELDS = (CMD, ARGV, ENV, CWD, USER, TIMEOUT)
ONE_COMMAND = f"give exactly one of '{CMD}' (a shell command) or '{ARGV}' (a list)"


def command_params(
    command: str | Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | int | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """The wire form of a command: `cmd` for a string, `argv` for a sequence, then the optional fields."""
    params: dict[str, Any] = {CMD: command} if isinstance(command, str) else {ARGV: list(command)}
    if env:
        params[ENV] = dict(env)
    optional = {CWD: cwd, USER: user, TIMEOUT: timeout}
    params.update({name: value for name, value in optional.items() if value is not None})
    return params
