"""File fidelity and PTY resize by process id through the whole path (SDK -> control plane -> node ->
a real gVisor sandbox): owner and group names from the sandbox's own passwd, symlinks that point outside,
listings by depth, user.* extended attributes where gVisor keeps them (tmpfs) and the typed refusal where
it does not (the gofer-backed root and /work), and resize of a PTY, a plain and an unknown process."""

from __future__ import annotations

import base64
import contextlib
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.core import errors
from space.sdk import Sandbox, Space
from tests.support.cluster import real_cluster  # noqa: F401 - module-bound session fixture

pytestmark = pytest.mark.root

MISSING_PROCESS = "0123456789abcdef"


@contextlib.contextmanager
def refused_at_the_edge() -> Iterator[None]:
    """A 422 validation_error: the API refused the request before any sandbox call."""
    with pytest.raises(errors.InvalidArgument) as refused:
        yield
    assert refused.value.code == "validation_error", refused.value


@pytest.fixture(scope="module")
def sandbox(real_cluster: Any) -> Iterator[Sandbox]:  # noqa: F811
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(template="python", limits={"cpus": 0.5, "memory_mb": 256})
        try:
            yield sb
        finally:
            sb.delete()


def test_owner_group_names_and_symlinks(sandbox: Sandbox) -> None:
    files = sandbox.files
    passwd = files.stat("/etc/passwd")
    assert (passwd["owner"], passwd["group"], passwd["permissions"]) == ("root", "root", "-rw-r--r--")
    sandbox.exec(
        "set -e; mkdir -p /work/t/a/b; echo hi > /work/t/a/b/f; chown 1000:1000 /work/t/a/b/f;"
        " touch /work/t/orphan; chown 54321:54322 /work/t/orphan;"
        " ln -s /../../../../etc/shadow /work/t/escape; ln -s loop /work/t/loop"
    )
    owned = files.stat("/work/t/a/b/f")
    assert (owned["uid"], owned["owner"], owned["group"]) == (1000, "user", "user")
    orphan = files.stat("/work/t/orphan")
    assert (orphan["uid"], orphan["gid"], orphan["owner"], orphan["group"]) == (54321, 54322, None, None)
    # The answer names the link's text; following it stays in the sandbox's own root.
    escape = files.stat("/work/t/escape")
    assert escape["type"] == "symlink" and escape["symlink_target"] == "/../../../../etc/shadow"
    followed = files.stat("/work/t/escape", follow=True)
    assert followed["symlink_resolved"] == "/etc/shadow" and followed["owner"] == "root"
    size_inside = sandbox.exec("stat -c %s /etc/shadow").stdout.strip()
    assert str(followed["size"]) == size_inside
    loop = files.stat("/work/t/loop", follow=True)
    assert loop["type"] == "symlink" and loop["broken"] is True
    climbed = files.stat("/../../../../etc/passwd")  # ".." above the root is the root, inside
    assert climbed["size"] == passwd["size"] and climbed["path"] == "/../../../../etc/passwd"


def test_listing_by_depth_and_mkdir_answer(sandbox: Sandbox) -> None:
    files = sandbox.files
    sandbox.exec("set -e; mkdir -p /work/d/x/y/z; touch /work/d/x/y/z/deep /work/d/top")
    names = [e["path"] for e in files.list("/work/d", depth=16)]
    assert names == ["/work/d/top", "/work/d/x", "/work/d/x/y", "/work/d/x/y/z", "/work/d/x/y/z/deep"]
    two = files.list("/work/d", depth=2, limit=2)
    assert [e["path"] for e in two] == ["/work/d/top", "/work/d/x"] and two.truncated
    assert files.mkdir("/work/d/new") is True and files.mkdir("/work/d/new") is False
    with pytest.raises(errors.NotFound):
        files.list("/work/raw")
    made = sandbox.exec(
        ["python3", "-c", "import os; os.mkdir('/work/raw'); open(b'/work/raw/caf\\xe9', 'w')"]
    )
    assert made.exit_code == 0, made.stderr  # a name that is not UTF-8
    (raw,) = files.list("/work/raw")
    assert raw["name"] == "caf\ufffd" and base64.b64decode(raw["path_b64"]) == b"/work/raw/caf\xe9"
    with refused_at_the_edge():
        files.list("/work/d", depth=17)


def test_xattrs_on_tmpfs_and_the_typed_refusal_elsewhere(sandbox: Sandbox) -> None:
    files = sandbox.files
    files.write("/tmp/tagged", b"x")
    files.set_xattr("/tmp/tagged", "user.e2b.owner", "agent")
    assert files.get_xattr("/tmp/tagged", "user.e2b.owner") == b"agent"
    assert files.xattrs("/tmp/tagged") == {"user.e2b.owner": b"agent"}
    assert files.stat("/tmp/tagged", xattrs=True)["xattrs"] == {"user.e2b.owner": "YWdlbnQ="}
    files.remove_xattr("/tmp/tagged", "user.e2b.owner")
    with pytest.raises(errors.NotFound):
        files.get_xattr("/tmp/tagged", "user.e2b.owner")
    files.write("/work/plain", b"x")
    for path in ("/work/plain", "/etc/hostname"):
        with pytest.raises(errors.InvalidArgument) as refused:
            files.set_xattr(path, "user.k", b"v")
        assert refused.value.details["reason"] == "xattrs_not_supported", refused.value.details
    assert files.stat("/work/plain", xattrs=True)["xattrs"] == {}  # none there, not an error
    for name in ("trusted.overlay.opaque", "security.capability", "system.posix_acl_access"):
        with refused_at_the_edge():
            files.set_xattr("/tmp/tagged", name, b"v")
    with refused_at_the_edge():
        files.set_xattr("/tmp/tagged", "user.big", b"v" * 65537)
    files.set_xattr("/tmp/tagged", "user.big", b"v" * 65536)  # the kernel's limit is accepted
    assert files.get_xattr("/tmp/tagged", "user.big") == b"v" * 65536


def test_resize_by_process_id(sandbox: Sandbox) -> None:
    terminal = sandbox.processes.start("read line; stty size", pty=(24, 80))
    plain = sandbox.processes.start("sleep 30")
    try:
        sandbox.processes.resize(terminal, 40, 100)
        terminal.write_stdin(b"go\n")
        result = terminal.wait()
        assert "40 100" in result.stdout, result.stdout
        with pytest.raises(errors.InvalidState) as refused:
            plain.resize(40, 100)
        assert refused.value.state == "no_terminal"
        with pytest.raises(errors.NotFound):
            sandbox.processes.resize(MISSING_PROCESS, 40, 100)
        with refused_at_the_edge():
            sandbox.processes.resize(terminal, 0, 10**6)
    finally:
        plain.signal("SIGKILL")


def test_another_tenants_process_cannot_be_resized(real_cluster: Any, sandbox: Sandbox) -> None:  # noqa: F811
    """B's key with A's sandbox and process ids, or A's process id on B's own sandbox: 404 like a missing
    one, and A's terminal keeps its size."""
    victim = sandbox.processes.start("read line; stty size", pty=(24, 80))
    with real_cluster.sdk() as admin:
        name = f"h3-b-{secrets.token_hex(3)}"
        admin.projects.create(name)
        key = admin.keys.create(project=name, role="admin").key
    with Space(url=real_cluster.url, api_key=key, transport=httpx.HTTPTransport(verify=False)) as other:
        own = other.sandboxes.create(template="python", limits={"cpus": 0.5, "memory_mb": 256})
        try:
            with pytest.raises(errors.NotFound):
                other.sandboxes.ref(sandbox.id).processes.resize(victim.id, 50, 200)
            with pytest.raises(errors.NotFound):
                own.processes.resize(victim.id, 50, 200)
        finally:
            own.delete()
    victim.write_stdin(b"go\n")
    assert "24 80" in victim.wait().stdout
