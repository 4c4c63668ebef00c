"""Attacks on E2B's in-sandbox front: credentials and other tenants, malformed Connect requests, oversized
and endless bodies, gzip bombs, path traversal in /files, and a client that stops reading a stream."""

from __future__ import annotations

import base64
import gzip
import json
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as fpb
from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from space.core.ids import new_sandbox_id
from space.sdk import Sandbox
from tests.support import envd_front as ef
from tests.support.cluster import RealCluster, real_cluster  # noqa: F401 - module-bound session fixture

envd_front = ef.envd_front

pytestmark = pytest.mark.root

UNARY = "/filesystem.Filesystem/Stat"
STREAM = "/process.Process/Start"


@pytest.fixture(scope="module")
def other_keys(real_cluster: RealCluster) -> dict[str, str]:  # noqa: F811
    """Keys of another project (member and read-only) and a read-only key of the sandbox's own project."""
    admin = httpx.Client(
        base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}
    )
    with admin:
        name = f"other-{secrets.token_hex(4)}"
        assert admin.post("/v1/projects", json={"name": name}).status_code == 201

        def key(project: str, role: str) -> str:
            answer = admin.post("/v1/keys", json={"project": project, "role": role})
            assert answer.status_code == 201, answer.text
            return str(answer.json()["key"])

        return {"other": key(name, "member"), "readonly": key("default", "read-only")}


def _stat(front: ef.EnvdFront, sandbox_id: str, **kw: Any) -> None:
    front.filesystem(sandbox_id, **kw).stat(fpb.StatRequest(path="/etc/hostname"))


def _code(call: Any) -> Code:
    with pytest.raises(ConnectError) as caught:
        call()
    return caught.value.code


def test_credentials_and_other_tenants(
    envd_front: ef.EnvdFront,
    sandbox: Sandbox,
    other_keys: dict[str, str],
    real_cluster: RealCluster,  # noqa: F811
) -> None:
    front = envd_front
    _stat(front, sandbox.id)  # the sandbox's own envd token
    _stat(front, sandbox.id, api_key=real_cluster.api_key)  # a SPACE key of its project, as X-API-Key
    assert _code(lambda: _stat(front, sandbox.id, token="")) == Code.UNAUTHENTICATED  # nothing
    assert _code(lambda: _stat(front, sandbox.id, token="e2b_" + "0" * 40)) == Code.UNAUTHENTICATED
    assert _code(lambda: _stat(front, sandbox.id, api_key="space_nope")) == Code.UNAUTHENTICATED
    # Another project's key: its sandbox does not exist for it.
    assert _code(lambda: _stat(front, sandbox.id, api_key=other_keys["other"])) == Code.NOT_FOUND
    # This sandbox's token for another sandbox id is no credential at all.
    other_id = new_sandbox_id()
    assert _code(lambda: _stat(front, other_id, token=front.token(sandbox.id))) == Code.UNAUTHENTICATED
    # A read-only key reads but does not run or change anything.
    _stat(front, sandbox.id, api_key=other_keys["readonly"])
    start = pb.StartRequest(process=pb.ProcessConfig(cmd="/bin/true"), stdin=False)
    readonly = front.process(sandbox.id, api_key=other_keys["readonly"])
    assert _code(lambda: list(readonly.start(start))) == Code.PERMISSION_DENIED
    remove = fpb.RemoveRequest(path="/etc/hostname")
    assert _code(lambda: front.filesystem(sandbox.id, api_key=other_keys["readonly"]).remove(remove)) == (
        Code.PERMISSION_DENIED
    )
    with front.http() as http:
        assert http.get("/health", headers=front.headers(sandbox.id)).status_code == 401
        other = http.get("/health", headers=front.headers(sandbox.id, api_key=other_keys["other"]))
        assert other.status_code == 502  # the same answer as for a sandbox that is not there
        answer = http.get(
            "/files",
            params={"path": "/etc/hostname"},
            headers=front.headers(sandbox.id, api_key=other_keys["other"]),
        )
        assert answer.status_code == 404 and answer.json()["code"] == 404
        bad_id = http.get("/files", params={"path": "/x"}, headers={"E2b-Sandbox-Id": "../../v1/keys"})
        assert bad_id.status_code == 400
        no_id = http.post(UNARY, json={"path": "/"}, headers={"X-Access-Token": front.token(sandbox.id)})
        assert no_id.status_code == 400 and no_id.json()["code"] == "invalid_argument"


def _connect_headers(front: ef.EnvdFront, sandbox_id: str, content_type: str) -> dict[str, str]:
    return {
        **front.headers(sandbox_id, token=front.token(sandbox_id)),
        "Content-Type": content_type,
        "Connect-Protocol-Version": "1",
    }


def test_malformed_connect_requests(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    front = envd_front
    unary = _connect_headers(front, sandbox.id, "application/json")
    streaming = _connect_headers(front, sandbox.id, "application/connect+json")
    with front.http() as http:
        for body in (b"{not json", b'{"path": 5}', b'{"unknownField": 1}', b"\xff\xfe", b"[]"):
            answer = http.post(UNARY, content=body, headers=unary)
            assert 400 <= answer.status_code < 500, (body, answer.status_code, answer.text)
            assert isinstance(answer.json()["code"], str), answer.text
        # Envelopes: truncated header, a length beyond the body, a payload that is not JSON.
        for body in (
            b"\x00\x00",
            b"\x00" + struct.pack(">I", 1000) + b"{}",
            b"\x00" + struct.pack(">I", 3) + b"{{{",
        ):
            answer = http.post(STREAM, content=body, headers=streaming)
            assert answer.status_code < 500, (body, answer.status_code)
            if answer.status_code == 200:  # Connect streams carry their error in the end-of-stream frame
                flags, length = answer.content[0], struct.unpack(">I", answer.content[1:5])[0]
                assert flags == 0x02 and "error" in json.loads(answer.content[5 : 5 + length])
        assert http.post("/process.Process/Nope", content=b"{}", headers=unary).status_code == 404
        assert http.get("/nowhere").status_code == 404
    _stat(front, sandbox.id)  # the front still serves


def test_oversized_and_endless_bodies(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    front = envd_front
    limit = ef.TEST_MAX_UPLOAD_BYTES
    headers = front.headers(sandbox.id, token=front.token(sandbox.id))
    sent = [0]

    def endless() -> Iterator[bytes]:
        chunk = b"x" * (64 << 10)
        while sent[0] < 16 * limit:
            sent[0] += len(chunk)
            yield chunk

    with front.http() as http:
        big = http.post(
            UNARY,
            content=b"{" + b" " * (5 << 20) + b"}",
            headers=_connect_headers(front, sandbox.id, "application/json"),
        )
        assert big.status_code >= 400 and big.json()["code"] == "resource_exhausted"
        upload = {**headers, "Content-Type": "application/octet-stream"}
        declared = http.post(
            "/files", params={"path": "/tmp/big"}, content=b"x" * (limit + 1), headers=upload
        )
        assert declared.status_code == 413 and declared.json()["code"] == 413
        bomb = gzip.compress(b"\0" * (limit * 4))
        assert len(bomb) < limit // 50
        inflating = http.post(
            "/files",
            params={"path": "/tmp/bomb"},
            content=bomb,
            headers={**upload, "Content-Encoding": "gzip"},
        )
        assert inflating.status_code == 413
        try:
            chunked = http.post("/files", params={"path": "/tmp/endless"}, content=endless(), headers=upload)
            assert chunked.status_code == 413
        except httpx.WriteError:
            pass  # the front answered and closed while the body was still being sent
        assert sent[0] < 16 * limit  # the body was not read to its end
        for path in ("/tmp/big", "/tmp/bomb", "/tmp/endless"):
            assert http.get("/files", params={"path": path}, headers=headers).status_code in (200, 404)
    _stat(front, sandbox.id)


def test_path_traversal_stays_in_the_sandbox(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    front = envd_front
    headers = front.headers(sandbox.id, token=front.token(sandbox.id))
    marker = secrets.token_hex(8).encode()
    sandbox.exec(["sh", "-c", f"printf {marker.decode()} > /tmp/marker"])
    with front.http() as http:
        for path in ("/../../../../tmp/marker", "/tmp/../tmp/./marker", "../../../../../tmp/marker"):
            answer = http.get("/files", params={"path": path}, headers=headers)
            assert answer.status_code == 200 and answer.content == marker, path
        host_passwd = open("/etc/passwd", "rb").read()  # noqa: SIM115 - the host's, to compare
        inside = http.get("/files", params={"path": "/../../../etc/passwd"}, headers=headers)
        assert inside.status_code == 200 and inside.content != host_passwd
        nul = http.get("/files", params={"path": "/tmp/a\x00b"}, headers=headers)
        assert nul.status_code == 400
        encoded = http.get("/files?path=%2F..%2F..%2Ftmp%2Fmarker", headers=headers)
        assert encoded.status_code == 200 and encoded.content == marker


def test_client_that_stops_reading(envd_front: ef.EnvdFront, sandbox: Sandbox) -> None:
    """A client that stops reading an endless output stream costs nothing lasting: the front keeps serving,
    and the process (E2B: a disconnect does not kill it) is still there to be killed."""
    client = envd_front.process(sandbox.id)
    stream = client.start(
        pb.StartRequest(process=pb.ProcessConfig(cmd="yes"), stdin=False), timeout_ms=120_000
    )
    iterator = iter(stream)
    pid = next(iterator).event.event.value.pid
    assert next(iterator).event.event.field == "data"
    stream.close()
    assert pid in [p.pid for p in client.list(pb.ListRequest()).processes]
    selector = pb.ProcessSelector(selector=Oneof("pid", pid))
    client.send_signal(pb.SendSignalRequest(process=selector, signal=pb.Signal.SIGKILL))
    _stat(envd_front, sandbox.id)
    deadline = time.monotonic() + 30  # the kill is asynchronous: the daemon reaps the process after it
    while pid in [p.pid for p in client.list(pb.ListRequest()).processes]:
        assert time.monotonic() < deadline, f"process {pid} survived SIGKILL"
        time.sleep(0.1)


def test_rate_and_stream_limits(real_cluster: RealCluster, sandbox: Sandbox) -> None:  # noqa: F811
    """The API's per-key limits hold on the envd front: a request bucket, a cap on open streams, and a cut
    for a client that keeps a stream open without reading it (which frees its slot)."""
    with ef.serve_front(
        real_cluster,
        api_request_burst=3,
        api_requests_per_s=0.01,
        api_streams_per_key=1,
        api_send_stall_s=2.0,
    ) as front:
        for _ in range(3):
            _stat(front, sandbox.id, api_key=real_cluster.api_key)
        assert (
            _code(lambda: _stat(front, sandbox.id, api_key=real_cluster.api_key)) == Code.RESOURCE_EXHAUSTED
        )
        # The sandbox's own token is another caller, with its own bucket; one stream at a time.
        client = front.process(sandbox.id)
        stream = client.start(
            pb.StartRequest(process=pb.ProcessConfig(cmd="yes"), stdin=False), timeout_ms=120_000
        )
        iterator = iter(stream)
        pid = next(iterator).event.event.value.pid  # open, and then never read again
        selector = pb.ProcessSelector(selector=Oneof("pid", pid))
        start = pb.StartRequest(process=pb.ProcessConfig(cmd="/bin/true"), stdin=False)
        assert _code(lambda: list(client.start(start))) == Code.RESOURCE_EXHAUSTED
        client.send_signal(pb.SendSignalRequest(process=selector, signal=pb.Signal.SIGKILL))  # its last token
        stream.close()
    with ef.serve_front(real_cluster, api_streams_per_key=1, api_send_stall_s=2.0) as front:
        client = front.process(sandbox.id)
        stream = client.start(
            pb.StartRequest(process=pb.ProcessConfig(cmd="yes"), stdin=False), timeout_ms=120_000
        )
        pid = next(iter(stream)).event.event.value.pid
        selector = pb.ProcessSelector(selector=Oneof("pid", pid))
        deadline = time.monotonic() + 60
        while True:  # the unread stream is cut once its sends stall, which frees the key's only slot
            try:
                list(client.start(start, timeout_ms=60_000))
                break
            except ConnectError as exc:
                assert exc.code == Code.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
                time.sleep(0.5)
        client.send_signal(pb.SendSignalRequest(process=selector, signal=pb.Signal.SIGKILL))
        stream.close()


def test_endless_input_stream_holds_a_slot(real_cluster: RealCluster, sandbox: Sandbox) -> None:  # noqa: F811
    """A StreamInput that never ends is a stream like any other: it takes one of its caller's slots (so
    endless ones cannot pile up) and gives it back when it ends."""
    with ef.serve_front(real_cluster, api_streams_per_key=1) as front:
        client = front.process(sandbox.id)
        cat = client.start(pb.StartRequest(process=pb.ProcessConfig(cmd="cat")), timeout_ms=120_000)
        pid = next(iter(cat)).event.event.value.pid
        cat.close()  # the process goes on; the Start stream's slot is free again
        selector = pb.ProcessSelector(selector=Oneof("pid", pid))
        release, fed = threading.Event(), threading.Event()

        def endless() -> Iterator[bytes]:
            # Raw Connect envelopes over a chunked body: the request reaches the front at once and its body
            # never ends until released (the SDK's sync client sends a client stream only once it is whole).
            yield _envelope({"start": {"process": {"pid": pid}}})
            yield _envelope({"data": {"input": {"stdin": base64.b64encode(b"x\n").decode()}}})
            fed.set()
            release.wait(60)

        failures: list[BaseException] = []
        answers: list[httpx.Response] = []

        def feed() -> None:
            headers = {
                **front.headers(sandbox.id, token=front.token(sandbox.id)),
                "Content-Type": "application/connect+json",
                "Connect-Protocol-Version": "1",
            }
            try:
                with front.http() as http:
                    answers.append(
                        http.post("/process.Process/StreamInput", content=endless(), headers=headers)
                    )
            except BaseException as exc:  # reported below, in the test's thread
                failures.append(exc)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        assert fed.wait(60), failures
        probe = pb.StartRequest(process=pb.ProcessConfig(cmd="/bin/true"), stdin=False)
        deadline = time.monotonic() + 30
        while True:  # until the input stream holds the slot
            try:
                list(client.start(probe, timeout_ms=60_000))
            except ConnectError as exc:
                # The stream slot, not the request rate (which answers the same code).
                assert exc.code == Code.RESOURCE_EXHAUSTED and "streams open" in str(exc), exc
                break
            assert time.monotonic() < deadline, "the endless input stream never took a slot"
            time.sleep(0.5)
        release.set()
        feeder.join(30)
        assert not feeder.is_alive() and failures == [], failures
        (answer,) = answers
        assert answer.status_code == 200 and b'"error"' not in answer.content, answer.content
        assert _end(list(client.start(probe, timeout_ms=60_000))) == 0
        client.send_signal(pb.SendSignalRequest(process=selector, signal=pb.Signal.SIGKILL))


def _end(messages: list[Any]) -> int:
    ends = [m.event.event.value for m in messages if m.event.event.field == "end"]
    assert len(ends) == 1, messages
    return int(ends[0].exit_code)


def _envelope(message: dict[str, Any]) -> bytes:
    """One Connect stream message: flags 0, big-endian length, JSON."""
    payload = json.dumps(message).encode()
    return b"\x00" + struct.pack(">I", len(payload)) + payload
