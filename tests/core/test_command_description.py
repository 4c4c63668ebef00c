"""One command description (space.protocol.commands): the SDK, the gateway and node schema, and spaced."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from space.guest.channel import GuestError
from space.guest.launch import parse_launch
from space.node.agent import rpc_models as rm
from space.protocol import commands
from space.sdk.models import exec_body, process_body

CASES = [
    {"cmd": "echo hi", "env": {"A": "1"}, "cwd": "/tmp", "user": "root", "timeout": 5.0},
    {"argv": ["ls", "-l"], "timeout": 0.5},
    {"argv": ["true"], "user": 0},
]


@pytest.mark.parametrize("fields", CASES, ids=["cmd", "argv", "uid"])
def test_the_sdk_body_the_http_schema_and_the_guest_params_agree(fields: dict[str, object]) -> None:
    command = fields.get("cmd") or fields["argv"]
    extra = {k: fields.get(k) for k in ("env", "cwd", "user", "timeout")}
    expected = commands.command_params(command, **extra)  # type: ignore[arg-type]
    body = exec_body(command, stdin=None, stream=False, **extra)  # type: ignore[arg-type]
    assert rm.ExecRequest.model_validate(body).params() == expected
    started = process_body(command, tag=None, pty=None, **extra)  # type: ignore[arg-type]
    assert rm.ProcessStartRequest.model_validate(started).params() == expected
    launch = parse_launch(expected, {"PATH": "/bin"})
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else command
    assert launch.argv == argv and launch.timeout == fields.get("timeout")


def test_the_http_schema_has_exactly_the_fields_of_the_description() -> None:
    assert set(rm.CommandBody.model_fields) == set(commands.FIELDS)


@pytest.mark.parametrize("params", [{}, {"cmd": "x", "argv": ["x"]}])
def test_every_end_refuses_zero_or_two_commands(params: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        rm.ExecRequest.model_validate(params)
    with pytest.raises(GuestError, match="exactly one"):
        parse_launch(params, {})


def test_absent_fields_are_omitted_not_null() -> None:
    assert commands.command_params(["true"]) == {"argv": ["true"]}
    assert commands.command_params("true", env={}, cwd=None) == {"cmd": "true"}
