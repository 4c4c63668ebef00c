"""The agent's translation of the daemon's error codes at the channel boundary: every code the protocol
defines becomes a typed SPACE error, and the two that once fell through to a 502 (`not_supported`,
`not_a_terminal`) are the caller's 400 and a 409 naming the state."""

from __future__ import annotations

from space.core import errors
from space.node.agent.channel_call import guest_error
from space.protocol.methods import GUEST_ERROR_CODES
from space.rest.errors import status_for


def test_not_supported_and_not_a_terminal_are_typed() -> None:
    unsupported = guest_error({"code": "not_supported", "message": "no user attributes here"})
    assert isinstance(unsupported, errors.InvalidArgument) and status_for(unsupported) == 400
    assert unsupported.details == {"guest_code": "not_supported", "reason": "not_supported"}
    no_tty = guest_error({"code": "not_a_terminal", "message": "the process was started without a PTY"})
    assert isinstance(no_tty, errors.InvalidState) and status_for(no_tty) == 409
    assert no_tty.state == "no_terminal" and no_tty.details["guest_code"] == "not_a_terminal"
    assert no_tty.message == "the process was started without a PTY"


def test_only_failures_of_the_sandbox_itself_stay_bad_gateway() -> None:
    gateway = {
        code for code in GUEST_ERROR_CODES
        if status_for(guest_error({"code": code, "message": "m"})) in (500, 502)
    }  # fmt: skip
    # A daemon's own failure, a cancelled call and broken frames are the sandbox's side: 502. Nothing
    # else a caller could have avoided may land there.
    assert gateway == {
        "internal", "cancelled", "protocol_error", "corrupt_frame", "truncated_frame", "frame_too_large",
        "unknown_frame_type", "malformed_payload", "version_mismatch",
    }  # fmt: skip
    unknown = guest_error({"code": "from_a_newer_daemon", "message": "m"})
    assert isinstance(unknown, errors.GuestError) and unknown.guest_code == "from_a_newer_daemon"
