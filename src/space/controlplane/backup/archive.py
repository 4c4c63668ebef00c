"""The backup archive: a gzip'd tar whose first member is `manifest.json`, then the members it lists.

Invariants:
- The manifest names the archive format and its version, the database engine, the schema revision
  (Alembic) of the dumped database, when and by which SPACE version it was made, and for every other
  member its name, size and SHA-256. Nothing is in the archive that the manifest does not list.
- Reading never trusts the archive: the manifest comes first and is at most `MANIFEST_MAX_BYTES`; every
  member name must match `_NAME` under one of the known prefixes (no absolute path, no `..`, no empty or
  dot component) and be listed exactly once; only regular files are accepted (no links, devices or
  directories); every member is copied with its size bounded by the manifest AND by the limit of its kind
  (`limit_for`) and checked against its SHA-256; a member missing at the end means a truncated archive.
  Each refusal is a typed error (`ArtifactCorrupt` or `TooLarge`, `details.reason` saying which) raised
  before anything is installed: members are only ever written into a private staging directory, by names
  this module built, never by the archive's.
- The SHA-256 sums detect damage (truncation, flipped bits, a member swapped for another); they do not
  authenticate the archive: whoever can write the archive can write its manifest too (and could as well
  read the secrets it holds). The archive is protected like the secrets it holds (ADR 0062).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import re
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import IO, Any, Final

from space.core import errors

FORMAT: Final = "space-controlplane-backup"
FORMAT_VERSION: Final = 1
MANIFEST: Final = "manifest.json"
MANIFEST_MAX_BYTES: Final = 1 << 20
#: A secret file (a key, a token) is a few hundred bytes; a whole MiB is already absurd.
FILE_MAX_BYTES: Final = 1 << 20
#: The database dump. A control plane's rows are records, not data: a database this large is not one.
DATABASE_MAX_BYTES: Final = 64 << 30
MAX_MEMBERS: Final = 10_000
SQLITE_MEMBER: Final = "database/controlplane.db"
POSTGRES_MEMBER: Final = "database/controlplane.pgdump"
ENGINES: Final = {"sqlite": SQLITE_MEMBER, "postgresql": POSTGRES_MEMBER}
_COMPONENT = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
_NAME: Final = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT}){{1,5}}")
_SHA256: Final = re.compile(r"[0-9a-f]{64}")
_CHUNK: Final = 1 << 20


def corrupt(message: str, reason: str, **details: Any) -> errors.ArtifactCorrupt:
    return errors.ArtifactCorrupt(message, reason=reason, **details)


#: The single files a backup may hold (space.controlplane.backup.state says what each is).
FILES: Final = ("files/credentials.master.key", "files/node.token", "files/admin.key")


def valid_name(name: str) -> bool:
    """A member name this module may have written: a database or file of its own, or a relative path under
    `keys/` without `..` or dot-files."""
    if name.startswith("database/"):
        return name in ENGINES.values()
    if name.startswith("files/"):
        return name in FILES
    return bool(_NAME.fullmatch(name)) and name.startswith("keys/") and ".." not in name.split("/")


def limit_for(name: str) -> int:
    return DATABASE_MAX_BYTES if name.startswith("database/") else FILE_MAX_BYTES


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    engine: str
    schema_revision: str
    created_at: str
    space_version: str
    members: tuple[Member, ...]
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT, "format_version": self.format_version, "created_at": self.created_at,
            "engine": self.engine, "schema_revision": self.schema_revision,
            "space_version": self.space_version,
            "members": [dataclasses.asdict(member) for member in self.members],
        }  # fmt: skip
        return json.dumps(body, indent=2).encode() + b"\n"

    @property
    def database_member(self) -> str:
        return ENGINES[self.engine]


def _str_field(body: dict[str, Any], key: str, limit: int = 200) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise corrupt(f"the backup manifest's {key!r} is missing or malformed", "manifest", field=key)
    return value


def _member(entry: Any) -> Member:
    if not isinstance(entry, dict):
        raise corrupt("a member entry of the backup manifest is not an object", "manifest")
    name, size, digest = entry.get("name"), entry.get("size"), entry.get("sha256")
    if not isinstance(name, str) or not valid_name(name):
        raise corrupt(f"the backup manifest lists an unsafe member name {str(name)[:100]!r}", "unsafe_member")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise corrupt(f"the backup manifest gives {name} no valid size", "manifest", member=name)
    if size > limit_for(name):
        raise errors.TooLarge(
            f"backup member {name} is {size} bytes, above the limit of {limit_for(name)}",
            reason="oversized_member", member=name, limit=limit_for(name),
        )  # fmt: skip
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise corrupt(f"the backup manifest gives {name} no valid sha256", "manifest", member=name)
    return Member(name, size, digest)


def parse_manifest(raw: bytes) -> Manifest:
    """The manifest of `raw` (its JSON), every field checked; `ArtifactCorrupt`/`TooLarge` otherwise."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise corrupt(f"the backup manifest is not JSON: {exc}", "manifest") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise corrupt("this is not a SPACE control-plane backup (no manifest of that format)", "manifest")
    version = body.get("format_version")
    if version != FORMAT_VERSION:
        raise corrupt(
            f"backup format version {version!r} is not one this SPACE reads ({FORMAT_VERSION})",
            "format_version", format_version=str(version)[:20],
        )  # fmt: skip
    engine = _str_field(body, "engine")
    if engine not in ENGINES:
        raise corrupt(f"unknown database engine {engine[:40]!r} in the backup manifest", "manifest")
    entries = body.get("members")
    if not isinstance(entries, list) or len(entries) > MAX_MEMBERS:
        raise corrupt("the backup manifest's member list is missing or too long", "manifest")
    members = tuple(_member(entry) for entry in entries)
    names = [member.name for member in members]
    if len(set(names)) != len(names):
        raise corrupt("the backup manifest lists a member twice", "manifest")
    if ENGINES[engine] not in names:
        raise corrupt("the backup manifest lists no database", "manifest")
    return Manifest(
        engine=engine, schema_revision=_str_field(body, "schema_revision", 64),
        created_at=_str_field(body, "created_at", 64), space_version=_str_field(body, "space_version", 64),
        members=members,
    )  # fmt: skip


def sha256_of(path: pathlib.Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def now_utc() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    # Fixed owner and mode: what the archive says about a file's owner means nothing on the restoring
    # machine, and restore never reads it (it sets 0600 itself).
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uid, info.gid = size, 0o600, int(time.time()), 0, 0
    return info


def write_archive(handle: IO[bytes], manifest: Manifest, sources: dict[str, pathlib.Path]) -> None:
    """The archive onto `handle`: the manifest, then each member from its source file (name → path)."""
    with tarfile.open(fileobj=handle, mode="w|gz", format=tarfile.PAX_FORMAT) as tar:
        raw = manifest.to_json()
        tar.addfile(_tarinfo(MANIFEST, len(raw)), io.BytesIO(raw))
        for member in manifest.members:
            with open(sources[member.name], "rb") as source:
                tar.addfile(_tarinfo(member.name, member.size), source)


def _read_bounded(source: IO[bytes], size: int, target: IO[bytes]) -> str:
    """Copy exactly `size` bytes; their SHA-256. Fewer bytes than that is a truncated archive."""
    digest, left = hashlib.sha256(), size
    while left:
        try:
            chunk = source.read(min(_CHUNK, left))
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise corrupt(f"the backup archive is truncated or damaged: {exc}", "truncated") from None
        if not chunk:
            raise corrupt("the backup archive ends inside a member", "truncated")
        digest.update(chunk)
        target.write(chunk)
        left -= len(chunk)
    return digest.hexdigest()


def _entries(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    try:
        yield from tar
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as exc:
        raise corrupt(f"the backup archive is truncated or damaged: {exc}", "truncated") from None


def staged_path(staging: pathlib.Path, index: int) -> pathlib.Path:
    """Where member number `index` of the manifest is staged (a name of ours, never the archive's)."""
    return staging / f"member-{index:05d}"


def _first_manifest(tar: tarfile.TarFile, entries: Iterator[tarfile.TarInfo]) -> Manifest:
    first = next(entries, None)
    if first is None or first.name != MANIFEST or not first.isreg():
        raise corrupt("the backup archive does not start with its manifest", "manifest")
    if first.size > MANIFEST_MAX_BYTES:
        raise errors.TooLarge(
            f"the backup manifest is {first.size} bytes, above {MANIFEST_MAX_BYTES}",
            reason="oversized_member", member=MANIFEST, limit=MANIFEST_MAX_BYTES,
        )  # fmt: skip
    extracted = tar.extractfile(first)
    assert extracted is not None  # a regular file
    buffer = io.BytesIO()
    _read_bounded(extracted, first.size, buffer)
    return parse_manifest(buffer.getvalue())


def read_archive(
    path: pathlib.Path, staging: pathlib.Path, accept: Callable[[Manifest], None] = lambda _m: None
) -> Manifest:
    """Verify the archive at `path` (module invariants), member number i of its manifest staged as
    `staged_path(staging, i)` (0600). `accept` may refuse the manifest before any member is read. Raises
    before returning if anything does not match."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, tarfile streams from it
    except FileNotFoundError:
        raise errors.NotFound(f"no backup archive at {path}") from None
    with handle, _open_stream(handle) as tar:
        entries = _entries(tar)
        manifest = _first_manifest(tar, entries)
        accept(manifest)
        reading = _Reading(tar, manifest, staging)
        for info in entries:
            reading.stage(info)
        missing = sorted(set(reading.index) - reading.seen)
        if missing:
            raise corrupt(f"the backup archive lacks {missing[:3]}", "truncated", missing=missing[:10])
    return manifest


def _open_stream(handle: IO[bytes]) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=handle, mode="r|*")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise corrupt(f"not a readable backup archive: {exc}", "truncated") from None


class _Reading:
    """The members of one archive after its manifest, each checked and staged (module invariants)."""

    def __init__(self, tar: tarfile.TarFile, manifest: Manifest, staging: pathlib.Path) -> None:
        self.tar, self.manifest, self.staging = tar, manifest, staging
        self.index = {member.name: i for i, member in enumerate(manifest.members)}
        self.seen: set[str] = set()

    def stage(self, info: tarfile.TarInfo) -> None:
        name = info.name
        if not valid_name(name):
            raise corrupt(f"unsafe member name {name[:100]!r} in the backup archive", "unsafe_member")
        if not info.isreg():
            raise corrupt(f"backup member {name} is not a regular file", "unsafe_member", member=name)
        if name not in self.index or name in self.seen:
            raise corrupt(f"backup member {name} is unlisted or twice", "unlisted_member", member=name)
        member = self.manifest.members[self.index[name]]
        if info.size != member.size:
            raise corrupt(f"backup member {name} is not the size its manifest says", "checksum", member=name)
        extracted = self.tar.extractfile(info)
        assert extracted is not None
        target = staged_path(self.staging, self.index[name])
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            digest = _read_bounded(extracted, member.size, out)
        if digest != member.sha256:
            raise corrupt(f"backup member {name} does not match its sha256", "checksum", member=name)
        self.seen.add(name)
