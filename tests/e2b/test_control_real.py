"""E2B's SDK, unchanged, against the front a real installation serves (the shared `real_cluster` serves it as
`space up` does) on real runsc sandboxes, with only E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set: create
(v2), commands through E2B_SANDBOX_URL, get_info, list by metadata, set_timeout, pause and connect (the
files and the processes' memory kept), metrics, a snapshot used as a template, fork (writes isolated), the
filesystem-only pause (a cold boot with the disk kept), kill."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import e2b
import pytest

from tests.support import cluster as c
from tests.support.cluster import real_cluster  # noqa: F401 - module-bound session fixture

pytestmark = pytest.mark.root


@pytest.fixture
def e2b_env(real_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:  # noqa: F811
    monkeypatch.setenv("E2B_API_KEY", real_cluster.api_key)
    monkeypatch.setenv("E2B_API_URL", real_cluster.e2b_api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", real_cluster.e2b_sandbox_url)
    monkeypatch.setenv("E2B_DOMAIN", "space.invalid")
    made: list[str] = []
    yield None
    for sandbox in e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "e2b-real"})).next_items():
        made.append(sandbox.sandbox_id)
        e2b.Sandbox.kill(sandbox.sandbox_id)


def test_e2b_sdk_on_real_sandboxes(e2b_env: None) -> None:
    tag = secrets.token_hex(4)
    sbx = e2b.Sandbox.create(metadata={"suite": "e2b-real", "tag": tag}, timeout=600)
    assert sbx.commands.run("echo hello from $(uname -s)").stdout == "hello from Linux\n"
    info = sbx.get_info()
    assert info.state.value == "running" and info.metadata == {"suite": "e2b-real", "tag": tag}
    found = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"tag": tag})).next_items()
    assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
    sbx.set_timeout(1200)
    assert 1100 < (sbx.get_info().end_at - info.end_at).total_seconds() + 600 < 1300
    # Memory survives a pause: a shell variable of a background process is still there after connect.
    sbx.commands.run("echo kept > /tmp/file; sleep 3600 & echo $! > /tmp/pid")
    assert sbx.pause() is True
    assert sbx.get_info().state.value == "paused"
    back = e2b.Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert back.get_info().state.value == "running"
    pid = back.commands.run("cat /tmp/pid").stdout.strip()
    assert back.commands.run(f"kill -0 {pid} && cat /tmp/file").stdout == "kept\n"
    samples = c.wait_for(back.get_metrics, timeout=60, interval=1.0, what="metrics of a real sandbox")
    assert samples[-1].mem_used > 0 and samples[-1].mem_total >= samples[-1].mem_used
    # A snapshot is a template: a new sandbox starts from it with the source's files.
    snapshot = back.create_snapshot()
    child = e2b.Sandbox.create(template=snapshot.snapshot_id, metadata={"suite": "e2b-real"})
    assert child.commands.run("cat /tmp/file").stdout == "kept\n"
    assert e2b.Sandbox.kill(child.sandbox_id) is True
    assert e2b.Sandbox.delete_snapshot(snapshot.snapshot_id) is True
    # A fork has the parent's files; its writes are its own, and the parent keeps running.
    (fork,) = back.fork(timeout=600)
    assert isinstance(fork, e2b.Sandbox)
    fork.commands.run("echo forked > /tmp/file")
    assert back.commands.run("cat /tmp/file").stdout == "kept\n"
    assert fork.commands.run("cat /tmp/file").stdout == "forked\n"
    assert fork.kill() is True
    # E2B's filesystem-only pause cold-boots on connect: the disk stays (/tmp is memory), processes do not.
    back.commands.run("echo on-disk > /work/e2b-kept")
    assert back.pause(mode="filesystem") is True
    back = e2b.Sandbox.connect(back.sandbox_id, timeout=600)
    assert back.commands.run(f"cat /work/e2b-kept; kill -0 {pid} || echo gone").stdout == "on-disk\ngone\n"
    assert back.kill() is True
    with pytest.raises(e2b.SandboxNotFoundException):
        back.get_info()
