"""The exec output cap end to end: the gateway validates and forwards `max_output_bytes`, and the answer's
truncation flags reach the SDK's ExecResult."""

from __future__ import annotations

import base64

from space.node.agent.rpc_models import EXEC_OUTPUT_DEFAULT, EXEC_OUTPUT_MAX
from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project

FLOOD = "python3 -c \"import sys; sys.stdout.write('x' * 5_000_000); sys.stderr.write('e' * 10)\""


def test_exec_output_is_capped_and_flagged_through_the_gateway(
    fake_cluster: c.Cluster, project: c.Project
) -> None:
    client = project.http()
    created = client.post("/v1/sandboxes", json={"template": "python", "limits": c.SMALL})
    assert created.status_code == 201, created.text
    exec_path = f"/v1/sandboxes/{created.json()['id']}/exec"

    answer = client.post(exec_path, json={"cmd": FLOOD}, timeout=120).json()
    assert len(base64.b64decode(answer["stdout_b64"])) == EXEC_OUTPUT_DEFAULT
    assert (answer["stdout_truncated"], answer["stderr_truncated"]) == (True, False)

    asked = client.post(exec_path, json={"cmd": FLOOD, "max_output_bytes": 5}, timeout=120).json()
    assert base64.b64decode(asked["stdout_b64"]) == b"xxxxx" and asked["stdout_truncated"] is True
    assert base64.b64decode(asked["stderr_b64"]) == b"eeeee" and asked["stderr_truncated"] is True

    refused = client.post(exec_path, json={"cmd": "true", "max_output_bytes": EXEC_OUTPUT_MAX + 1})
    assert refused.status_code in (400, 422), refused.text

    with project.sdk() as sp:
        result = sp.sandboxes.get(created.json()["id"]).exec(FLOOD)
        assert result.truncated and result.stdout_truncated and not result.stderr_truncated
        assert len(result.stdout_bytes) == EXEC_OUTPUT_DEFAULT and result.stderr == "e" * 10
