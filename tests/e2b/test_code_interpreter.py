"""The code interpreter (ADR 0058) end to end: E2B's `e2b_code_interpreter.Sandbox` (the PyPI package,
unchanged) and SPACE's own `run_code`, against a real installation and a real runsc sandbox that carries the
`code-interpreter` template's spec (tests/support/code_interpreter.py says why the spec is applied to a `base`
sandbox here rather than built by the node: the build's package sources are off the machine).

The SDK's documented usage: a print, an expression's result, an exception, a matplotlib PNG, a pandas
frame's HTML, state kept between cells, a context created/used/restarted/removed, env vars for one run, a
timeout that interrupts the kernel. Attacks: another tenant's sandbox and another sandbox's token, hostile
context ids, an output flood (cut at the bound, the kernel and its state kept), and a never-ending cell
whose client goes away (the kernel is interrupted, the bridge does not linger)."""

from __future__ import annotations

import base64
import json
import secrets
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import Sandbox as CodeSandbox

from space.controlplane.code_runs import MAX_OUTPUT_BYTES
from space.node.code_interpreter.spec import BRIDGE_PATH
from space.sdk import Sandbox
from tests.support.cluster import RealCluster, real_cluster  # noqa: F401 - module-bound session fixture
from tests.support.code_interpreter import apply_spec

pytestmark = pytest.mark.root
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def prepared(real_cluster: RealCluster) -> Iterator[Sandbox]:  # noqa: F811
    sb = real_cluster.sdk().sandboxes.create(template="base")
    try:
        apply_spec(sb)
        yield sb
    finally:
        sb.delete()


@pytest.fixture(scope="module")
def sbx(real_cluster: RealCluster, prepared: Sandbox) -> CodeSandbox:  # noqa: F811
    return CodeSandbox.connect(
        prepared.id, api_key=real_cluster.api_key, api_url=real_cluster.e2b_api_url,
        sandbox_url=real_cluster.e2b_sandbox_url, domain="space.invalid",
    )  # fmt: skip


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_print_result_error_and_state(sbx: CodeSandbox) -> None:
    seen: list[str] = []
    ex = sbx.run_code("x = 41\nprint('hello')\nx + 1", on_stdout=lambda m: seen.append(m.line))
    assert ex.logs.stdout == ["hello\n"] and seen == ["hello\n"] and ex.error is None
    assert ex.text == "42" and ex.results[0].is_main_result and ex.execution_count is not None
    assert sbx.run_code("x * 2").text == "82"  # the kernel keeps its state between cells
    failed = sbx.run_code("import sys; print('to err', file=sys.stderr)\n1 / 0")
    assert failed.logs.stderr == ["to err\n"]
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert failed.error.value == "division by zero" and "ZeroDivisionError" in failed.error.traceback


def test_matplotlib_png_and_pandas_html(sbx: CodeSandbox) -> None:
    ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()")
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1 and not ex.results[0].is_main_result
    width, height = _png_size(base64.b64decode(pngs[0]))
    assert width > 100 and height > 100
    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    assert frame.error is None and frame.results[0].html is not None
    assert "<table" in frame.results[0].html and "a  b" in (frame.text or "")


def test_contexts(sbx: CodeSandbox) -> None:
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    assert ctx.id in [found.id for found in sbx.list_code_contexts()]
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
    sbx.run_code("y = 'in ctx'", context=ctx)
    assert sbx.run_code("y", context=ctx).text == "'in ctx'"
    elsewhere = sbx.run_code("y")  # the default context is another kernel
    assert elsewhere.error is not None and elsewhere.error.name == "NameError"
    sbx.restart_code_context(ctx)
    restarted = sbx.run_code("y", context=ctx)
    assert restarted.error is not None and restarted.error.name == "NameError"
    sbx.remove_code_context(ctx)
    assert ctx.id not in [found.id for found in sbx.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)
    with pytest.raises(SandboxException):
        sbx.run_code("1", language="r")


def test_env_vars_for_one_run(sbx: CodeSandbox) -> None:
    code = "import os; os.environ.get('SPACE_CI_VAR')"
    assert sbx.run_code(code, envs={"SPACE_CI_VAR": "per-run"}).text == "'per-run'"
    assert sbx.run_code(code).text is None  # None shows nothing: the variable is gone again


def test_timeout_interrupts_the_kernel(sbx: CodeSandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\nwhile True: time.sleep(0.05)", timeout=3)
    # The kernel was interrupted when the client gave up: the next cell runs (a busy kernel would queue it
    # behind the endless one, and this call would never return).
    assert sbx.run_code("'free'").text == "'free'"


def test_space_run_code(prepared: Sandbox) -> None:
    ex = prepared.run_code("print('space')\n6 * 7")
    assert ex.stdout == ["space\n"] and ex.text == "42" and ex.error is None and ex.finished
    timed = prepared.run_code("import time\ntime.sleep(60)", timeout=2)
    assert timed.timed_out and timed.error is not None and timed.error.name == "KeyboardInterrupt"
    raised = prepared.run_code("raise ValueError('nope')")
    assert raised.error is not None and (raised.error.name, raised.error.value) == ("ValueError", "nope")


def test_run_code_needs_the_code_interpreter(real_cluster: RealCluster) -> None:  # noqa: F811
    sb = real_cluster.sdk().sandboxes.create(template="python")
    try:
        answer = httpx.post(
            f"{real_cluster.url}/v1/sandboxes/{sb.id}/code", json={"code": "1"},
            headers={"Authorization": f"Bearer {real_cluster.api_key}"}, timeout=120,
        )  # fmt: skip
        assert answer.status_code == 409 and "code-interpreter" in answer.json()["error"]["message"], (
            answer.text
        )
    finally:
        sb.delete()


# -- attacks -------------------------------------------------------------------------------------------------
def _jupyter(real_cluster: RealCluster, sandbox_id: str, headers: dict[str, str]) -> httpx.Client:  # noqa: F811
    base = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49999"}
    return httpx.Client(base_url=real_cluster.e2b_sandbox_url, headers=base | headers, timeout=120)


def test_other_tenants_and_tokens(real_cluster: RealCluster, prepared: Sandbox) -> None:  # noqa: F811
    elsewhere = f"ci-other-{secrets.token_hex(4)}"
    space = real_cluster.sdk()
    space.projects.create(elsewhere)
    neighbour = space.sandboxes.create(template="python")
    try:
        token = CodeSandbox.connect(
            neighbour.id, api_key=real_cluster.api_key, api_url=real_cluster.e2b_api_url,
            sandbox_url=real_cluster.e2b_sandbox_url, domain="space.invalid",
        )._envd_access_token  # fmt: skip
        assert token
        attempts = (
            {"X-Access-Token": token},  # another sandbox's token
            {"E2B-Traffic-Access-Token": token},
            {
                "X-API-Key": real_cluster.api_key,
                "X-Space-Project": elsewhere,
            },  # a key acting in another project
            {},
        )
        for headers in attempts:
            with _jupyter(real_cluster, prepared.id, headers) as client:
                execute = client.post("/execute", json={"code": "open('/tmp/pwned', 'w')"})
                contexts = client.get("/contexts")
                made = client.post("/contexts", json={})
            for answer in (execute, contexts, made):
                assert answer.status_code in (401, 404), (headers.keys(), answer.status_code, answer.text)
        other_project = httpx.post(
            f"{real_cluster.url}/v1/sandboxes/{prepared.id}/code", json={"code": "open('/tmp/pwned', 'w')"},
            headers={"Authorization": f"Bearer {real_cluster.api_key}", "X-Space-Project": elsewhere},
            timeout=120,
        )  # fmt: skip
        assert other_project.status_code == 404, other_project.text
        assert prepared.exec("test -e /tmp/pwned", timeout=30).exit_code != 0
    finally:
        neighbour.delete()
        space.close()


def test_hostile_context_ids(real_cluster: RealCluster, prepared: Sandbox, sbx: CodeSandbox) -> None:  # noqa: F811
    token = sbx._envd_access_token
    assert token is not None
    with _jupyter(real_cluster, prepared.id, {"X-Access-Token": token}) as client:
        for hostile in ("../../etc", "..", "a/../../b", "x" * 65, "-rf", "a b", "ünï", "default\n"):
            answer = client.post("/execute", json={"code": "1", "context_id": hostile})
            assert answer.status_code == 400, (hostile, answer.status_code, answer.text)
        for path in ("/contexts/..%2F..%2Fvar", "/contexts/%2e%2e", "/contexts/a%00b"):
            assert client.delete(path).status_code in (400, 404), path
            assert client.post(path + "/restart").status_code in (400, 404), path
        assert client.post("/execute", json={"code": "1", "context_id": "no-such-context"}).status_code == 404
        assert client.post("/execute", json={"code": 1}).status_code == 400
        assert client.post("/execute", content=b"{not json").status_code == 400
        both = client.post("/execute", json={"code": "1", "context_id": "default", "language": "python"})
        assert both.status_code == 400
    assert prepared.exec(["test", "-d", "/var/lib/space-code/default"], timeout=30).exit_code == 0


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.strip():
            yield json.loads(line)


def test_client_gone_interrupts_the_cell(
    real_cluster: RealCluster,  # noqa: F811
    prepared: Sandbox,
    sbx: CodeSandbox,
) -> None:
    token = sbx._envd_access_token
    assert token is not None
    marker = f"/tmp/still-running-{time.monotonic_ns()}"
    code = f"import time\nwhile True:\n    open({marker!r}, 'w').write(str(time.time()))\n    time.sleep(0.2)"
    client = _jupyter(real_cluster, prepared.id, {"X-Access-Token": token})
    with client, client.stream("POST", "/execute", json={"code": code}) as response:
        assert response.status_code == 200
        for event in _events(response):
            if event["type"] == "number_of_executions":
                break  # the cell runs; the client goes away now
    time.sleep(1)
    # The cell was interrupted: the kernel runs the next one, and the marker stops changing.
    assert sbx.run_code("'next'").text == "'next'"
    first = prepared.files.read(marker)
    time.sleep(1.5)
    assert prepared.files.read(marker) == first
    running = [p.data for p in prepared.processes.list() if p.running]
    assert [p for p in running if BRIDGE_PATH in str(p) and "execute" in str(p)] == []


# Last in the module: should the flood still take the sandbox down, the module's other tests keep theirs.
def test_output_flood_is_bounded(real_cluster: RealCluster, prepared: Sandbox) -> None:  # noqa: F811
    # Issue 13: ipykernel sent what a tight print loop wrote between its flushes as one message, the sandbox
    # ran out of memory and its channel closed. The kernel's streams are bounded now (kernel_launcher).
    assert prepared.run_code("before_the_flood = 'kept'").error is None
    received = 0
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", f"{real_cluster.url}/v1/sandboxes/{prepared.id}/code",
        json={"code": "while True:\n    print('x' * 65536)"},
        headers={"Authorization": f"Bearer {real_cluster.api_key}"}, timeout=600,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        for event in _events(response):
            received += len(event.get("text", ""))
            if event["type"] != "stdout":
                events.append(event)
    assert [e["type"] for e in events][-2:] == ["exception", "end_of_execution"], events
    assert events[-2]["name"] == "OutputLimitExceeded", events
    assert 0 < received <= MAX_OUTPUT_BYTES  # the flood was shown up to the bound, not dropped whole
    # The same kernel (its state is there), interrupted, answers again: neither it nor the sandbox was lost.
    assert prepared.run_code("before_the_flood").text == "'kept'"
    # And it did not keep the flood: IPython kept every cell's output for the kernel's life, so each flood
    # (each long log) stayed in the sandbox's memory (kernel_launcher.forget_outputs).
    kept = prepared.run_code("sum(map(len, get_ipython().history_manager.outputs.values()))")
    assert kept.text == "0", kept
