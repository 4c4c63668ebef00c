"""Image archives made in tests with tarfile (no registry, no docker daemon): layers from member lists,
wrapped as a `docker save` tarball or an OCI image layout tarball, with every digest right unless a test
breaks one on purpose."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Entry:
    """One member of a layer: kind is file, dir, symlink, hardlink, chr, fifo."""

    name: str
    kind: str = "file"
    data: bytes = b""
    target: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    declared_size: int | None = None  # a header that lies about its size


def file(name: str, data: bytes = b"x", **kw: Any) -> Entry:
    return Entry(name, "file", data, **kw)


def directory(name: str, **kw: Any) -> Entry:
    return Entry(name, "dir", mode=kw.pop("mode", 0o755), **kw)


def symlink(name: str, target: str) -> Entry:
    return Entry(name, "symlink", target=target, mode=0o777)


def hardlink(name: str, target: str) -> Entry:
    return Entry(name, "hardlink", target=target)


def layer(entries: Iterable[Entry]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.name)
            info.mode, info.uid, info.gid, info.mtime = entry.mode, entry.uid, entry.gid, 1_700_000_000
            payload: io.BytesIO | None = None
            if entry.kind == "file":
                info.type, info.size = tarfile.REGTYPE, len(entry.data)
                payload = io.BytesIO(entry.data)
            elif entry.kind == "dir":
                info.type = tarfile.DIRTYPE
            elif entry.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, entry.target
            elif entry.kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, entry.target
            elif entry.kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            elif entry.kind == "fifo":
                info.type = tarfile.FIFOTYPE
            if entry.declared_size is not None:  # a header claiming more than follows it
                info.size = entry.declared_size
                out.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
                out.write(entry.data + bytes(-len(entry.data) % 512))
                continue
            tar.addfile(info, payload)
    return out.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Image:
    layers: list[bytes]  # uncompressed tars
    config: dict[str, Any] = field(default_factory=lambda: {"config": {}})
    gzip_layers: bool = False

    def full_config(self) -> bytes:
        config = {"architecture": "amd64", "os": "linux", **self.config}
        config["rootfs"] = {"type": "layers", "diff_ids": [f"sha256:{sha(raw)}" for raw in self.layers]}
        return json.dumps(config).encode()

    def blobs(self) -> list[bytes]:
        return [gzip.compress(raw, mtime=0) if self.gzip_layers else raw for raw in self.layers]


def outer(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return out.getvalue()


def docker_save(image: Image, *, layer_names: list[str] | None = None) -> bytes:
    config = image.full_config()
    names = layer_names or [f"{sha(raw)}/layer.tar" for raw in image.layers]
    members = {f"{sha(config)}.json": config}
    for name, blob in zip(names, image.blobs(), strict=True):
        if not name.startswith(".."):
            members[name] = blob
    manifest = [{"Config": f"{sha(config)}.json", "RepoTags": ["test:latest"], "Layers": names}]
    members["manifest.json"] = json.dumps(manifest).encode()
    return outer(members)


def oci_layout(image: Image, *, corrupt_layer: int | None = None) -> bytes:
    config = image.full_config()
    blobs = image.blobs()
    media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if image.gzip_layers else "")
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": f"sha256:{sha(config)}",
                   "size": len(config)},
        "layers": [{"mediaType": media, "digest": f"sha256:{sha(b)}", "size": len(b)} for b in blobs],
    }).encode()  # fmt: skip
    index = json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": f"sha256:{sha(manifest)}", "size": len(manifest)}],
    }).encode()  # fmt: skip
    members = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": index,
               f"blobs/sha256/{sha(manifest)}": manifest, f"blobs/sha256/{sha(config)}": config}  # fmt: skip
    for number, blob in enumerate(blobs):
        stored = blob if number != corrupt_layer else blob[:-1] + bytes([blob[-1] ^ 1])
        members[f"blobs/sha256/{sha(blob)}"] = stored
    return outer(members)
