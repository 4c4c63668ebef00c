"""An artifact's manifest: its records, its JSON form, and how a read-back manifest is checked.

Layout under a prefix P (see docs/adr/0010-object-storage-artifacts.md):
    P/parts/<entry#>/<part#>   one stored part (space.objectstore.parts)
    P/manifest.json            written LAST; lists every entry and part with sha256 and sizes

Invariants:
- The manifest document is {"manifest": body, "sha256": sha256 of the canonical body, "mac": ...}, with
  exactly these keys; the canonical body is sorted-key, compact, ASCII JSON, and a manifest that does not
  round-trip to the same canonical body is refused, so what was checked is exactly what is used (every
  single flipped bit of a stored manifest is refused here or, in an encrypted artifact's mac, by
  `authenticate`: tests/fuzz/test_fuzz_parsers.py).
- Parsing never trusts the document: a checksum mismatch, an unknown format, compression or encryption,
  a manifest of another prefix, a part outside `P/parts/`, impossible sizes, or any malformed field is
  errors.ArtifactCorrupt (with a `reason`); a missing manifest is errors.NotFound ("not restorable").
- With a data key, the manifest carries an HMAC (purpose MAC_PURPOSE) over the canonical body under a key
  derived from the data key; `authenticate` refuses an altered manifest, and refuses a manifest claiming to
  be unencrypted when the reader holds a data key (no downgrade).
- Prefixes and entry names are object keys (base.validate_key): they cannot contain "|", which keeps the
  parts' AAD encoding unambiguous.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from space.core import errors
from space.crypto.envelope import check_key, mac_matches
from space.objectstore.base import ObjectStore, validate_key

FORMAT = "space-artifact/1"
MANIFEST_NAME = "manifest.json"
ENCRYPTION_ALGORITHM = "AES-256-GCM"
COMPRESSIONS = ("zstd", "none")
MIN_PART_SIZE = 1
MAX_PART_SIZE = 256 << 20
MAC_PURPOSE = "space-artifact-manifest-v1"
DOCUMENT_KEYS = frozenset({"manifest", "sha256", "mac"})


@dataclass(frozen=True)
class PartRef:
    key: str  # object key of the stored part
    sha256: str  # of the stored bytes (after compression and encryption)
    stored_size: int
    size: int  # raw bytes this part contributes to the entry


@dataclass(frozen=True)
class Entry:
    size: int
    parts: tuple[PartRef, ...]


@dataclass(frozen=True)
class Encryption:
    key_id: str
    wrapped: bytes  # the data key wrapped by the tenant key (opaque to us)
    algorithm: str = ENCRYPTION_ALGORITHM

    @property
    def wrapped_b64(self) -> str:
        return base64.b64encode(self.wrapped).decode()


@dataclass
class Manifest:
    prefix: str
    created_at: datetime
    metadata: dict[str, Any]
    compression: str
    encryption: Encryption | None
    entries: dict[str, Entry]
    total_stored_bytes: int
    mac: str | None = field(default=None, repr=False)

    def body(self) -> dict[str, Any]:
        """The authenticated content, as it is serialized (without the mac)."""
        return {
            "format": FORMAT,
            "prefix": self.prefix,
            "created_at": self.created_at.isoformat(),
            "metadata": self.metadata,
            "compression": self.compression,
            "encryption": None
            if self.encryption is None
            else {
                "algorithm": self.encryption.algorithm,
                "key_id": self.encryption.key_id,
                "wrapped": self.encryption.wrapped_b64,
            },
            "entries": {
                name: {
                    "size": entry.size,
                    "parts": [
                        {"key": p.key, "sha256": p.sha256, "stored_size": p.stored_size, "size": p.size}
                        for p in entry.parts
                    ],
                }
                for name, entry in self.entries.items()
            },
            "total_stored_bytes": self.total_stored_bytes,
        }

    def canonical_body(self) -> bytes:
        return canonical(self.body())

    def to_bytes(self) -> bytes:
        body = self.body()
        document = {"manifest": body, "sha256": hashlib.sha256(canonical(body)).hexdigest(), "mac": self.mac}
        return json.dumps(document, sort_keys=True, indent=1).encode()

    @property
    def encrypted(self) -> bool:
        return self.encryption is not None


def manifest_key(prefix: str) -> str:
    return f"{check_prefix(prefix)}/{MANIFEST_NAME}"


def parts_prefix(prefix: str) -> str:
    return f"{prefix}/parts/"


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def check_prefix(prefix: str) -> str:
    try:
        return validate_key(prefix.rstrip("/") if isinstance(prefix, str) else prefix)
    except errors.InvalidArgument as exc:
        raise errors.InvalidArgument(f"invalid artifact prefix {prefix!r}", prefix=str(prefix)) from exc


def check_entry_name(name: str) -> str:
    try:
        return validate_key(name)
    except errors.InvalidArgument as exc:
        raise errors.InvalidArgument(
            f"invalid artifact entry name {name!r}: use [A-Za-z0-9._-] segments separated by '/'",
            entry=str(name),
        ) from exc


def corrupt(prefix: str, part: str, reason: str, message: str) -> errors.ArtifactCorrupt:
    return errors.ArtifactCorrupt(f"artifact {prefix!r}: {message}", prefix=prefix, part=part, reason=reason)


# --- parsing ---------------------------------------------------------------------------------------------


def parse_manifest(prefix: str, key: str, raw: bytes) -> Manifest:
    """The manifest stored at `key` for the artifact under `prefix`, checked (see the module's invariants)."""
    try:
        document = json.loads(raw)
        body = document["manifest"]
        _check_document(prefix, key, document, body)
        encryption = _parse_encryption(body["encryption"])
        entries = _parse_entries(prefix, key, body["entries"])
        manifest = Manifest(
            prefix=prefix,
            created_at=datetime.fromisoformat(body["created_at"]),
            metadata=dict(body["metadata"]),
            compression=str(body["compression"]),
            encryption=encryption,
            entries=entries,
            total_stored_bytes=int(body["total_stored_bytes"]),
            mac=document.get("mac"),
        )
        _check_algorithms(prefix, key, manifest)
        # Nothing outside the checked body may vary either: a flipped bit in a key of the document itself
        # ("mac" -> "mbc") would otherwise pass unnoticed.
        if set(document) != DOCUMENT_KEYS:
            raise corrupt(prefix, key, "malformed", "manifest document has unexpected fields")
        if manifest.canonical_body() != canonical(body):
            raise corrupt(prefix, key, "malformed", "manifest does not round-trip")
        return manifest
    except errors.ArtifactCorrupt:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise corrupt(prefix, key, "malformed", f"manifest is malformed ({type(exc).__name__})") from exc


def _check_document(prefix: str, key: str, document: dict[str, Any], body: dict[str, Any]) -> None:
    if hashlib.sha256(canonical(body)).hexdigest() != document["sha256"]:
        raise corrupt(prefix, key, "checksum_mismatch", "manifest checksum does not match")
    if body["format"] != FORMAT:
        raise corrupt(prefix, key, "unknown_format", f"unknown manifest format {body['format']!r}")
    if body["prefix"] != prefix:
        raise corrupt(prefix, key, "wrong_prefix", f"manifest belongs to {body['prefix']!r}")


def _parse_encryption(enc: dict[str, Any] | None) -> Encryption | None:
    if enc is None:
        return None
    return Encryption(
        key_id=str(enc["key_id"]),
        wrapped=base64.b64decode(enc["wrapped"], validate=True),
        algorithm=str(enc["algorithm"]),
    )


def _parse_entries(prefix: str, key: str, items: dict[str, Any]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for name, item in items.items():
        parts = tuple(
            PartRef(str(p["key"]), str(p["sha256"]), int(p["stored_size"]), int(p["size"]))
            for p in item["parts"]
        )
        for part in parts:
            if not part.key.startswith(parts_prefix(prefix)):
                raise corrupt(prefix, key, "foreign_part", f"part {part.key!r} is outside the artifact")
            if not MIN_PART_SIZE <= part.size <= MAX_PART_SIZE or part.stored_size < 0:
                raise corrupt(prefix, key, "size_mismatch", f"part {part.key!r} has an impossible size")
        if sum(p.size for p in parts) != int(item["size"]):
            raise corrupt(prefix, key, "size_mismatch", f"entry {name!r} sizes do not add up")
        entries[str(name)] = Entry(size=int(item["size"]), parts=parts)
    return entries


def _check_algorithms(prefix: str, key: str, manifest: Manifest) -> None:
    if manifest.compression not in COMPRESSIONS:
        raise corrupt(prefix, key, "unknown_compression", f"unknown compression {manifest.compression!r}")
    encryption = manifest.encryption
    if encryption is not None and encryption.algorithm != ENCRYPTION_ALGORITHM:
        raise corrupt(prefix, key, "unknown_encryption", f"unknown encryption {encryption.algorithm!r}")


# --- reading and authenticating ----------------------------------------------------------------------------


def read_manifest(store: ObjectStore, prefix: str) -> Manifest:
    """The artifact's manifest; errors.NotFound ("not restorable") when there is none."""
    prefix = check_prefix(prefix)
    key = manifest_key(prefix)
    try:
        raw = store.get(key)
    except errors.NotFound as exc:
        raise errors.NotFound(
            f"artifact {prefix!r} is not restorable: it has no manifest", prefix=prefix
        ) from exc
    return parse_manifest(prefix, key, raw)


def restorable(store: ObjectStore, prefix: str) -> bool:
    """True when a well-formed manifest exists (a corrupt manifest raises ArtifactCorrupt, not False)."""
    try:
        read_manifest(store, prefix)
    except errors.NotFound:
        return False
    return True


def authenticate(manifest: Manifest, data_key: bytes | None) -> None:
    """Check the manifest's HMAC under `data_key`; refuse an unencrypted manifest when a key is given."""
    key = manifest_key(manifest.prefix)
    if manifest.encryption is None:
        if data_key is not None:
            raise corrupt(
                manifest.prefix,
                key,
                "unexpected_plaintext",
                "a data key was given but the manifest says "
                "the artifact is not encrypted (refusing a possible downgrade)",
            )
        return
    if data_key is None:
        raise errors.InvalidArgument(
            f"artifact {manifest.prefix!r} is encrypted: a data key is required", prefix=manifest.prefix
        )
    check_key(data_key)
    if manifest.mac is None or not mac_matches(
        data_key, MAC_PURPOSE, manifest.canonical_body(), manifest.mac
    ):
        raise corrupt(
            manifest.prefix,
            key,
            "manifest_authentication_failed",
            "manifest failed authentication (altered, or this is not the artifact's data key)",
        )
