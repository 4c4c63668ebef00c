"""The OCI image unpacker (space.node.volumes.oci_image, oci_layer) against well-formed and hostile archives
made here with tarfile: nothing may land outside the tree, every refusal is typed, digests are checked.
Runs as root (owners are set), into a scratch directory (the verb adds the btrfs subvolume around it)."""

from __future__ import annotations

import gzip
import io
import json
import os
import pathlib
from collections.abc import Iterator

import pytest

from space.core import errors
from space.node.volumes import oci_image
from space.node.volumes.oci_layer import Budget
from tests.support.oci_archives import (
    Entry,
    Image,
    directory,
    docker_save,
    file,
    hardlink,
    layer,
    oci_layout,
    outer,
    sha,
    symlink,
)

pytestmark = pytest.mark.root

PYTHON = [
    directory("usr"),
    directory("usr/bin"),
    file("usr/bin/python3.11", b"#!elf", mode=0o755),
    symlink("usr/bin/python3", "python3.11"),
]


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> Iterator[tuple[pathlib.Path, int]]:
    if os.geteuid() != 0:
        pytest.fail("the unpacker sets owners: run as root (CI does)")
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    yield root, fd
    os.close(fd)
    assert list((tmp_path / "outside").iterdir()) == [], "something was written outside the tree"


def unpack(
    archive: bytes, fd: int, max_bytes: int = 16 << 30, max_entries: int = 1_000_000
) -> oci_image.ImageResult:
    return oci_image.unpack(io.BytesIO(archive), fd, Budget(max_bytes=max_bytes, max_entries=max_entries))


@pytest.mark.parametrize("wrap", [docker_save, oci_layout])
@pytest.mark.parametrize("gz", [False, True])
def test_layers_whiteouts_links_and_config(tree: tuple[pathlib.Path, int], wrap, gz: bool) -> None:  # type: ignore[no-untyped-def]
    root, fd = tree
    image = Image(
        [
            layer(
                [
                    *PYTHON,
                    directory("etc"),
                    file("etc/gone", b"old"),
                    directory("d"),
                    file("d/lower"),
                    directory("d/sub"),
                    file("d/sub/deep"),
                    file("suid", b"s", mode=0o4755, uid=0),
                    file("owned", b"o", uid=1234, gid=4321),
                    Entry("dev/null", "chr"),
                    Entry("fifo", "fifo"),
                ]
            ),
            layer(
                [
                    file("etc/.wh.gone", b""),
                    file("d/.wh..wh..opq", b""),
                    file("d/new", b"n"),
                    hardlink("d/link", "d/new"),
                    symlink("abs", "/etc/passwd"),
                ]
            ),
        ],
        config={
            "config": {
                "Env": ["PATH=/usr/bin", "BAD KEY=x", "A=b=c"],
                "WorkingDir": "/d",
                "User": "app:app",
                "Cmd": ["python3", "-m", "http.server"],
            }
        },
        gzip_layers=gz,
    )
    result = unpack(wrap(image), fd)
    assert result.layers == 2 and result.python == "3.11"
    assert not (root / "etc/gone").exists()
    assert sorted(os.listdir(root / "d")) == ["link", "new"], "the opaque dir kept a lower entry"
    assert os.stat(root / "d/link").st_ino == os.stat(root / "d/new").st_ino
    assert os.readlink(root / "abs") == "/etc/passwd"  # stored as given, never followed
    assert os.stat(root / "suid").st_mode & 0o7777 == 0o4755
    assert (os.stat(root / "owned").st_uid, os.stat(root / "owned").st_gid) == (1234, 4321)
    assert not (root / "dev/null").exists() and not (root / "fifo").exists()
    meta = oci_image.config_metadata(result.config)
    assert meta["env"] == {"PATH": "/usr/bin", "A": "b=c"} and meta["env_dropped"] == 1
    assert (meta["workdir"], meta["default_user"]) == ("/d", "app")
    assert meta["image_cmd"] == ["python3", "-m", "http.server"]


def refused(archive: bytes, fd: int, reason: str) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        unpack(archive, fd)
    assert caught.value.details.get("reason") == reason, caught.value


def test_path_traversal_and_absolute_paths(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    refused(docker_save(Image([layer([*PYTHON, file("../outside/x")])])), fd, "path_traversal")
    refused(docker_save(Image([layer([*PYTHON, file("a/../../outside/x")])])), fd, "path_traversal")
    refused(docker_save(Image([layer([*PYTHON, file("/etc/x")])])), fd, "absolute_path")


def test_symlink_then_write_through_it(tree: tuple[pathlib.Path, int]) -> None:
    root, fd = tree
    escape = str(root.parent / "outside")
    refused(docker_save(Image([layer([*PYTHON, symlink("a", escape), file("a/x")])])), fd, "through_symlink")
    # across layers too, and relative links climbing out
    two = Image([layer([*PYTHON, symlink("b", "../outside")]), layer([file("b/x")])])
    refused(oci_layout(two), fd, "through_symlink")


def test_symlink_replaced_by_a_file_is_not_followed(tree: tuple[pathlib.Path, int]) -> None:
    root, fd = tree
    victim = root.parent / "outside" / "victim"
    image = Image([layer([*PYTHON, symlink("s", str(victim))]), layer([file("s", b"mine")])])
    unpack(docker_save(image), fd)
    assert not victim.exists() and (root / "s").read_bytes() == b"mine"


def test_hardlinks_only_inside_the_image(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    refused(docker_save(Image([layer([*PYTHON, hardlink("h", "../outside/x")])])), fd, "path_traversal")
    refused(docker_save(Image([layer([*PYTHON, hardlink("h", "/etc/passwd")])])), fd, "absolute_path")
    refused(docker_save(Image([layer([*PYTHON, hardlink("h", "missing")])])), fd, "bad_link")
    # a link to the image's own symlink pointing out is not a regular file of the image
    refused(
        docker_save(Image([layer([*PYTHON, symlink("s", "/etc/shadow"), hardlink("h", "s")])])),
        fd,
        "bad_link",
    )


def test_write_after_hardlink_does_not_reach_the_target(tree: tuple[pathlib.Path, int]) -> None:
    root, fd = tree
    image = Image([layer([*PYTHON, file("t", b"target"), hardlink("h", "t")]), layer([file("h", b"new")])])
    unpack(docker_save(image), fd)
    assert (root / "t").read_bytes() == b"target" and (root / "h").read_bytes() == b"new"


@pytest.mark.parametrize("name", ["d/.wh...", "d/.wh..", "d/.wh."])
def test_whiteout_of_dot_dot_is_refused(tree: tuple[pathlib.Path, int], name: str) -> None:
    _root, fd = tree
    refused(docker_save(Image([layer([*PYTHON, directory("d"), file(name, b"")])])), fd, "bad_whiteout")


def test_declared_size_over_the_budget_is_refused_before_reading(tree: tuple[pathlib.Path, int]) -> None:
    root, fd = tree
    big = Entry("big", "file", b"tiny", declared_size=2 << 30)
    with pytest.raises(errors.TooLarge):
        unpack(docker_save(Image([layer([*PYTHON, big])])), fd, max_bytes=1 << 30)
    assert not (root / "big").exists()


def test_declared_size_larger_than_the_data_is_truncated(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    big = Entry("big", "file", b"tiny", declared_size=2 << 30)
    with pytest.raises(errors.InvalidArgument):
        unpack(docker_save(Image([layer([*PYTHON, big])])), fd)


def test_entry_count_budget(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    many = [file(f"f{i}", b"") for i in range(1200)]
    with pytest.raises(errors.TooLarge):
        unpack(docker_save(Image([layer([*PYTHON, *many])])), fd, max_entries=1000)


def test_digest_mismatches(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    image = Image([layer([*PYTHON]), layer([file("x")])], gzip_layers=True)
    refused(oci_layout(image, corrupt_layer=1), fd, "digest_mismatch")
    # docker save: a layer that is not the one the config's diff_ids name
    other = Image([layer([*PYTHON]), layer([file("y")])])
    archive = docker_save(other)
    lying = archive.replace(sha(layer([file("y")])).encode(), sha(layer([file("z")])).encode())
    with pytest.raises(errors.InvalidArgument):
        unpack(lying, fd)


def test_truncated_gzip_layer(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    blob = gzip.compress(layer([*PYTHON, file("x", os.urandom(20000))]))[:-200]
    raw = layer([*PYTHON, file("x")])
    config = json.dumps({"rootfs": {"diff_ids": [f"sha256:{sha(raw)}"]}}).encode()
    manifest = json.dumps([{"Config": f"{sha(config)}.json", "Layers": ["l/layer.tar"]}]).encode()
    archive = outer({"manifest.json": manifest, f"{sha(config)}.json": config, "l/layer.tar": blob})
    refused(archive, fd, "corrupt_layer")


def test_manifest_pointing_outside_the_archive(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    refused(docker_save(Image([layer(PYTHON)]), layer_names=["../../etc/passwd"]), fd, "path_traversal")
    config = json.dumps({"rootfs": {"diff_ids": [f"sha256:{'0' * 64}"]}}).encode()
    manifest = json.dumps([{"Config": f"{sha(config)}.json", "Layers": ["l.tar"]}]).encode()
    linked = outer({"manifest.json": manifest, f"{sha(config)}.json": config}, links={"l.tar": "/etc/passwd"})
    refused(linked, fd, "missing_member")


def test_image_without_python_names_the_fix(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    with pytest.raises(errors.InvalidArgument) as caught:
        unpack(docker_save(Image([layer([directory("etc"), file("etc/os-release")])])), fd)
    assert caught.value.details["reason"] == "no_python" and "python3" in caught.value.message
    old = [directory("usr"), directory("usr/bin"), file("usr/bin/python3.7", b"x", mode=0o755),
           symlink("usr/bin/python3", "python3.7")]  # fmt: skip
    refused(docker_save(Image([layer(old)])), fd, "old_python")


def test_python_only_in_usr_local_gets_linked(tree: tuple[pathlib.Path, int]) -> None:
    root, fd = tree
    local = [directory("usr"), directory("usr/local"), directory("usr/local/bin"),
             file("usr/local/bin/python3.12", b"x", mode=0o755),
             symlink("usr/local/bin/python3", "python3.12")]  # fmt: skip
    result = unpack(docker_save(Image([layer(local)])), fd)
    assert result.python == "3.12" and result.python_link_added
    assert os.readlink(root / "usr/bin/python3") == "/usr/local/bin/python3"


def test_duplicate_outer_members_and_junk(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    refused(b"not a tar at all" * 64, fd, "bad_archive")
    refused(outer({"something": b"x"}), fd, "bad_archive")
    raw = io.BytesIO()
    import tarfile

    with tarfile.open(fileobj=raw, mode="w") as tar:
        for _ in range(2):
            info = tarfile.TarInfo("manifest.json")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"[]"))
    refused(raw.getvalue(), fd, "duplicate_entry")


def test_oversized_pax_header_is_refused_before_it_is_read(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    import tarfile

    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, 2 << 30
    forged = info.tobuf(tarfile.USTAR_FORMAT) + b"20 path=aaaaaaaaaaaa\n".ljust(512, b"\0") + bytes(1024)
    with pytest.raises(errors.InvalidArgument) as caught:
        unpack(docker_save(Image([layer(PYTHON), forged])), fd)
    assert "extended header" in caught.value.message, caught.value


def test_nesting_deeper_than_the_bound_is_refused(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    refused(docker_save(Image([layer([*PYTHON, file("a/" * 200 + "f")])])), fd, "bad_name")


def test_a_layer_padded_with_a_zero_bomb_is_refused(tree: tuple[pathlib.Path, int]) -> None:
    _root, fd = tree
    padded = layer(PYTHON) + bytes(20 << 20)  # after the end-of-archive blocks: hashed, bounded
    refused(oci_layout(Image([padded], gzip_layers=True)), fd, "bad_layer")


def test_zstd_layers(tree: tuple[pathlib.Path, int]) -> None:
    import zstandard

    root, fd = tree
    raw = [layer([*PYTHON, file("z", b"zstd")])]
    image = Image(raw)
    image.blobs = lambda: [zstandard.ZstdCompressor().compress(b) for b in raw]  # type: ignore[method-assign]
    unpack(oci_layout(image), fd)
    assert (root / "z").read_bytes() == b"zstd"
    cut = Image(raw)
    cut.blobs = lambda: [zstandard.ZstdCompressor().compress(b)[:-40] for b in raw]  # type: ignore[method-assign]
    with pytest.raises(
        errors.InvalidArgument
    ) as caught:  # an empty or short stream: whichever check sees it first
        unpack(oci_layout(cut), fd)
    assert caught.value.details["reason"] in {"bad_layer", "corrupt_layer", "digest_mismatch"}
