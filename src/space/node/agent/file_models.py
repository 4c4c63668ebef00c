"""Models of the file calls' richer shapes (node RPC and public data plane alike): entries, listings by
depth, mkdir's answer, moves, extended attributes.

Invariants:
- Extended attributes are named by "attribute" in queries and bodies ("name" already names a credential
  across the API); the daemon's own parameter is "name".
- The shapes are the daemon's (space.protocol.methods documents every field); answers allow fields a newer
  daemon adds, requests reject unknown ones and take numbers strictly (like space.node.agent.rpc_models).
- The bounds here are the daemon's own (space.guest.fileinfo, space.guest.xattrs), checked again at the
  edge so an oversized request is a 422 before it costs a sandbox call: depth 1..16, a listing at most
  50 000 entries, an attribute name "user.*" of at most 255 bytes, a value at most 64 KiB.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_DEPTH = 16
MAX_LIST_ENTRIES = 50_000
XATTR_PREFIX = "user."
#: What a query's attribute name must look like (the full check, bytes and NUL, is check_xattr_name).
XATTR_NAME_PATTERN = r"^user\.[^\x00]+$"
MAX_XATTR_NAME_BYTES = 255
MAX_XATTR_VALUE_BYTES = 65536

_REQUEST = ConfigDict(extra="forbid")
_ANSWER = ConfigDict(extra="allow")


class FileEntry(BaseModel):
    """A file as the daemon describes it (lstat: a symlink is itself, `symlink_target` its text)."""

    model_config = _ANSWER

    name: str
    path: str
    type: str = Field(description='"file", "dir", "symlink" or "other".')
    size: int
    mode: int = Field(description="Permission bits (0o644 = 420).")
    permissions: str | None = Field(default=None, description='As ls shows them: "-rw-r--r--".')
    mtime: float
    modified: str | None = Field(default=None, description="The modification time, ISO 8601 in UTC.")
    uid: int
    gid: int
    owner: str | None = Field(default=None, description="The user name of uid in the sandbox, if any.")
    group: str | None = Field(default=None, description="The group name of gid in the sandbox, if any.")
    target: str | None = Field(default=None, description="A symlink's text (same as symlink_target).")
    symlink_target: str | None = Field(default=None, description="A symlink's text, never resolved.")


class FileListing(BaseModel):
    model_config = _ANSWER

    entries: list[dict[str, Any]]
    truncated: bool = Field(default=False, description="The entry limit cut the listing short.")


class MkdirAnswer(BaseModel):
    model_config = _ANSWER

    created: bool = Field(default=True, description="False: the directory was already there.")
    entry: dict[str, Any] | None = Field(default=None, description="None from a daemon older than ADR 0050.")


class EntryAnswer(BaseModel):
    model_config = _ANSWER

    entry: dict[str, Any] | None = Field(default=None, description="None from a daemon older than ADR 0050.")


class MoveRequest(BaseModel):
    model_config = _REQUEST

    src: str = Field(min_length=1, max_length=4096)
    dst: str = Field(min_length=1, max_length=4096)
    parents: bool = Field(default=False, description="Make the destination's missing parent directories.")


def check_xattr_name(name: str) -> str:
    if not name.startswith(XATTR_PREFIX) or len(name) == len(XATTR_PREFIX):
        raise ValueError(f"only {XATTR_PREFIX}* extended attributes may be used")
    if "\x00" in name or len(name.encode("utf-8", "surrogatepass")) > MAX_XATTR_NAME_BYTES:
        raise ValueError(f"an attribute name is at most {MAX_XATTR_NAME_BYTES} bytes, without NUL")
    return name


class XattrSetRequest(BaseModel):
    model_config = _REQUEST

    path: str = Field(min_length=1, max_length=4096)
    attribute: str = Field(min_length=1, max_length=MAX_XATTR_NAME_BYTES, description='"user.*" only.')
    value_b64: str = Field(max_length=(MAX_XATTR_VALUE_BYTES + 2) // 3 * 4)

    @field_validator("attribute")
    @classmethod
    def _attribute(cls, value: str) -> str:
        return check_xattr_name(value)

    @field_validator("value_b64")
    @classmethod
    def _value(cls, value: str) -> str:
        try:
            decoded = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("value_b64 must be base64") from exc
        if len(decoded) > MAX_XATTR_VALUE_BYTES:
            raise ValueError(f"an attribute value is at most {MAX_XATTR_VALUE_BYTES} bytes")
        return value


class XattrValue(BaseModel):
    model_config = _ANSWER

    name: str
    value_b64: str


class XattrList(BaseModel):
    model_config = _ANSWER

    xattrs: dict[str, str] = Field(description="user.* attribute name -> base64 value.")
