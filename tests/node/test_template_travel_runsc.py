"""A user template from an OCI image archive, travelling through the object store, on a real node (runsc,
btrfs, the root helper): ADR 0056.

- An OCI layout archive made here from the `python` template's own tree (one layer) plus a second layer
  with a whiteout and an opaque directory is imported by the helper's verb; a real sandbox of the result
  sees exactly what the layers say.
- A user template (committed as a build commits one) is published, removed from the node, and five
  concurrent creates of it on the node that now lacks it read the template's stream from the store ONCE
  (a counting store), then all five run; an unpublished template is NotFound, a flipped part is
  ArtifactCorrupt and leaves nothing; an export left by a deleted namesake is never uploaded.
- The new verbs refuse what a compromised agent could send them.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import pathlib
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterator

import pytest

from space.core import errors
from space.node.agent import template_travel, transfer
from space.node.agent.service_core import ServiceCore
from space.node.volumes import btrfs
from space.objectstore.backends import open_store
from space.objectstore.base import ObjectStore
from tests.support.oci_archives import Image, directory, docker_save, file, layer, oci_layout, symlink
from tests.support.realnode import RealNode
from tests.support.sandboxes import delete_quietly

pytestmark = pytest.mark.root

NAME = "tpl-0a0b0c0d0e0f0a0b"
OTHER = "tpl-0a0b0c0d0e0f0a0c"
REF = "tpl_0a0b0c0d0e0f0a0b"  # the control plane's id of the template the archive was uploaded for
OCI_NAME = "tpl-0a0b0c0d0e0f0a0d"  # the template an image is imported for (deleting NAME deletes NAME-oci)
IMPORTED = template_travel.imported_name(OCI_NAME)
# Big and irrelevant to the test: left out so the archive stays small (the daemon and the shell commands
# of the test need python3, its standard library, coreutils and their libraries, none of these).
SKIP = ("usr/share", "usr/lib/git-core", "usr/lib/apt", "usr/lib/x86_64-linux-gnu/perl",
        "usr/lib/x86_64-linux-gnu/perl-base", "usr/lib/x86_64-linux-gnu/gconv", "usr/bin/git",
        "usr/bin/scalar", "usr/bin/perl", "usr/bin/perl5.36.0", "var/cache", "var/lib/apt", "var/lib/dpkg",
        "opt/space")  # fmt: skip


class CountingStore(ObjectStore):
    """The filesystem store, counting every GET by key."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.gets: list[str] = []

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        self.gets.append(key)
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


# Libraries of apt, git, curl and perl (python3, its standard library, coreutils and the shells need none).
LIB_DIR = "usr/lib/x86_64-linux-gnu/"
LIB_SKIP = ("libapt", "libstdc++", "libdb-5.3", "libgnutls", "libp11-kit", "libunistring", "libgcrypt",
            "libperl", "libsqlite3", "libcurl", "libgssapi", "libkrb5", "libk5crypto", "libldap", "libssh2",
            "libnghttp2", "librtmp", "libsasl2", "libhogweed", "libnettle", "libgmp", "libidn2", "libtasn1",
            "libbrotli")  # fmt: skip


def tree_layer(root: pathlib.Path) -> bytes:
    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        name = info.name.removeprefix("./")
        if any(name == s or name.startswith(s + "/") for s in SKIP):
            return None
        return None if name.startswith(LIB_DIR) and name[len(LIB_DIR) :].startswith(LIB_SKIP) else info

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(root)):
            tar.add(root / entry, arcname=entry, filter=keep)
    return out.getvalue()


@pytest.fixture(scope="module")
def store_dir() -> Iterator[pathlib.Path]:
    path = pathlib.Path(tempfile.mkdtemp(prefix="space-test-tplstore-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def imported(node: RealNode, store_dir: pathlib.Path) -> Iterator[str]:
    """The archive stored as the control plane stores an upload, imported through template_travel."""
    helper = node.agent.driver.helper  # type: ignore[attr-defined]
    base = tree_layer(node.data_dir / "fs" / "templates" / "python")
    top = layer([file("etc/.wh.debian_version", b""), directory("root"), file("root/.wh..wh..opq", b""),
                 file("root/kept", b"from the second layer\n"), file("srv/added", b"added\n")])  # fmt: skip
    archive = oci_layout(
        Image([base, top], config={"config": {"Env": ["FROM_IMAGE=yes"], "WorkingDir": "/srv"}})
    )
    upload = store_dir.parent / f"{store_dir.name}-upload"
    upload.mkdir()
    (upload / "source.tar").write_bytes(archive)
    store = open_store(store_dir.as_uri())
    transfer.upload(store, template_travel.source_prefix(REF), upload, {"source.tar": len(archive)},
                    data_key=None, metadata={})  # fmt: skip
    shutil.rmtree(upload)
    saved, node.agent.store = node.agent.store, store
    try:
        name = node.run(template_travel.import_oci(node.agent, OCI_NAME, REF), timeout=900)
    finally:
        node.agent.store = saved
    assert name == IMPORTED
    meta = node.run(template_travel.held(node.agent, IMPORTED))
    assert meta is not None and meta["env"] == {"FROM_IMAGE": "yes"} and meta["workdir"] == "/srv"
    assert meta["from"] == f"oci:{REF}" and meta["layers"] == 2
    yield IMPORTED
    node.run(helper.call("template.delete", {"name": IMPORTED}))


def test_sandbox_of_an_imported_image_sees_its_layers(node: RealNode, imported: str) -> None:
    async def scenario() -> None:
        handle = await node.agent.create(imported, warm=False)
        try:
            listing = await handle.session.exec(
                "ls -A /root; cat /srv/added; test -e /etc/debian_version; echo $?"
            )
            assert listing.exit_code == 0, listing
            assert listing.stdout.decode().split() == ["kept", "added", "1"]
            py = await handle.session.exec(["python3", "-c", "print(6 * 7)"])
            assert py.stdout.decode().strip() == "42"
        finally:
            await delete_quietly(node.agent, handle.sandbox_id)

    node.run(scenario(), timeout=600)


def test_concurrent_first_use_downloads_once(node: RealNode, store_dir: pathlib.Path) -> None:
    helper = node.agent.driver.helper  # type: ignore[attr-defined]
    store = CountingStore(open_store(store_dir.as_uri()))
    saved, node.agent.store = node.agent.store, store
    created: list[str] = []
    service = ServiceCore(node.agent, templates=("python",))  # what the node reports (info, heartbeat)

    async def scenario() -> None:
        # A user template as a build commits one (a snapshot of `python` plus what the build wrote),
        # published, then gone from this node.
        await helper.call("template.delete", {"name": NAME})
        # A namesake exported by a publish killed before its upload, then deleted: never published later.
        await asyncio.to_thread(_commit_like_a_build, node, NAME, "by a deleted namesake\n")
        await helper.call("template.export", {"name": NAME})
        await helper.call("template.delete", {"name": NAME})
        await asyncio.to_thread(_commit_like_a_build, node, NAME)
        manifest = await template_travel.publish_template(node.agent, NAME)
        await helper.call("template.delete", {"name": NAME})
        assert await template_travel.held(node.agent, NAME) is None
        stream_parts = {part.key for part in manifest.entries["template.stream"].parts}
        store.gets.clear()
        handles = await asyncio.gather(*(node.agent.create(NAME) for _ in range(5)))
        created.extend(h.sandbox_id for h in handles)
        part_gets = [key for key in store.gets if key in stream_parts]
        assert sorted(part_gets) == sorted(stream_parts), "the stream was not read exactly once"
        held = await template_travel.held(node.agent, NAME)
        assert held is not None and held["workdir"] == "/srv" and held["received"]
        assert service.info().templates == ["python", NAME]  # the scheduler now prefers this node for it
        for handle in handles:
            result = await handle.session.exec("cat /srv/built")
            assert result.stdout == b"by the build\n"
        # Never published: NotFound. A part flipped in the store: refused before the helper receives it,
        # and nothing is left (no template, no staging).
        with pytest.raises(errors.NotFound):
            await node.agent.create("tpl-ffffffffffffffff")
        await asyncio.to_thread(_commit_like_a_build, node, OTHER)
        other = await template_travel.publish_template(node.agent, OTHER)
        await helper.call("template.delete", {"name": OTHER})
        part = store_dir / other.entries["template.stream"].parts[0].key
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0x10
        part.write_bytes(bytes(data))
        with pytest.raises(errors.ArtifactCorrupt):
            await node.agent.create(OTHER)
        assert await template_travel.held(node.agent, OTHER) is None
        assert not (node.data_dir / "fs" / "staging" / f"template-import-{OTHER}").exists()

    try:
        node.run(scenario(), timeout=900)
    finally:
        node.run(delete_quietly(node.agent, *created), timeout=300)
        node.run(helper.call("template.delete", {"name": NAME}))
        node.run(helper.call("template.delete", {"name": OTHER}))
        node.agent.store = saved
        node.agent.template_arrived = None


def _commit_like_a_build(node: RealNode, name: str, content: str = "by the build\n") -> None:
    """A read-only snapshot of `python` with a file added, and its metadata, as template `name`."""
    templates = node.data_dir / "fs" / "templates"
    work = templates / f".{name}.new"
    btrfs.snapshot(templates / "python", work, readonly=False)
    (work / "srv").mkdir(exist_ok=True)
    (work / "srv" / "built").write_text(content)
    btrfs.set_readonly(work, True)
    os.rename(work, templates / name)
    meta = json.loads((templates / "python.json").read_text())
    meta.update({"name": name, "builtin": False, "from": "python", "workdir": "/srv", "env": {},
                 "created": str(time.time())})  # fmt: skip
    (templates / f"{name}.json").write_text(json.dumps(meta))


def test_template_verbs_refuse_what_is_not_theirs(node: RealNode, imported: str) -> None:
    """The helper's new verbs, called as a compromised agent could: built-ins, malformed names and refs,
    metadata of another template, a staged symlink instead of an archive."""
    helper = node.agent.driver.helper  # type: ignore[attr-defined]

    async def refused(verb: str, params: dict[str, object], error: type[errors.SpaceError]) -> None:
        with pytest.raises(error):
            await helper.call(verb, params)

    async def scenario() -> None:
        await refused("template.import_oci", {"name": "python", "source": "oci:x"}, errors.InvalidArgument)
        await refused("template.import_oci", {"name": "tpl-../x", "source": "oci:x"}, errors.InvalidArgument)
        await refused("template.import_oci", {"name": "tpl-a", "source": "oci:../x"}, errors.InvalidArgument)
        await refused("template.import_oci", {"name": imported, "source": "oci:x"}, errors.AlreadyExists)
        await refused("template.export", {"name": "python"}, errors.InvalidArgument)
        await refused("template.export", {"name": "tpl-absent"}, errors.NotFound)
        meta = json.dumps({"name": "tpl-other"})
        await refused("template.import", {"name": "tpl-b", "metadata_json": meta}, errors.InvalidArgument)
        bad_user = json.dumps({"name": "tpl-b", "default_user": "root; rm -rf /"})
        await refused("template.import", {"name": "tpl-b", "metadata_json": bad_user}, errors.InvalidArgument)
        await refused("staging.prepare", {"kind": "oci-import"}, errors.InvalidArgument)
        # a symlink staged in place of the archive is never followed
        staged = await helper.call("staging.prepare", {"kind": "oci-import", "template": "tpl-c"})
        try:
            (pathlib.Path(staged["dir"]) / "source.tar").symlink_to("/etc/shadow")
            await refused("template.import_oci", {"name": "tpl-c", "source": "oci:x"}, errors.InvalidArgument)
        finally:
            await helper.call("staging.release", {"kind": "oci-import", "template": "tpl-c"})
        # a hostile image (a symlink out, then a write through it) fails after the tree was begun: nothing
        # of it stays (no tree, no half-made subvolume, no private copy, no metadata)
        hostile = docker_save(Image([layer([symlink("a", "/etc"), file("a/pwned")])]))
        staged = await helper.call("staging.prepare", {"kind": "oci-import", "template": "tpl-c"})
        try:
            (pathlib.Path(staged["dir"]) / "source.tar").write_bytes(hostile)
            await refused("template.import_oci", {"name": "tpl-c", "source": "oci:x"}, errors.InvalidArgument)
        finally:
            await helper.call("staging.release", {"kind": "oci-import", "template": "tpl-c"})
        assert not pathlib.Path("/etc/pwned").exists()
        templates = node.data_dir / "fs" / "templates"
        assert [p.name for p in templates.iterdir() if "tpl-c" in p.name] == []

    node.run(scenario(), timeout=120)
