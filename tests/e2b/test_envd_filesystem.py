"""E2B's in-sandbox front, `filesystem.Filesystem` (E2B's generated Connect clients) and REST `/files` and
`/health`, over real HTTP against a real runsc sandbox."""

from __future__ import annotations

import gzip
import secrets
import threading
import time
from typing import Any

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as fpb

from space.sdk import Sandbox
from tests.support import envd_front as ef
from tests.support.cluster import real_cluster  # noqa: F401 - module-bound session fixture

envd_front = ef.envd_front

pytestmark = pytest.mark.root


@pytest.fixture
def base(sandbox: Sandbox) -> str:
    return f"/tmp/e2b-{secrets.token_hex(4)}"


def _upload(front: ef.EnvdFront, sandbox_id: str, path: str, data: bytes) -> list[dict[str, Any]]:
    with front.http() as http:
        answer = http.post(
            "/files", params={"path": path}, content=data,
            headers={**front.headers(sandbox_id, token=front.token(sandbox_id)),
                     "Content-Type": "application/octet-stream"},
        )  # fmt: skip
    assert answer.status_code == 200, answer.text
    return list(answer.json())


def test_make_dir_stat_move_list_remove(envd_front: ef.EnvdFront, sandbox: Sandbox, base: str) -> None:
    fs = envd_front.filesystem(sandbox.id)
    made = fs.make_dir(fpb.MakeDirRequest(path=f"{base}/a/b")).entry
    assert made is not None and made.type == fpb.FileType.DIRECTORY and made.path == f"{base}/a/b"
    assert made.permissions == "drwxr-xr-x" and made.mode == 0o755
    with pytest.raises(ConnectError) as exists:
        fs.make_dir(fpb.MakeDirRequest(path=f"{base}/a"))
    assert exists.value.code == Code.ALREADY_EXISTS
    _upload(envd_front, sandbox.id, f"{base}/a/file.txt", b"four")
    with pytest.raises(ConnectError) as on_file:
        fs.make_dir(fpb.MakeDirRequest(path=f"{base}/a/file.txt"))
    assert on_file.value.code == Code.INVALID_ARGUMENT
    entry = fs.stat(fpb.StatRequest(path=f"{base}/a/file.txt")).entry
    assert (
        entry is not None and entry.type == fpb.FileType.FILE and entry.size == 4 and entry.name == "file.txt"
    )
    assert entry.owner and entry.group and entry.modified_time is not None

    moved = fs.move(
        fpb.MoveRequest(source=f"{base}/a/file.txt", destination=f"{base}/new/parent/f.txt")
    ).entry
    assert moved is not None and moved.path == f"{base}/new/parent/f.txt" and moved.size == 4
    with pytest.raises(ConnectError) as missing:
        fs.move(fpb.MoveRequest(source=f"{base}/nothing", destination=f"{base}/x"))
    assert missing.value.code == Code.NOT_FOUND

    listed = fs.list_dir(fpb.ListDirRequest(path=base, depth=3)).entries
    assert [e.path.removeprefix(base + "/") for e in listed] == [
        "a",
        "a/b",
        "new",
        "new/parent",
        "new/parent/f.txt",
    ]
    assert [e.name for e in fs.list_dir(fpb.ListDirRequest(path=base)).entries] == ["a", "new"]  # depth 0 = 1
    with pytest.raises(ConnectError) as not_dir:
        fs.list_dir(fpb.ListDirRequest(path=f"{base}/new/parent/f.txt"))
    assert not_dir.value.code == Code.INVALID_ARGUMENT

    fs.remove(fpb.RemoveRequest(path=base))
    fs.remove(fpb.RemoveRequest(path=base))  # nothing there: still fine (RemoveAll)
    with pytest.raises(ConnectError) as gone:
        fs.stat(fpb.StatRequest(path=base))
    assert gone.value.code == Code.NOT_FOUND


def test_stat_follows_a_symlink(envd_front: ef.EnvdFront, sandbox: Sandbox, base: str) -> None:
    _upload(envd_front, sandbox.id, f"{base}/target.txt", b"12345")
    sandbox.exec(["ln", "-s", "target.txt", f"{base}/link"])
    sandbox.exec(["ln", "-s", f"{base}/link", f"{base}/chain"])
    fs = envd_front.filesystem(sandbox.id)
    for name in ("link", "chain"):
        entry = fs.stat(fpb.StatRequest(path=f"{base}/{name}")).entry
        assert entry is not None
        assert (entry.type, entry.size, entry.symlink_target, entry.is_symlink) == (
            fpb.FileType.FILE, 5, f"{base}/target.txt", True,
        )  # fmt: skip
    listed = {e.name: e for e in fs.list_dir(fpb.ListDirRequest(path=base)).entries}
    assert (
        listed["link"].type == fpb.FileType.SYMLINK and listed["link"].symlink_target == f"{base}/target.txt"
    )


def test_upload_metadata_is_replaced(envd_front: ef.EnvdFront, sandbox: Sandbox, base: str) -> None:
    headers = envd_front.headers(sandbox.id, token=envd_front.token(sandbox.id))
    fs = envd_front.filesystem(sandbox.id)
    with envd_front.http() as http:
        first = http.post(
            "/files", params={"path": f"{base}/meta.txt"}, content=b"x",
            headers={**headers, "Content-Type": "application/octet-stream", "X-Metadata-Owner": "alice",
                     "X-Metadata-Stage": "draft"},
        )  # fmt: skip
        assert first.status_code == 200, first.text
        entry = fs.stat(fpb.StatRequest(path=f"{base}/meta.txt")).entry
        assert entry is not None and dict(entry.metadata) == {"owner": "alice", "stage": "draft"}
        again = http.post(
            "/files", params={"path": f"{base}/meta.txt"}, content=b"y",
            headers={**headers, "Content-Type": "application/octet-stream", "X-Metadata-Stage": "final"},
        )  # fmt: skip
        assert again.status_code == 200, again.text
        entry = fs.stat(fpb.StatRequest(path=f"{base}/meta.txt")).entry
        assert entry is not None and dict(entry.metadata) == {"stage": "final"}


def test_files_upload_download_gzip_and_multipart(
    envd_front: ef.EnvdFront, sandbox: Sandbox, base: str
) -> None:
    headers = envd_front.headers(sandbox.id, token=envd_front.token(sandbox.id))
    payload = secrets.token_bytes(300_000)
    with envd_front.http() as http:
        raw = http.post(
            "/files", params={"path": f"{base}/raw/x.bin"}, content=gzip.compress(payload),
            headers={**headers, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
        )  # fmt: skip
        assert raw.status_code == 200, raw.text
        assert raw.json() == [{"path": f"{base}/raw/x.bin", "name": "x.bin", "type": "file"}]
        plain = http.get("/files", params={"path": f"{base}/raw/x.bin"}, headers=headers)
        assert plain.status_code == 200 and plain.content == payload
        zipped = http.get(
            "/files", params={"path": f"{base}/raw/x.bin"}, headers={**headers, "Accept-Encoding": "gzip"}
        )
        assert zipped.headers["content-encoding"] == "gzip" and zipped.content == payload  # httpx inflates

        files = [("file", (f"{base}/m/one.txt", b"one")), ("file", (f"{base}/m/deep/two.txt", b"two"))]
        multi = http.post("/files", files=files, headers=headers)
        assert multi.status_code == 200, multi.text
        assert [f["path"] for f in multi.json()] == [f"{base}/m/one.txt", f"{base}/m/deep/two.txt"]
        for path, data in ((f"{base}/m/one.txt", b"one"), (f"{base}/m/deep/two.txt", b"two")):
            assert http.get("/files", params={"path": path}, headers=headers).content == data

        assert http.get("/files", params={"path": f"{base}/m"}, headers=headers).status_code == 400
        missing = http.get("/files", params={"path": f"{base}/none"}, headers=headers)
        assert missing.status_code == 404 and missing.json()["code"] == 404
        assert http.get("/health").status_code == 204
        assert http.get("/health", headers=headers).status_code == 204


def test_watch_dir_stream(envd_front: ef.EnvdFront, sandbox: Sandbox, base: str) -> None:
    fs = envd_front.filesystem(sandbox.id)
    fs.make_dir(fpb.MakeDirRequest(path=f"{base}/w"))
    request = fpb.WatchDirRequest(path=f"{base}/w", recursive=True, include_entry=True)
    stream = fs.watch_dir(request, timeout_ms=60_000)
    seen: list[Any] = []
    started = threading.Event()

    def read() -> None:
        for message in stream:
            seen.append(message.event)
            started.set()
            if any(e.field == "filesystem" and e.value.name == "sub/new.txt" for e in seen):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(30)
    assert seen[0].field == "start"
    fs.make_dir(fpb.MakeDirRequest(path=f"{base}/w/sub"))
    time.sleep(0.3)  # the recursive watch adds the new directory
    _upload(envd_front, sandbox.id, f"{base}/w/sub/new.txt", b"x")
    reader.join(30)
    stream.close()
    events = [e.value for e in seen if e.field == "filesystem"]
    assert ("sub", fpb.EventType.CREATE) in [(e.name, e.type) for e in events]
    assert not [e.name for e in events if ".spaced-" in e.name]  # the daemon's temporary files are hidden
    created = [e for e in events if e.name == "sub/new.txt"]
    assert created and created[0].type == fpb.EventType.CREATE
    assert created[0].entry is not None and created[0].entry.path == f"{base}/w/sub/new.txt"


def test_polling_watcher(envd_front: ef.EnvdFront, sandbox: Sandbox, base: str) -> None:
    fs = envd_front.filesystem(sandbox.id)
    fs.make_dir(fpb.MakeDirRequest(path=f"{base}/p"))
    watcher_id = fs.create_watcher(fpb.CreateWatcherRequest(path=f"{base}/p")).watcher_id
    _upload(envd_front, sandbox.id, f"{base}/p/f.txt", b"x")
    names: list[str] = []
    deadline = time.monotonic() + 30
    while "f.txt" not in names and time.monotonic() < deadline:
        names += [
            e.name for e in fs.get_watcher_events(fpb.GetWatcherEventsRequest(watcher_id=watcher_id)).events
        ]
        time.sleep(0.1)
    assert "f.txt" in names
    assert fs.get_watcher_events(fpb.GetWatcherEventsRequest(watcher_id=watcher_id)).events == []  # drained
    fs.remove_watcher(fpb.RemoveWatcherRequest(watcher_id=watcher_id))
    with pytest.raises(ConnectError) as gone:
        fs.get_watcher_events(fpb.GetWatcherEventsRequest(watcher_id=watcher_id))
    assert gone.value.code == Code.NOT_FOUND
    with pytest.raises(ConnectError) as missing:
        fs.create_watcher(fpb.CreateWatcherRequest(path=f"{base}/none"))
    assert missing.value.code == Code.NOT_FOUND
