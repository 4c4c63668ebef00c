"""The send-stream checker (space.node.volumes.sendstream): what it lets through and what it refuses,
with synthetic streams built byte by byte (tests/support/sendstreams.py) and hypothesis fuzzing. The
same checks against real `btrfs receive` are in tests/runtime/test_btrfs_receive_hostile.py."""

from __future__ import annotations

import io
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from space.core import errors
from space.node.volumes import sendstream as ss
from space.node.volumes import sendstream_check as ssc
from tests.support import sendstreams as sb

UUID = bytes(range(1, 17))
PARENT = bytes(range(0x40, 0x50))
OTHER = bytes(range(0x80, 0x90))
PARENT_ID = ss.format_uuid(PARENT)
FULL = ss.Expected.full("sv")
DELTA = ss.Expected.delta("sn", {PARENT_ID})


def check(commands: list[sb.Cmd], expected: ss.Expected = FULL, **kw: int) -> ss.StreamHeader:
    return ssc.check_stream(io.BytesIO(sb.encode(commands, **kw)), expected)


def refused(commands: list[sb.Cmd], expected: ss.Expected = FULL, match: str | None = None) -> str:
    with pytest.raises(errors.ArtifactCorrupt, match=match) as info:
        check(commands, expected)
    return info.value.message


def full(*body: sb.Cmd) -> list[sb.Cmd]:
    return [sb.subvol(b"sv"), *body, sb.end()]


def delta(*body: sb.Cmd) -> list[sb.Cmd]:
    return [sb.snapshot(b"sn", PARENT), *body, sb.end()]


# --- crc32c -------------------------------------------------------------------------------------------------
def test_crc32c_is_castagnoli_without_inversions() -> None:
    # The standard CRC-32C check value, from the raw register update btrfs uses (seed ~0, final ~).
    assert ~ss.crc32c(b"123456789", 0xFFFFFFFF) & 0xFFFFFFFF == 0xE3069283
    assert ss.crc32c(b"") == 0
    raw = sb.encode_command(ss.C_END, [])
    assert struct.unpack_from("<I", raw, 6)[0] == ss.command_crc(raw)


# --- accepted -----------------------------------------------------------------------------------------------
def test_a_well_formed_full_stream_passes_and_its_header_is_read() -> None:
    header = check(
        full(
            sb.mkdir(b"o258-7-0"), sb.rename(b"o258-7-0", b"etc"), sb.mkfile(b"etc/hosts"),
            sb.write(b"etc/hosts", b"127.0.0.1 localhost\n"), sb.symlink(b"run", b"/var/run"),
            sb.symlink(b"lib", b"usr/lib"), sb.link(b"etc/hosts2", b"etc/hosts"), sb.chmod(b""),
            sb.clone(b"etc/hosts2", UUID, b"etc/hosts"),
        )
    )  # fmt: skip
    assert header == ss.StreamHeader(
        version=1, kind="full", name="sv", uuid=ss.format_uuid(UUID), ctransid=9, parent_uuid=None,
        parent_ctransid=None,
    )  # fmt: skip
    assert ss.read_header(io.BytesIO(sb.encode(full()))) == header


def test_a_delta_onto_the_expected_parent_passes_and_may_clone_from_it() -> None:
    header = check(delta(sb.clone(b"a", PARENT, b"usr/bin/python3"), sb.unlink(b"tmp/x")), DELTA)
    assert header.kind == "delta" and header.parent_uuid == PARENT_ID and header.parent_ctransid == 5


def test_symlinks_are_tracked_through_renames_and_unlinks() -> None:
    check(full(sb.symlink(b"x", b"/"), sb.rename(b"x", b"y"), sb.mkdir(b"x"), sb.mkfile(b"x/ok")))
    check(full(sb.symlink(b"x", b"/"), sb.unlink(b"x"), sb.mkdir(b"x"), sb.mkfile(b"x/ok")))
    check(full(sb.mkdir(b"d"), sb.symlink(b"d/l", b"/"), sb.rename(b"d", b"e"), sb.mkdir(b"d"),
               sb.mkfile(b"d/l")))  # fmt: skip
    # Renaming a plain directory over a tracked symlink replaces it.
    check(full(sb.symlink(b"x", b"/"), sb.mkdir(b"o1"), sb.rename(b"o1", b"x"), sb.mkfile(b"x/ok")))


# --- refused: the first command ---------------------------------------------------------------------------
def test_the_first_command_must_create_what_the_caller_expects() -> None:
    assert "full" in refused(full(), DELTA)  # a full stream where a delta onto the base is expected
    assert "delta" in refused(delta(), ss.Expected.full("sn"))
    assert "not 'sv'" in refused([sb.subvol(b"other"), sb.end()])
    for name in (b"", b".", b"..", b"a/b", b"../sv", b"/sv", b"s\0v", b"x" * 256):
        refused([sb.subvol(name), sb.end()], ss.Expected.full(name.decode(errors="replace")), "plain name")
    assert "first command is MKFILE" in refused([sb.mkfile(b"a"), sb.end()])
    own_parent = [sb.snapshot(b"sn", PARENT, uuid=PARENT), sb.end()]
    assert "its own parent" in refused(own_parent, DELTA)
    refused([sb.subvol(b"sv", uuid=bytes(16)), sb.end()], match="empty UUID")


def test_a_delta_onto_another_parent_is_not_found_naming_both() -> None:
    with pytest.raises(errors.NotFound, match=ss.format_uuid(OTHER)) as info:
        check([sb.snapshot(b"sn", OTHER), sb.end()], DELTA)
    assert PARENT_ID in info.value.message


def test_the_first_command_must_carry_well_sized_attributes_and_a_good_crc() -> None:
    short_uuid = sb.Cmd(ss.C_SUBVOL, [(ss.A_PATH, b"sv"), (ss.A_UUID, b"x" * 15), (ss.A_CTRANSID, sb.u64(1))])
    refused([short_uuid, sb.end()], match="15 bytes")
    no_ctransid = sb.Cmd(ss.C_SUBVOL, [(ss.A_PATH, b"sv"), (ss.A_UUID, UUID)])
    refused([no_ctransid, sb.end()], match="lacks attribute 2")
    snap = sb.snapshot(b"sn", PARENT)
    snap.attrs = [a for a in snap.attrs if a[0] != ss.A_CLONE_CTRANSID]
    refused([snap, sb.end()], DELTA, "lacks attribute 21")
    data = bytearray(sb.encode(full()))
    data[17 + 6] ^= 0xFF  # the first command's crc
    with pytest.raises(errors.ArtifactCorrupt, match="crc32c"):
        ssc.check_stream(io.BytesIO(bytes(data)), FULL)


# --- refused: framing ---------------------------------------------------------------------------------------
def test_framing_anomalies_are_refused() -> None:
    good = sb.encode(full(sb.mkfile(b"a")))
    for data, match in (
        (b"", "bad magic"),
        (b"btrfs-stream\0", "bad magic"),
        (b"btrfs-strean\0" + good[13:], "bad magic"),
        (good[:13] + struct.pack("<I", 2) + good[17:], "version 2"),
        (good[:13] + struct.pack("<I", 0) + good[17:], "version 0"),
        (good[:17], "no command"),
        (good[:20], "truncated in the header"),
        (good[:40], "truncated in command"),
        (good[:-10], "without END"),
        (good + b"\0", "truncated in the header"),
        (good + sb.encode_command(ss.C_MKFILE, [(ss.A_PATH, b"b")]), "follows END"),
        (good + sb.encode([sb.subvol(b"sv2"), sb.end()])[17:], "second subvolume|follows END"),
    ):
        with pytest.raises(errors.ArtifactCorrupt, match=match):
            ssc.check_stream(io.BytesIO(data), FULL)


def test_command_size_type_and_attributes_are_bounded() -> None:
    head = sb.encode([sb.subvol(b"sv")])
    huge = struct.pack("<IHI", 1 << 30, ss.C_WRITE, 0)  # never read: refused from its header alone
    with pytest.raises(errors.ArtifactCorrupt, match="at most 64 KiB"):
        ssc.check_stream(io.BytesIO(head + huge), FULL)
    refused(full(sb.Cmd(0, [])), match="unknown type 0")
    refused(full(sb.Cmd(23, [(ss.A_PATH, b"a")])), match="unknown type 23")  # v2's FALLOCATE in v1
    refused(full(sb.Cmd(ss.C_MKFILE, [(ss.A_PATH, b"a"), (25, b"x")])), match="unknown attribute 25")
    # btrfs-progs applies the *last* copy of an attribute: a repeated PATH could hide "../x" behind "ok".
    refused(full(sb.Cmd(ss.C_MKFILE, [(ss.A_PATH, b"ok"), (ss.A_PATH, b"../x")])), match="repeats")
    overrun = sb.encode([sb.subvol(b"sv")]) + sb.encode_command(ss.C_MKFILE, []).replace(
        b"\0\0\0\0\x03\0", b"\x06\0\0\0\x03\0", 1
    )
    with pytest.raises(errors.ArtifactCorrupt):
        ssc.check_stream(io.BytesIO(overrun + b"\x0f\0\xff\0ab"), FULL)
    refused(full(sb.Cmd(ss.C_END, [(ss.A_PATH, b"a")])), match="END carries")


# --- refused: paths -----------------------------------------------------------------------------------------
ESCAPING = (b"..", b"../x", b"a/../../x", b"a/..", b"/etc/passwd", b"/", b"a//b", b"./a", b"a/.", b"a\0b",
            b"a/" * 2100)  # fmt: skip


@pytest.mark.parametrize("path", ESCAPING)
def test_escaping_paths_are_refused_in_every_path_attribute(path: bytes) -> None:
    refused(full(sb.mkfile(path)))
    refused(full(sb.write(path, b"x")))
    refused(full(sb.mkfile(b"a"), sb.rename(b"a", path)))
    refused(full(sb.mkfile(b"a"), sb.rename(path, b"a")))
    refused(full(sb.mkfile(b"a"), sb.link(b"b", path)))
    refused(full(sb.mkfile(b"a"), sb.clone(b"a", UUID, path)))
    refused(delta(sb.clone(b"a", PARENT, path)), DELTA)


def test_paths_through_a_symlink_the_stream_made_are_refused() -> None:
    message = refused(full(sb.symlink(b"x", b"/"), sb.mkdir(b"x/etc"), sb.mkfile(b"x/etc/pwned")))
    assert "symlink" in message
    refused(full(sb.symlink(b"x", b"/"), sb.rename(b"x", b"y"), sb.mkfile(b"y/pwned")), match="symlink")
    refused(full(sb.mkdir(b"d"), sb.symlink(b"d/l", b"/"), sb.rename(b"d", b"e"), sb.mkfile(b"e/l/pwned")),
            match="symlink")  # fmt: skip
    refused(full(sb.symlink(b"x", b"/"), sb.link(b"y", b"x"), sb.mkfile(b"y/pwned")), match="symlink")
    refused(full(sb.symlink(b"x", b"/etc"), sb.mkfile(b"a"), sb.rename(b"a", b"x/passwd")), match="symlink")
    refused(full(sb.symlink(b"x", b"/"), sb.mkfile(b"a"), sb.link(b"x/b", b"a")), match="symlink")


def test_clones_read_only_from_this_stream_or_the_expected_parent() -> None:
    assert "neither" in refused(full(sb.mkfile(b"a"), sb.clone(b"a", OTHER, b"secret")))
    refused(delta(sb.clone(b"a", OTHER, b"x")), DELTA, "neither")
    refused(full(sb.mkfile(b"a"), sb.clone(b"a", PARENT, b"x")), match="neither")  # no parent in a full one


def test_only_attribute_changes_may_name_the_subvolume_root() -> None:
    check(full(sb.chmod(b""), sb.Cmd(ss.C_UTIMES, [(ss.A_PATH, b"")])))
    rmdir = sb.Cmd(ss.C_RMDIR, [(ss.A_PATH, b"")])
    for command in (sb.mkfile(b""), sb.unlink(b""), sb.rename(b"", b"x"), rmdir, sb.write(b"", b"x")):
        refused(full(command), match="is empty")


def test_path_attributes_only_where_they_belong_and_symlink_targets_sane() -> None:
    refused(full(sb.Cmd(ss.C_MKFILE, [(ss.A_PATH, b"a"), (ss.A_PATH_TO, b"b")])), match="path attribute")
    refused(full(sb.Cmd(ss.C_MKFILE, [(ss.A_PATH, b"a"), (ss.A_PATH_LINK, b"b")])), match="link target")
    refused(full(sb.symlink(b"l", b"")), match="symlink target")
    refused(full(sb.symlink(b"l", b"a\0b")), match="symlink target")


@pytest.mark.parametrize("kind", [ss.A_CLONE_UUID, ss.A_CLONE_CTRANSID, ss.A_CLONE_OFFSET, ss.A_CLONE_LEN])
def test_clone_attributes_only_on_clone(kind: int) -> None:
    # A clone source on any other command would be forwarded without the CLONE checks.
    value = UUID if kind == ss.A_CLONE_UUID else bytes(8)
    refused(full(sb.Cmd(ss.C_MKFILE, [(ss.A_PATH, b"a"), (kind, value)])), match="clone attribute")


# --- forwarding ---------------------------------------------------------------------------------------------
def test_a_refused_command_is_never_handed_on() -> None:
    bad = sb.mkfile(b"../../etc/pwned")
    data = sb.encode([sb.subvol(b"sv"), sb.mkfile(b"a"), sb.mkfile(b"b"), bad, sb.mkfile(b"c"), sb.end()])
    checked = ssc.CheckedStream(io.BytesIO(data), FULL)
    forwarded = bytearray()
    with pytest.raises(errors.ArtifactCorrupt, match="etc/pwned"):
        for chunk in checked.chunks(chunk_bytes=1):
            forwarded += chunk
    assert forwarded and b"pwned" not in forwarded
    assert forwarded == data[: len(forwarded)]
    # and a good stream is handed on byte for byte
    good = sb.encode(full(sb.mkfile(b"a"), sb.write(b"a", b"x" * 60000)))
    assert b"".join(ssc.CheckedStream(io.BytesIO(good), FULL).chunks(chunk_bytes=4096)) == good


# --- fuzzing ------------------------------------------------------------------------------------------------
def _outcome(data: bytes, expected: ss.Expected) -> ss.StreamHeader | None:
    """The checker's verdict: a header, or None for a typed refusal; anything else fails the test."""
    try:
        return ssc.check_stream(io.BytesIO(data), expected)
    except (errors.ArtifactCorrupt, errors.NotFound):
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes_only_ever_give_typed_errors(data: bytes) -> None:
    assert _outcome(data, FULL) is None
    assert _outcome(ss.MAGIC + struct.pack("<I", 1) + data, DELTA) is None


SEED = sb.encode(
    delta(sb.mkdir(b"d"), sb.mkfile(b"d/f"), sb.write(b"d/f", b"hello"), sb.symlink(b"l", b"/"),
          sb.clone(b"d/f", PARENT, b"usr/f"), sb.rename(b"d/f", b"d/g"))
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(SEED) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, len(SEED)))  # fmt: skip
def test_fuzz_mutated_real_looking_streams_only_ever_give_typed_errors(
    flips: list[tuple[int, int]], cut: int
) -> None:
    data = bytearray(SEED)
    for pos, value in flips:
        data[pos] = value
    _outcome(bytes(data[:cut] if cut else data), DELTA)


PATH_BYTES = st.binary(max_size=24) | st.sampled_from([b"..", b"../x", b"/", b"a/../b", b"x/etc", b"x"])
FUZZ_CMDS = st.sampled_from(
    [ss.C_MKFILE, ss.C_MKDIR, ss.C_SYMLINK, ss.C_RENAME, ss.C_LINK, ss.C_UNLINK, ss.C_WRITE, ss.C_CLONE,
     ss.C_CHMOD, ss.C_SUBVOL, ss.C_END, 0, 99]
)  # fmt: skip
FUZZ_ATTRS = st.lists(
    st.tuples(st.sampled_from([ss.A_PATH, ss.A_PATH_TO, ss.A_PATH_LINK, ss.A_CLONE_PATH, ss.A_CLONE_UUID,
                               ss.A_INO, ss.A_DATA, 0, 40]), PATH_BYTES | st.just(PARENT) | st.just(UUID)),
    max_size=4,
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(FUZZ_CMDS, FUZZ_ATTRS), max_size=8))
def test_fuzz_structured_streams_are_typed_and_what_passes_stays_inside(
    body: list[tuple[int, list[tuple[int, bytes]]]],
) -> None:
    commands = [sb.snapshot(b"sn", PARENT), *(sb.Cmd(c, list(a)) for c, a in body), sb.end()]
    if _outcome(sb.encode(commands), DELTA) is None:
        return
    symlinks: set[bytes] = set()
    for command in commands[1:]:
        for kind, value in command.attrs:
            is_link_content = kind == ss.A_PATH_LINK and command.cmd == ss.C_SYMLINK
            if kind in (ss.A_PATH, ss.A_PATH_TO, ss.A_PATH_LINK, ss.A_CLONE_PATH) and not is_link_content:
                parts = value.split(b"/") if value else []
                assert not value.startswith(b"/") and b".." not in parts and b"\0" not in value
                assert not any(b"/".join(parts[:i]) in symlinks for i in range(1, len(parts)))
            if kind == ss.A_CLONE_UUID:
                assert value in (PARENT, UUID)
        if command.cmd == ss.C_SYMLINK:
            symlinks.add(command.get(ss.A_PATH) or b"")
        if command.cmd in (ss.C_UNLINK, ss.C_RENAME):
            symlinks.discard(command.get(ss.A_PATH) or b"")
