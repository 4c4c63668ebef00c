"""Hostile `btrfs send` streams against every helper verb that receives one, on real loop-mounted btrfs
with the real `btrfs receive` (root).

Each stream starts as a real one, made by `btrfs send` from a crafted subvolume, and is then patched
(path TLVs rewritten, commands inserted, the first command's parent swapped; CRCs recomputed): `..`
components, absolute paths, a symlinked parent directory, a wrong parent UUID, a clone from another
tenant's subvolume. Each goes to template.receive, template.import (ADR 0056), snapshot.import and
template.base_import through the verb table (`dispatch`, the helper's own entry point, with
pydantic-validated arguments) and must fail with a clear typed error, leave no file outside staging
(sentinel directories on the host and on the node's filesystem stay empty, the filesystem's tree outside
subvolumes is unchanged, /etc/pwned never appears) and leave no staging behind. Unpatched controls of the
same streams are accepted, so every refusal is the patch's doing. The layer behind the checker (`--chroot`
into empty staging, then "staging holds the subvolume and nothing else") is attacked on its own with
symlinks the *parent* holds, which no stream checker can see.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from space.core import errors
from space.core.ids import new_sandbox_id, new_snapshot_id
from space.node.agent.helper_client import HelperClient
from space.node.helper import staging
from space.node.helper.context import HelperContext
from space.node.helper.runsc import Runsc
from space.node.helper.server import dispatch
from space.node.layout import NodeLayout
from space.node.volumes import btrfs, btrfs_ioctl, btrfs_receive, sendstream, template_base
from space.node.volumes.filesystem import ensure_btrfs, unmount_btrfs
from tests.support import sendstreams as sb

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop mounts, btrfs receive)"),
    pytest.mark.skipif(shutil.which("mkfs.btrfs") is None, reason="needs btrfs-progs"),
]

AGENT_UID = 65534  # staging directories belong to the (unprivileged) agent, as on a node
HOST_PWNED = Path("/etc/pwned")


@dataclass
class Node:
    ctx: HelperContext
    sentinel: Path  # a host directory outside the node's filesystem that a stream aims at

    @property
    def layout(self) -> NodeLayout:
        return self.ctx.layout


def _new_node(tmp: Path, name: str, *, with_base: bool) -> Iterator[Node]:
    data_dir = Path(f"/var/tmp/space-test-{secrets.token_hex(4)}")
    data_dir.mkdir(mode=0o700)
    try:
        layout = NodeLayout(data_dir)
        ensure_btrfs(data_dir, image_size_gb=4)
        for path in (layout.templates, layout.snapshots_root, layout.checkpoints_root, layout.sandboxes):
            path.mkdir(parents=True, exist_ok=True)
        if with_base:
            template_base.ensure_base(layout.templates)  # from the machine's rootfs cache (seconds)
        sentinel = tmp / f"sentinel-{name}"
        sentinel.mkdir()
        ctx = HelperContext(layout=layout, runsc=Runsc(root=layout.runsc_root, binary="/nonexistent/runsc"),
                            owner_uid=AGENT_UID)  # fmt: skip
        yield Node(ctx=ctx, sentinel=sentinel)
    finally:
        try:
            unmount_btrfs(data_dir)
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node with the template base: the target of deltas (template.receive, snapshot.import)."""
    yield from _new_node(tmp_path_factory.mktemp("hostile"), "a", with_base=True)


@pytest.fixture(scope="module")
def bare_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node without a base: the target of template.base_import."""
    yield from _new_node(tmp_path_factory.mktemp("hostile-bare"), "b", with_base=False)


def _call(node: Node, verb: str, args: Mapping[str, object]) -> dict[str, object]:
    return dispatch(node.ctx, {"verb": verb, "args": dict(args)}, lambda _line: None)


def _failure(answer: dict[str, object]) -> tuple[str, str]:
    assert answer["ok"] is False, f"a hostile stream was accepted: {answer}"
    error = answer["error"]
    assert isinstance(error, dict)
    return str(error["code"]), str(error["message"])


# --- what "nothing escaped" means ---------------------------------------------------------------------
def _outside_subvolumes(root: Path) -> set[str]:
    """Every path under the node's filesystem that is not inside a subvolume (subvolumes are listed, not
    entered): a write that left its subvolume shows up here."""
    found: set[str] = set()
    root_dev = os.lstat(root).st_dev
    for dirpath, dirnames, filenames in os.walk(root):
        keep = []
        for name in dirnames:
            full = Path(dirpath) / name
            found.add(str(full.relative_to(root)))
            st = os.lstat(full)
            if not (st.st_ino == btrfs_ioctl.BTRFS_FIRST_FREE_OBJECTID and st.st_dev != root_dev):
                keep.append(name)
        dirnames[:] = keep
        found.update(str((Path(dirpath) / name).relative_to(root)) for name in filenames)
    return found


class Watch:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.before = _outside_subvolumes(node.layout.fs)

    def assert_nothing_escaped(self, *, allowed: frozenset[str] | set[str] = frozenset()) -> None:
        assert not HOST_PWNED.exists(), "a stream wrote /etc/pwned on the host"
        assert list(self.node.sentinel.iterdir()) == [], "a stream wrote into the host sentinel directory"
        after = _outside_subvolumes(self.node.layout.fs)
        new = {p for p in after - self.before if not any(p == a or p.startswith(a + "/") for a in allowed)}
        assert new == set(), f"the filesystem gained entries outside any subvolume: {sorted(new)[:10]}"
        leftovers = [p for p in after if Path(p).name.startswith(btrfs_receive.STAGING_PREFIX)]
        assert leftovers == [], f"receive staging left behind: {leftovers}"


# --- crafting real streams ----------------------------------------------------------------------------
def _send(subvol: Path, parent: Path | None = None) -> bytes:
    argv = ["btrfs", "send", "-q", *(["-p", str(parent)] if parent else []), str(subvol)]
    return subprocess.run(argv, check=True, capture_output=True).stdout


def _crafted_delta(node: Node) -> bytes:
    """A real delta against the node's base: a few files, a symlink `work/x -> /`, named "crafted"."""
    base = node.layout.templates / template_base.BASE_NAME
    scratch = node.layout.fs / "scratch"
    scratch.mkdir(exist_ok=True)
    child = scratch / "crafted"
    btrfs.snapshot(base, child)
    try:
        (child / "work" / "hello").write_text("hello\n")
        (child / "work" / "evil").write_text("evil\n")
        (child / "work" / "x").symlink_to("/")
        btrfs.set_readonly(child, True)
        return _send(child, parent=base)
    finally:
        btrfs.delete_subvolume(child)


def _crafted_full(node: Node, name: str) -> bytes:
    """A real full stream of a small subvolume called `name`, with the same files as `_crafted_delta`."""
    scratch = node.layout.fs / "scratch"
    scratch.mkdir(exist_ok=True)
    subvol = scratch / name
    btrfs.create_subvolume(subvol)
    try:
        (subvol / "work").mkdir()
        (subvol / "work" / "hello").write_text("hello\n")
        (subvol / "work" / "evil").write_text("evil\n")
        (subvol / "work" / "x").symlink_to("/")
        btrfs.set_readonly(subvol, True)
        return _send(subvol)
    finally:
        btrfs.delete_subvolume(subvol)


def _named(data: bytes, name: str) -> bytes:
    commands = sb.decode(data)
    commands[0].set(sendstream.A_PATH, name.encode())
    return sb.encode(commands)


def _rewrite_path(data: bytes, old: bytes, new: bytes) -> bytes:
    commands = sb.decode(data)
    hits = 0
    for command in commands[1:]:
        for kind in (sendstream.A_PATH, sendstream.A_PATH_TO):
            if command.get(kind) == old:
                command.set(kind, new)
                hits += 1
    assert hits, f"{old!r} is not in the stream"
    return sb.encode(commands)


def _insert_before_end(data: bytes, *extra: sb.Cmd) -> bytes:
    commands = sb.decode(data)
    assert commands[-1].cmd == sendstream.C_END
    return sb.encode([*commands[:-1], *extra, commands[-1]])


def _hostile_variants(data: bytes, sentinel: Path) -> dict[str, bytes]:
    """The attacks, each a patched copy of `data` (a real stream holding work/evil and work/x -> /)."""
    target = str(sentinel).lstrip("/").encode()
    return {
        "dotdot": _rewrite_path(data, b"work/evil", b"../" * 16 + target + b"/pwned-dotdot"),
        "dotdot-inner": _rewrite_path(data, b"work/evil", b"work/../../../../../../../etc/pwned"),
        "absolute": _rewrite_path(data, b"work/evil", b"/" + target + b"/pwned-absolute"),
        "absolute-etc": _rewrite_path(data, b"work/evil", b"/etc/pwned"),
        "symlinked-parent": _insert_before_end(
            data,
            sb.mkdir(b"work/x/etc", ino=900),
            sb.mkfile(b"work/x/etc/pwned", ino=901),
            sb.write(b"work/x/etc/pwned", b"owned\n"),
        ),
        "symlinked-parent-rename": _insert_before_end(
            data, sb.mkfile(b"o999-1-0", ino=902), sb.rename(b"o999-1-0", b"work/x/" + target + b"/pwned")
        ),
        "symlink-made-then-used": _insert_before_end(
            data, sb.symlink(b"work/y", str(sentinel).encode(), ino=903), sb.mkfile(b"work/y/pwned", ino=904)
        ),
    }


# --- template.receive -------------------------------------------------------------------------------------
def _template_receive(node: Node, data: bytes, name: str) -> dict[str, object]:
    stream = node.layout.fs / "incoming" / f"{name}.stream"
    stream.parent.mkdir(exist_ok=True)
    stream.write_bytes(data)
    try:
        return _call(node, "template.receive", {"name": name, "stream": str(stream)})
    finally:
        stream.unlink()


def test_template_receive_refuses_every_hostile_stream(node: Node) -> None:
    real = _named(_crafted_delta(node), "evil")
    watch = Watch(node)
    for attack, data in _hostile_variants(real, node.sentinel).items():
        code, message = _failure(_template_receive(node, data, "evil"))
        assert code == "invalid_argument", (attack, message)
        assert "send stream refused" in message, (attack, message)
        assert not os.path.lexists(node.layout.template("evil")), attack
        watch.assert_nothing_escaped(allowed={"incoming"})

    # The same stream unpatched is a valid template delta: the refusals above were the patches' doing.
    answer = _template_receive(node, real, "evil")
    assert answer["ok"] is True, answer
    received = node.layout.template("evil")
    assert (received / "work" / "hello").read_text() == "hello\n"
    assert btrfs.get_readonly(received) and btrfs.subvolume_identity(received).received_uuid
    watch.assert_nothing_escaped(allowed={"incoming", "templates/evil"})
    btrfs.delete_subvolume(received)


def test_template_receive_refuses_a_delta_onto_another_parent(node: Node) -> None:
    """Made against the wrong parent, or claiming the base while cloning another subvolume."""
    base = node.layout.templates / template_base.BASE_NAME
    scratch = node.layout.fs / "scratch"
    scratch.mkdir(exist_ok=True)
    other = scratch / "other-tenant"
    btrfs.snapshot(base, other)
    (other / "work" / "secret").write_text("another tenant's data\n")
    btrfs.set_readonly(other, True)
    child = scratch / "evil"
    btrfs.snapshot(other, child)
    (child / "work" / "mine").write_text("x\n")
    btrfs.set_readonly(child, True)
    try:
        onto_other = _send(child, parent=other)
        watch = Watch(node)
        code, message = _failure(_template_receive(node, onto_other, "evil"))
        other_id = btrfs.subvolume_identity(other).uuid
        assert code == "not_found" and other_id in message, message
        # Swap the parent for the base's identity, but clone the other tenant's file: refused too.
        base_raw = bytes.fromhex(_identity(node).replace("-", ""))
        commands = sb.decode(_send(child, parent=other))
        commands[0].set(sendstream.A_CLONE_UUID, base_raw)
        stolen = sb.clone(b"work/mine", bytes.fromhex(other_id.replace("-", "")), b"work/secret")
        spoofed = sb.encode([*commands[:-1], stolen, commands[-1]])
        code, message = _failure(_template_receive(node, spoofed, "evil"))
        assert code == "invalid_argument" and "neither" in message, message
        watch.assert_nothing_escaped(allowed={"incoming"})
    finally:
        for subvol in (child, other):
            btrfs.delete_subvolume(subvol)


def _identity(node: Node) -> str:
    ident = btrfs.subvolume_identity(node.layout.templates / template_base.BASE_NAME)
    return ident.received_uuid or ident.uuid


# --- snapshot.import ------------------------------------------------------------------------------------
def _template_import(node: Node, data: bytes, name: str) -> dict[str, object]:
    """template.import (ADR 0056): a user template's delta staged as the agent stages a fetched one."""
    prepared = _call(node, "staging.prepare", {"kind": "template-import", "template": name})
    assert prepared["ok"] is True, prepared
    (staging.template_dir(node.ctx, "template-import", name) / "template.stream").write_bytes(data)
    return _call(node, "template.import", {"name": name, "metadata_json": f'{{"name": "{name}"}}'})


def test_template_import_refuses_every_hostile_stream(node: Node) -> None:
    real = _named(_crafted_delta(node), "tpl-evil")
    watch = Watch(node)
    for attack, data in _hostile_variants(real, node.sentinel).items():
        code, message = _failure(_template_import(node, data, "tpl-evil"))
        assert code == "invalid_argument" and "send stream refused" in message, (attack, message)
        assert not os.path.lexists(node.layout.template("tpl-evil")), attack
        assert not (node.layout.templates / "tpl-evil.json").exists(), attack
        watch.assert_nothing_escaped(allowed={"staging"})
        _call(node, "staging.release", {"kind": "template-import", "template": "tpl-evil"})
    answer = _template_import(node, real, "tpl-evil")  # the control: the same stream unpatched
    assert answer["ok"] is True, answer
    assert (node.layout.template("tpl-evil") / "work" / "hello").read_text() == "hello\n"
    assert (node.layout.templates / "tpl-evil.json").exists()
    btrfs.delete_subvolume(node.layout.template("tpl-evil"))
    (node.layout.templates / "tpl-evil.json").unlink()


def _snapshot_import(node: Node, data: bytes, sandbox_id: str, snapshot_id: str) -> dict[str, object]:
    prepared = _call(node, "staging.prepare", {"kind": "import", "sandbox_id": sandbox_id,
                                               "snapshot_id": snapshot_id})  # fmt: skip
    assert prepared["ok"] is True, prepared
    staged = node.layout.import_dir(sandbox_id, snapshot_id)
    (staged / "disk.stream").write_bytes(data)
    (staged / "image").mkdir()
    (staged / "image" / "checkpoint.img").write_bytes(b"not really a checkpoint")
    return _call(node, "snapshot.import", {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id})


def test_snapshot_import_refuses_every_hostile_stream(node: Node) -> None:
    crafted = _crafted_delta(node)
    watch = Watch(node)
    sandbox_id = new_sandbox_id()
    for attack, data in _hostile_variants(crafted, node.sentinel).items():
        snapshot_id = new_snapshot_id()
        code, message = _failure(_snapshot_import(node, _named(data, snapshot_id), sandbox_id, snapshot_id))
        assert code == "artifact_corrupt", (attack, message)
        assert "send stream refused" in message, (attack, message)
        assert not os.path.lexists(node.layout.snapshot(sandbox_id, snapshot_id)), attack
        watch.assert_nothing_escaped(allowed={"staging", f"snapshots/{sandbox_id}"})
        _call(
            node, "staging.release", {"kind": "import", "sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        )

    # A stream named for another snapshot (here: another sandbox's) is refused before anything is applied.
    snapshot_id = new_snapshot_id()
    code, message = _failure(_snapshot_import(node, _named(crafted, "sn-elsewhere"), sandbox_id, snapshot_id))
    assert code == "artifact_corrupt" and "sn-elsewhere" in message, message

    # A full stream (any content, no parent) where a delta onto the base is expected: refused.
    snapshot_id = new_snapshot_id()
    full = _crafted_full(node, snapshot_id)
    code, message = _failure(_snapshot_import(node, full, sandbox_id, snapshot_id))
    assert code == "artifact_corrupt" and "full stream where a delta" in message, message
    watch.assert_nothing_escaped(allowed={"staging", f"snapshots/{sandbox_id}", "scratch"})

    # The unpatched stream is imported: disk received onto the base, image moved in, bundle written.
    snapshot_id = new_snapshot_id()
    answer = _snapshot_import(node, _named(crafted, snapshot_id), sandbox_id, snapshot_id)
    assert answer["ok"] is True, answer
    disk = node.layout.snapshot(sandbox_id, snapshot_id)
    assert (disk / "work" / "evil").read_text() == "evil\n" and os.readlink(disk / "work" / "x") == "/"
    assert (disk / "usr" / "bin" / "python3").exists()  # the base underneath
    watch.assert_nothing_escaped(allowed={"staging", "snapshots", "checkpoints", "sandboxes", "scratch"})
    assert _call(node, "sandbox.destroy", {"sandbox_id": sandbox_id})["ok"] is True


# --- template.base_import ---------------------------------------------------------------------------
def _base_import(node: Node, data: bytes) -> dict[str, object]:
    prepared = _call(node, "staging.prepare", {"kind": "base-import"})
    assert prepared["ok"] is True, prepared
    (node.layout.base_import_dir() / "base.stream").write_bytes(data)
    return _call(node, "template.base_import", {})


def test_base_import_refuses_every_hostile_stream(node: Node, bare_node: Node) -> None:
    crafted = _crafted_full(bare_node, template_base.BASE_NAME)
    watch = Watch(bare_node)
    for attack, data in _hostile_variants(crafted, bare_node.sentinel).items():
        code, message = _failure(_base_import(bare_node, data))
        assert code == "artifact_corrupt", (attack, message)
        assert "send stream refused" in message, (attack, message)
        assert not os.path.lexists(bare_node.layout.templates / template_base.BASE_NAME), attack
        watch.assert_nothing_escaped(allowed={"staging", "scratch", "templates/.lock"})

    # A delta (here one made on the other node against its base) is not a base: refused, whatever it names.
    code, message = _failure(_base_import(bare_node, _named(_crafted_delta(node), template_base.BASE_NAME)))
    assert code == "artifact_corrupt" and "delta stream where a full" in message, message
    # Nor is a full stream of anything but the base.
    code, message = _failure(_base_import(bare_node, _named(crafted, "python")))
    assert code == "artifact_corrupt" and "'python'" in message, message
    watch.assert_nothing_escaped(allowed={"staging", "scratch", "templates/.lock"})

    # The unpatched stream is accepted as the base (and removed again for the next test run).
    answer = _base_import(bare_node, crafted)
    assert answer["ok"] is True, answer
    base = bare_node.layout.templates / template_base.BASE_NAME
    assert (base / "work" / "hello").read_text() == "hello\n" and btrfs.get_readonly(base)
    btrfs.delete_subvolume(base)
    (bare_node.layout.templates / f"{template_base.BASE_NAME}.json").unlink()


# --- the layer behind the checker: --chroot into empty staging -------------------------------------------
def test_chroot_contains_writes_through_a_symlink_the_parent_holds(node: Node) -> None:
    """A parent with `x -> /` and `y -> <host sentinel>`: a delta that writes `x/etc/pwned` and `y/pwned`
    passes the checker (it cannot know what the parent's paths are), and is still contained: inside the
    chroot `/` is the empty staging directory, so the first write lands beside the subvolume (seen, refused,
    removed) and the second finds no such directory."""
    scratch = node.layout.fs / "scratch"
    scratch.mkdir(exist_ok=True)
    parent = scratch / "parent-with-links"
    btrfs.create_subvolume(parent)
    (parent / "x").symlink_to("/")
    (parent / "y").symlink_to(node.sentinel)
    btrfs.set_readonly(parent, True)
    child = scratch / "child"
    btrfs.snapshot(parent, child)
    (child / "ok").write_text("fine\n")
    btrfs.set_readonly(child, True)
    dest = node.layout.fs / "chroot-target"
    dest.mkdir(exist_ok=True)
    try:
        real = _send(child, parent=parent)
        ident = btrfs.subvolume_identity(parent)
        expected = sendstream.Expected.delta("child", {ident.received_uuid or ident.uuid})
        through_root = _insert_before_end(
            real, sb.mkdir(b"x/etc", ino=900), sb.mkfile(b"x/etc/pwned", ino=901),
            sb.write(b"x/etc/pwned", b"owned\n"),
        )  # fmt: skip
        through_sentinel = _insert_before_end(real, sb.mkfile(b"y/pwned", ino=902))
        watch = Watch(node)
        for data in (through_root, through_sentinel):
            with pytest.raises(errors.ArtifactCorrupt) as info:
                btrfs_receive.receive(_stream_file(data, node), dest, expected=expected)
            assert "send stream refused" in info.value.message
            assert list(dest.iterdir()) == []
            watch.assert_nothing_escaped(allowed={"scratch", "chroot-target", "incoming"})
        assert "outside its subvolume" in _message_of(through_root, node, dest, expected)
        # Unpatched, it is received and moved into place.
        got = btrfs_receive.receive(_stream_file(real, node), dest, expected=expected)
        assert (got / "ok").read_text() == "fine\n" and os.readlink(got / "x") == "/"
        btrfs.delete_subvolume(got)
    finally:
        for subvol in (child, parent):
            btrfs.delete_subvolume(subvol)


def _stream_file(data: bytes, node: Node) -> Path:
    path = node.layout.fs / "incoming" / "direct.stream"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


def _message_of(data: bytes, node: Node, dest: Path, expected: sendstream.Expected) -> str:
    try:
        btrfs_receive.receive(_stream_file(data, node), dest, expected=expected)
    except errors.ArtifactCorrupt as exc:
        return exc.message
    raise AssertionError("accepted")


def test_streams_are_opened_once_and_never_through_a_link_or_fifo(node: Node, tmp_path: Path) -> None:
    """template.receive: a path through a symlinked directory inside the data directory, a FIFO (which
    would hang a blocking open) and a device are refused before anything is read."""
    incoming = node.layout.fs / "incoming"
    incoming.mkdir(exist_ok=True)
    real_dir = incoming / "real"
    real_dir.mkdir(exist_ok=True)
    (real_dir / "s.stream").write_bytes(b"btrfs-stream\0")
    fifo = incoming / "fifo.stream"
    os.mkfifo(fifo)
    try:
        for path in (fifo, Path("/dev/null")):
            code, _message = _failure(_call(node, "template.receive", {"name": "evil", "stream": str(path)}))
            assert code == "invalid_argument"
        with btrfs_receive.open_stream(real_dir / "s.stream") as f:
            assert f.read() == b"btrfs-stream\0"
        with pytest.raises(errors.InvalidArgument, match="symlink"):
            os.symlink(real_dir / "s.stream", incoming / "link.stream")
            btrfs_receive.open_stream(incoming / "link.stream")
        with pytest.raises(errors.InvalidArgument, match="not a regular file"):
            btrfs_receive.open_stream(fifo)
        # A directory on the way swapped for a link (after the path was checked) is not followed either.
        os.symlink(real_dir, incoming / "linkdir")
        root = node.layout.data_dir.resolve()
        linked = root / "fs" / "incoming" / "linkdir" / "s.stream"
        with (
            pytest.raises(errors.InvalidArgument, match="not a plain directory"),
            staging.open_beneath(root, linked),
        ):
            pass
        with staging.open_beneath(root, root / "fs" / "incoming" / "real" / "s.stream") as f:
            assert f.read() == b"btrfs-stream\0"
    finally:
        fifo.unlink()
        (incoming / "link.stream").unlink(missing_ok=True)
        (incoming / "linkdir").unlink(missing_ok=True)


# --- the same attacks through the real helper process -----------------------------------------------------
@pytest.fixture
def helper_process(node: Node, tmp_path: Path) -> Iterator[str]:
    """The root helper as it runs on a node (its own process, socket, umask, verb table), on node A's data."""
    socket_path = str(tmp_path / "helper.sock")
    log = open(tmp_path / "helper.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [sys.executable, "-m", "space.node.helper.server", "--data-dir", str(node.layout.data_dir),
         "--socket", socket_path, "--network", "none", "--runsc", "/nonexistent/runsc"],
        stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(socket_path):
            assert proc.poll() is None, (tmp_path / "helper.log").read_text()
            assert time.monotonic() < deadline, "the helper did not come up"
            time.sleep(0.05)
        yield socket_path
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_the_real_helper_process_refuses_hostile_streams_with_typed_errors(
    node: Node, helper_process: str
) -> None:
    crafted = _crafted_delta(node)
    watch = Watch(node)
    sandbox_id = new_sandbox_id()

    async def scenario() -> None:
        helper = HelperClient(helper_process)
        try:
            for attack, data in _hostile_variants(_named(crafted, "evil"), node.sentinel).items():
                stream = _stream_file(data, node)
                with pytest.raises(errors.InvalidArgument, match="send stream refused"):
                    await helper.call("template.receive", {"name": "evil", "stream": str(stream)})
                assert not os.path.lexists(node.layout.template("evil")), attack
            for attack, data in _hostile_variants(crafted, node.sentinel).items():
                snapshot_id = new_snapshot_id()
                ids = {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
                staged = Path((await helper.call("staging.prepare", {"kind": "import", **ids}))["dir"])
                (staged / "disk.stream").write_bytes(_named(data, snapshot_id))
                with pytest.raises(errors.ArtifactCorrupt, match="send stream refused"):
                    await helper.call("snapshot.import", ids)
                assert not os.path.lexists(node.layout.snapshot(sandbox_id, snapshot_id)), attack
                await helper.call("staging.release", {"kind": "import", **ids})
        finally:
            await helper.close()

    asyncio.run(scenario())
    watch.assert_nothing_escaped(allowed={"incoming", "staging", f"snapshots/{sandbox_id}"})


# --- template.ensure: the base from the rootfs cache goes through the same receive ---------------------
def test_a_hostile_rootfs_cache_is_refused_dropped_and_never_applied(bare_node: Node, tmp_path: Path) -> None:
    """The cache is root's own file, but it is a stream like any other: a tampered one is refused by the
    checker, deleted, and the base rebuilt (here from an unreachable mirror, so the rebuild fails too)."""
    crafted = _crafted_full(bare_node, template_base.BASE_NAME)
    cache_dir = tmp_path / "rootfs-cache"
    cache_dir.mkdir()
    watch = Watch(bare_node)
    for attack, data in _hostile_variants(crafted, bare_node.sentinel).items():
        (cache_dir / template_base.CACHE_NAME).write_bytes(data)
        lines: list[str] = []
        with pytest.raises(errors.RuntimeFailure, match="debootstrap"):
            template_base.ensure_base(bare_node.layout.templates, cache_dir=cache_dir,
                                  mirror="http://127.0.0.1:9/debian", progress=lines.append)  # fmt: skip
        assert any("cached base unusable" in line and "send stream refused" in line for line in lines), attack
        assert not (cache_dir / template_base.CACHE_NAME).exists(), f"{attack}: the refused cache was kept"
        base_or_lock = {f"templates/{template_base.BASE_NAME}", "templates/.lock"}
        watch.assert_nothing_escaped(allowed={"scratch", "staging", *base_or_lock})
    # What the failed rebuild left is a half-built base, never a received one.
    base = bare_node.layout.templates / template_base.BASE_NAME
    if btrfs.is_subvolume(base):
        assert btrfs.subvolume_identity(base).received_uuid is None
        btrfs.delete_subvolume(base)
