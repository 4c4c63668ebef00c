"""What the MCP tools answer, without a server: errors name their code and the state the lifecycle refused
in, output is cut to its head and tail with a note, listings are bounded."""

from __future__ import annotations

from space.core.errors import InvalidState, NotFound
from space.mcp import render
from space.sdk.models import ExecResult


def test_an_error_names_its_code_and_the_state_once() -> None:
    assert render.error_text(NotFound("sandbox sb-x not found")) == "not_found: sandbox sb-x not found"
    refused = InvalidState("the lifecycle does not allow pause", state="stopped", event="pause")
    assert (
        render.error_text(refused)
        == "invalid_state: the lifecycle does not allow pause (the sandbox is stopped)"
    )
    named = InvalidState("sandbox sb-x is 'paused', not running", state="paused")
    assert render.error_text(named) == "invalid_state: sandbox sb-x is 'paused', not running"


def test_long_output_keeps_its_head_and_tail() -> None:
    text = "".join(f"{i}\n" for i in range(100_000))
    cut = render.bounded(text)
    assert len(cut) < render.OUTPUT_CHARS + 200
    assert cut.startswith("0\n1\n2\n") and cut.endswith("99998\n99999\n")
    assert f"{len(text) - render.OUTPUT_CHARS} characters cut here" in cut
    assert render.bounded("short") == "short"


def test_a_command_result_says_how_it_ended() -> None:
    assert render.exec_text(ExecResult(exit_code=0)) == "exit code 0\n(no output)"
    assert render.exec_text(ExecResult(exit_code=None, timed_out=True, stdout_bytes=b"x")) == (
        "timed out (killed)\n--- stdout ---\nx"
    )
    assert (
        render.exec_text(ExecResult(exit_code=None, signal="SIGKILL"))
        == "killed by signal SIGKILL\n(no output)"
    )
    truncated = ExecResult(exit_code=1, stderr_bytes=b"e", stderr_truncated=True)
    assert (
        render.exec_text(truncated) == "exit code 1\n--- stderr (the server kept only its first part) ---\ne"
    )


def test_listings_are_bounded() -> None:
    many = [{"id": f"sb-{i}", "state": "running", "template": "python"} for i in range(render.LIST_LINES + 5)]
    text = render.sandbox_lines(many).splitlines()
    assert text[0] == f"{render.LIST_LINES + 5} sandbox(es):"
    assert len(text) == render.LIST_LINES + 2 and text[-1] == "... and 5 more"
    assert render.sandbox_lines([]) == "No sandboxes."
    files = render.file_lines(
        ".",
        [
            {"name": "d", "type": "dir", "size": 4096},
            {"name": "l", "type": "symlink", "size": 3, "target": "/x"},
        ],
    )
    assert files.splitlines()[1:] == ["dir             4096  d/", "symlink            3  l -> /x"]
    assert render.size_text(262_144) == "256.0 KiB" and render.size_text(12) == "12 bytes"
