"""Unpacking an OCI image archive into a template's root filesystem: a `docker save` tarball (manifest.json
+ layer tars) or an OCI image layout tarball (oci-layout, index.json, blobs/sha256/...), layers plain, gzip
or zstd, applied in order by space.node.volumes.oci_layer. docs/adr/0056-oci-import-and-template-travel.md.

Invariants:
- The outer archive is a plain tar read by random access; its member names are normalised and unique, and
  a name a manifest gives (a layer, a config, a blob) must be one of them: nothing outside the archive
  is ever read. Symlinks in the outer archive are followed only to a regular member of the archive.
- Every digest is checked: OCI blobs (manifest, config, each layer) against their descriptor before use,
  each layer's uncompressed stream against the config's `rootfs.diff_ids` while it is applied, and a
  `docker save` config against the digest its name carries. A mismatch is InvalidArgument (reason
  `digest_mismatch`) and the caller discards the half-made tree.
- Nothing from the image is ever executed on the host: the python check reads the tree (its
  /usr/bin/python3, resolved inside the image, and the version in its name or stdlib directory).
- The image config becomes template metadata (env, workdir, default_user; Cmd/Entrypoint recorded, never
  run); values that do not fit the template interface are dropped and counted, never guessed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import stat
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO, Protocol, cast

from space.core import errors
from space.node.volumes.oci_layer import (
    BoundedTarInfo,
    Budget,
    LayerWriter,
    clean_path,
    lstat_at,
    open_dir,
    refuse,
    remove_at,
)

MAX_OUTER_MEMBERS = 100_000
MAX_LAYERS = 128
MAX_JSON = 4 << 20
MAX_TRAILER = 16 << 20  # bytes after a layer's end-of-archive blocks (writers pad to a record; not a bomb)
MIN_PYTHON = (3, 9)
GUEST_PYTHON_PARTS = ("usr", "bin", "python3")
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_CONFIG_NAME = re.compile(r"(?:blobs/sha256/)?([0-9a-f]{64})(?:\.json)?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_PYTHON_NAME = re.compile(r"python3\.(\d{1,2})")
MAX_ENV = 64
MAX_ENV_VALUE = 4096
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass
class ImageResult:
    layers: int = 0
    digest: str = ""  # the OCI manifest's digest, or the docker config's
    config: dict[str, Any] = field(default_factory=dict)
    python: str = ""
    python_link_added: bool = False


@dataclass(frozen=True)
class LayerRef:
    member: str
    blob_digest: str | None  # OCI: the compressed blob's digest; docker save: None
    diff_id: str | None


class Outer:
    """The outer archive: members by normalised name, read only through this index."""

    def __init__(self, archive: BinaryIO) -> None:
        try:
            self.tar = tarfile.open(fileobj=archive, mode="r:", tarinfo=BoundedTarInfo)  # noqa: SIM115
        except (tarfile.TarError, RecursionError) as exc:
            raise refuse(f"the archive is not a plain tar file: {exc}", "", "bad_archive") from exc
        self.members: dict[str, tarfile.TarInfo] = {}
        try:
            while (info := self.tar.next()) is not None:
                if len(self.members) >= MAX_OUTER_MEMBERS:
                    raise errors.TooLarge(f"the archive has more than {MAX_OUTER_MEMBERS} members")
                name = "/".join(clean_path(info.name, 4096))
                if name in self.members and not info.isdir():
                    raise refuse(f"the archive holds {name!r} twice", name, "duplicate_entry")
                self.members[name] = info
        except (tarfile.TarError, RecursionError) as exc:
            raise refuse(f"the archive is truncated or corrupt: {exc}", "", "bad_archive") from exc

    def member(self, name: str, hops: int = 0) -> tarfile.TarInfo:
        key = "/".join(clean_path(name, 4096))
        info = self.members.get(key)
        if info is not None and info.issym():
            if hops >= 8 or info.linkname.startswith("/"):
                raise refuse(f"{name[:80]!r} links outside the archive", name, "missing_member")
            parent = key.rpartition("/")[0]
            return self.member("/".join(_normalise(f"{parent}/{info.linkname}")), hops + 1)
        if info is None or not info.isreg():
            raise refuse(f"the archive has no file {name[:80]!r}", name, "missing_member")
        return info

    def has(self, name: str) -> bool:
        return name in self.members

    def open(self, name: str) -> IO[bytes]:
        reader = self.tar.extractfile(self.member(name))
        assert reader is not None
        return reader

    def read_json(self, name: str, digest: str | None = None) -> Any:
        info = self.member(name)
        if info.size > MAX_JSON:
            raise errors.TooLarge(f"{name!r} is larger than {MAX_JSON} bytes")
        data = self.open(name).read()
        if digest is not None and hashlib.sha256(data).hexdigest() != digest:
            raise refuse(f"{name!r} does not match its digest", name, "digest_mismatch")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise refuse(f"{name!r} is not JSON", name, "bad_json") from exc


def _hex(digest: object, what: str) -> str:
    match = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if match is None:
        raise refuse(f"{what} has no sha256 digest", what, "bad_digest")
    return match.group(1)


def _diff_ids(config: dict[str, Any], count: int) -> list[str]:
    rootfs = config.get("rootfs")
    ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(ids, list) or len(ids) != count:
        raise refuse("the image config's rootfs.diff_ids do not match its layers", "config", "bad_config")
    return [_hex(item, "a diff_id") for item in ids]


def _oci_manifest(outer: Outer) -> tuple[dict[str, Any], str]:
    index = outer.read_json("index.json")
    for _ in range(2):  # index.json, then possibly one nested image index
        entries = index.get("manifests") if isinstance(index, dict) else None
        if not isinstance(entries, list) or not entries:
            raise refuse("index.json lists no manifest", "index.json", "bad_manifest")
        chosen = [e for e in entries if isinstance(e, dict) and _platform_ok(e.get("platform"))]
        if len(chosen) != 1:
            raise refuse("the archive must hold exactly one linux/amd64 image", "index.json", "bad_manifest")
        digest = _hex(chosen[0].get("digest"), "a manifest")
        document = outer.read_json(f"blobs/sha256/{digest}", digest)
        if isinstance(document, dict) and isinstance(document.get("layers"), list):
            return document, digest
        index = document
    raise refuse("index.json nests image indexes too deep", "index.json", "bad_manifest")


def _platform_ok(platform: object) -> bool:
    if platform is None:
        return True
    return (
        isinstance(platform, dict)
        and platform.get("os") in (None, "linux")
        and platform.get("architecture") in (None, "amd64")
    )


def read_image(outer: Outer) -> tuple[list[LayerRef], dict[str, Any], str]:
    """The layers (in order), the image config and the image's digest, every reference checked."""
    if outer.has("index.json") and outer.has("oci-layout"):
        manifest, digest = _oci_manifest(outer)
        config_hex = _hex((manifest.get("config") or {}).get("digest"), "the config")
        config = outer.read_json(f"blobs/sha256/{config_hex}", config_hex)
        layers = manifest["layers"]
        if len(layers) > MAX_LAYERS:
            raise errors.TooLarge(f"the image has more than {MAX_LAYERS} layers")
        blobs = [
            _hex(layer.get("digest") if isinstance(layer, dict) else None, "a layer") for layer in layers
        ]
        diff_ids = _diff_ids(config, len(blobs))
        refs = [LayerRef(f"blobs/sha256/{b}", b, d) for b, d in zip(blobs, diff_ids, strict=True)]
        return refs, config, f"sha256:{digest}"
    if outer.has("manifest.json"):
        manifest = outer.read_json("manifest.json")
        if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
            raise refuse("manifest.json must describe exactly one image", "manifest.json", "bad_manifest")
        entry = manifest[0]
        config_name, names = entry.get("Config"), entry.get("Layers")
        if not isinstance(config_name, str) or not isinstance(names, list):
            raise refuse("manifest.json lacks Config or Layers", "manifest.json", "bad_manifest")
        if len(names) > MAX_LAYERS:
            raise errors.TooLarge(f"the image has more than {MAX_LAYERS} layers")
        named = _CONFIG_NAME.fullmatch(config_name)
        config = outer.read_json(config_name, named.group(1) if named else None)
        if not all(isinstance(name, str) for name in names):
            raise refuse("manifest.json names a layer oddly", "manifest.json", "bad_manifest")
        diff_ids = _diff_ids(config, len(names))
        refs = [LayerRef(name, None, d) for name, d in zip(names, diff_ids, strict=True)]
        return refs, config, f"sha256:{named.group(1)}" if named else ""
    raise refuse("neither a docker save nor an OCI layout archive", "", "bad_archive")


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class HashingReader:
    """Reads through `inner`, hashing every byte (the uncompressed layer against its diff_id)."""

    def __init__(self, inner: Readable) -> None:
        self.inner = inner
        self.hash = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size)
        self.hash.update(data)
        return data

    def drain(self) -> str:
        """Hash what follows the tar's end (padding), refusing more than MAX_TRAILER bytes of it."""
        trailer = 0
        while chunk := self.read(1 << 20):
            trailer += len(chunk)
            if trailer > MAX_TRAILER:
                raise refuse(f"a layer carries more than {MAX_TRAILER} bytes after its end", "", "bad_layer")
        return self.hash.hexdigest()


def _decompressed(raw: IO[bytes], head: bytes) -> Readable:
    if head.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head.startswith(ZSTD_MAGIC):
        import zstandard  # only zstd layers need it

        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return raw


def _apply(outer: Outer, ref: LayerRef, writer: LayerWriter) -> None:
    if ref.blob_digest is not None:  # OCI: the blob as stored must be the one the manifest names
        blob = outer.open(ref.member)
        digest = hashlib.sha256()
        while chunk := blob.read(1 << 20):
            digest.update(chunk)
        if digest.hexdigest() != ref.blob_digest:
            raise refuse(f"layer {ref.member!r} does not match its digest", ref.member, "digest_mismatch")
    raw = outer.open(ref.member)
    head = raw.read(4)
    raw.seek(0)
    stream = HashingReader(_decompressed(raw, head))
    try:
        writer.apply(cast(IO[bytes], stream))  # tarfile's streaming mode only calls read()
        actual = stream.drain()
    except (EOFError, OSError, zlib.error) as exc:
        raise refuse(
            f"layer {ref.member!r} is truncated or corrupt: {exc}", ref.member, "corrupt_layer"
        ) from exc
    except errors.SpaceError:
        raise
    except Exception as exc:  # zstandard.ZstdError and the like: a corrupt compressed stream
        raise refuse(
            f"layer {ref.member!r} cannot be decompressed: {exc}", ref.member, "corrupt_layer"
        ) from exc
    if ref.diff_id is not None and actual != ref.diff_id:
        raise refuse(f"layer {ref.member!r} does not match its diff_id", ref.member, "digest_mismatch")


def unpack(archive: BinaryIO, root_fd: int, budget: Budget) -> ImageResult:
    """Apply every layer of the image in `archive` beneath the (empty) directory `root_fd`."""
    outer = Outer(archive)
    try:
        refs, config, digest = read_image(outer)
        for ref in refs:
            _apply(outer, ref, LayerWriter(root_fd, budget))
    finally:
        outer.tar.close()
    result = ImageResult(layers=len(refs), digest=digest, config=config)
    result.python, result.python_link_added = ensure_python(root_fd)
    return result


# -- the image's python and its config ---------------------------------------------------------------------
def _resolve(root_fd: int, parts: tuple[str, ...]) -> tuple[tuple[str, ...], os.stat_result] | None:
    """Follow `parts` inside the image as the sandbox would (absolute links from the image root), by hand;
    None if it leads nowhere."""
    try:
        return _walk(root_fd, parts, 0)
    except (OSError, errors.InvalidArgument, LookupError):
        return None


def _walk(root_fd: int, parts: tuple[str, ...], hops: int) -> tuple[tuple[str, ...], os.stat_result]:
    if hops > 40 or not parts:
        raise LookupError("too many links")
    resolved: tuple[str, ...] = ()
    st: os.stat_result | None = None
    for index, part in enumerate(parts):
        with open_dir(root_fd, resolved, create=False, name="/".join(parts)) as fd:
            st = lstat_at(fd, part)
            if st is None:
                raise LookupError(part)
            if stat.S_ISLNK(st.st_mode):
                link = os.readlink(part, dir_fd=fd)
                base = () if link.startswith("/") else resolved
                return _walk(root_fd, _normalise("/".join((*base, link, *parts[index + 1 :]))), hops + 1)
        resolved = (*resolved, part)
    assert st is not None
    return resolved, st


def _normalise(path: str) -> tuple[str, ...]:
    out: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if out:
                out.pop()
            continue
        out.append(part)
    return tuple(out)


def _python_version(root_fd: int, resolved: tuple[str, ...]) -> tuple[int, int] | None:
    named = _PYTHON_NAME.fullmatch(resolved[-1])
    if named is not None:
        return 3, int(named.group(1))
    found = []
    for lib in (("usr", "lib"), ("usr", "local", "lib")):
        try:
            with open_dir(root_fd, lib, create=False, name="/".join(lib)) as fd:
                found += [int(m.group(1)) for m in map(_PYTHON_NAME.fullmatch, os.listdir(fd)) if m]
        except (OSError, errors.InvalidArgument):
            continue
    return (3, max(found)) if found else None


def ensure_python(root_fd: int) -> tuple[str, bool]:
    """The image's python3 version ("3.11"); links /usr/bin/python3 to /usr/local/bin/python3 when only
    the latter exists (the official python images). Refuses an image without a usable python3."""
    added = False
    found = _resolve(root_fd, GUEST_PYTHON_PARTS)
    if found is None and _resolve(root_fd, ("usr", "local", "bin", "python3")) is not None:
        with open_dir(root_fd, GUEST_PYTHON_PARTS[:-1], create=True, name="usr/bin") as fd:
            remove_at(fd, "python3")
            os.symlink("/usr/local/bin/python3", "python3", dir_fd=fd)
        added, found = True, _resolve(root_fd, GUEST_PYTHON_PARTS)
    fix = "install python3 (>= 3.9) in the image (e.g. `apt-get install -y python3` in its Dockerfile)"
    if found is None or not stat.S_ISREG(found[1].st_mode) or not found[1].st_mode & 0o111:
        raise errors.InvalidArgument(
            f"the image has no /usr/bin/python3, which SPACE's in-sandbox daemon runs on: {fix}",
            field="image", reason="no_python",
        )  # fmt: skip
    version = _python_version(root_fd, found[0])
    if version is None or version < MIN_PYTHON:
        shown = "unknown" if version is None else f"{version[0]}.{version[1]}"
        raise errors.InvalidArgument(
            f"the image's python3 is {shown}; SPACE's daemon needs >= 3.9: {fix}",
            field="image", reason="old_python",
        )  # fmt: skip
    return f"{version[0]}.{version[1]}", added


def config_metadata(config: dict[str, Any]) -> dict[str, Any]:
    """Template metadata from the image config: env, workdir, default_user; Cmd/Entrypoint recorded."""
    inner = config.get("config") if isinstance(config.get("config"), dict) else {}
    assert isinstance(inner, dict)
    env: dict[str, str] = {}
    dropped = 0
    for item in inner.get("Env") or []:
        key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
        if (
            sep
            and _ENV_KEY.fullmatch(key)
            and "\x00" not in value
            and len(value) <= MAX_ENV_VALUE
            and (len(env) < MAX_ENV or key in env)
        ):
            env[key] = value
        else:
            dropped += 1
    workdir = inner.get("WorkingDir")
    user = inner.get("User")
    name = user.split(":", 1)[0] if isinstance(user, str) else ""
    meta: dict[str, Any] = {
        "env": env,
        "workdir": workdir if isinstance(workdir, str) and _is_clean_abs(workdir) else None,
        "default_user": name if _USER.fullmatch(name) and name != "root" else None,
        "image_user": user if isinstance(user, str) and len(user) <= 64 else None,
        "image_cmd": _argv(inner.get("Cmd")),
        "image_entrypoint": _argv(inner.get("Entrypoint")),
    }
    if dropped:
        meta["env_dropped"] = dropped
    return meta


def _is_clean_abs(path: str) -> bool:
    return (
        path.startswith("/")
        and len(path) <= 1024
        and "\x00" not in path
        and "/".join(("", *_normalise(path))) in (path.rstrip("/") or "/", path)
    )


def _argv(value: object) -> list[str] | None:
    if not isinstance(value, list) or len(value) > 64:
        return None
    items = [item[:4096] for item in value if isinstance(item, str)]
    return items if len(items) == len(value) else None
