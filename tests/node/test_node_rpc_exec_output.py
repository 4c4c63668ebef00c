"""Output caps of the non-streamed exec route: bounded answers with explicit truncation flags.

The fake driver runs the real `spaced` as a host subprocess, so the output really crosses the channel; the
same cap through a real gVisor sandbox is in tests/guest/test_hostile_guest.py.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator

import httpx
import pytest

from space.core.ids import new_sandbox_id
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.agent.rpc_models import EXEC_OUTPUT_DEFAULT, EXEC_OUTPUT_MAX
from space.node.drivers.fake import FakeDriver
from space.node.rpc_client import NodeClient
from space.sdk.models import ExecResult
from tests.support.loop import BackgroundLoop
from tests.support.node_capability import NodeAuth
from tests.support.node_rpc import TOKEN, serve_in
from tests.support.sandboxes import reset_vm_hwm, vm_hwm_kib

FLOOD = "python3 -c \"import sys; sys.stdout.write('x' * 50_000_000); sys.stderr.write('tail')\""


@pytest.fixture(scope="module")
def node_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, str]]:
    loop = BackgroundLoop()
    agent = NodeAgent(FakeDriver(tmp_path_factory.mktemp("node")))
    loop.run(agent.prepare())
    server, future, url = serve_in(loop, create_app(agent, TOKEN))

    async def make_client() -> NodeClient:
        return NodeClient(url, TOKEN)

    client = loop.run(make_client())
    sandbox_id = new_sandbox_id()
    loop.run(client.create_sandbox(sandbox_id))
    http = httpx.Client(base_url=url, auth=NodeAuth(TOKEN), timeout=120)
    try:
        yield http, sandbox_id
    finally:
        http.close()
        loop.run(client.aclose())
        server.should_exit = True
        future.result(15)
        loop.run(agent.delete_all())
        loop.run(agent.close())
        loop.close()


def _exec(node_http: tuple[httpx.Client, str], **body: object) -> httpx.Response:
    http, sandbox_id = node_http
    return http.post(f"/node/v1/sandboxes/{sandbox_id}/exec", json=body)


def test_fifty_megabytes_of_output_come_back_capped_and_flagged(node_http: tuple[httpx.Client, str]) -> None:
    reset_vm_hwm()
    before = vm_hwm_kib()
    started = time.monotonic()
    response = _exec(node_http, cmd=FLOOD)
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["exit_code"] == 0
    assert len(base64.b64decode(answer["stdout_b64"])) == EXEC_OUTPUT_DEFAULT
    assert (answer["stdout_truncated"], answer["stderr_truncated"]) == (True, False)
    assert base64.b64decode(answer["stderr_b64"]) == b"tail"
    growth_mib = (vm_hwm_kib() - before) / 1024
    # The answer itself is ~1 MiB twice (base64 and text) plus JSON; 50 MB collected would be far above.
    assert growth_mib < 40, f"the agent's peak RSS grew by {growth_mib:.0f} MiB for a capped exec"
    assert elapsed < 30, f"a capped 50 MB exec took {elapsed:.1f}s"
    # the SDK reads the flags
    result = ExecResult.from_wire(answer)
    assert result.truncated and result.stdout_truncated and not result.stderr_truncated


def test_the_cap_is_per_request_up_to_a_hard_maximum(node_http: tuple[httpx.Client, str]) -> None:
    small = _exec(node_http, cmd="head -c 5000 /dev/zero; head -c 10 /dev/zero >&2", max_output_bytes=1000)
    answer = small.json()
    assert len(base64.b64decode(answer["stdout_b64"])) == 1000 and answer["stdout_truncated"] is True
    assert len(base64.b64decode(answer["stderr_b64"])) == 10 and answer["stderr_truncated"] is False

    exact = _exec(node_http, cmd="head -c 1000 /dev/zero", max_output_bytes=1000).json()
    assert len(base64.b64decode(exact["stdout_b64"])) == 1000 and exact["stdout_truncated"] is False

    for bad in (EXEC_OUTPUT_MAX + 1, -1, "1000", 1.5):
        refused = _exec(node_http, cmd="true", max_output_bytes=bad)
        assert refused.status_code in (400, 422), (bad, refused.status_code)
        assert "max_output_bytes" in refused.json()["error"]["details"]["fields"], refused.text
