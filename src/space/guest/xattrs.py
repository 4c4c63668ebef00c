"""Extended attributes of a path: get, set, list and remove, in the `user.` namespace only.

Invariants:
- Only names starting with "user." are read or written (the trusted., security. and system. namespaces
  carry the kernel's and the runtime's own data: capabilities, ACLs, labels); a name is at most
  MAX_NAME_BYTES bytes of UTF-8 without NUL, a value at most MAX_VALUE_BYTES bytes (the kernel's limit),
  and one path's listing carries at most MAX_LISTED_BYTES bytes of values (more: invalid_argument, and
  an entry of a listing or stat shows "xattrs": null), so an entry always fits in a frame.
- Values travel as base64 (an attribute value is bytes); names as text.
- A filesystem that does not support user attributes (ENOTSUP) answers "not_supported", a missing
  attribute (ENODATA) "not_found", an oversized one (E2BIG, ERANGE, ENOSPC) "invalid_argument" or
  "no_space": typed errors, never an internal one.
- Calls follow symlinks, as getfattr and setfattr do (Linux allows no user attributes on a symlink).
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
from typing import TYPE_CHECKING, Any

from space.guest.channel import Call, GuestError
from space.guest.fileinfo import resolve
from space.guest.params import get_str

if TYPE_CHECKING:
    from space.guest.daemon import Daemon

PREFIX = "user."
MAX_NAME_BYTES = 255
MAX_VALUE_BYTES = 65536
#: Values of one path's listing: with base64 and the entry around it, one entry stays inside a frame.
MAX_LISTED_BYTES = 256 << 10

_ERRNO_CODES = {
    errno.ENOTSUP: "not_supported",
    errno.EOPNOTSUPP: "not_supported",
    errno.ENODATA: "not_found",
    errno.E2BIG: "invalid_argument",
    errno.ERANGE: "invalid_argument",
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
}


def _translated(exc: OSError, path: str) -> Exception:
    code = _ERRNO_CODES.get(exc.errno or 0)
    if code is None:
        return exc  # the channel's own errno map (not_found, permission_denied, ...)
    if code == "not_supported":
        message = f"the filesystem of {path!r} does not support user extended attributes"
    else:
        message = f"{exc.strerror or exc}: {path!r}"
    return GuestError(code, message, errno=exc.errno)


def _name(params: dict[str, Any]) -> str:
    name: str = get_str(params, "name")
    raw = name.encode("utf-8", "surrogatepass")
    if not name.startswith(PREFIX) or len(name) == len(PREFIX):
        raise GuestError("invalid_argument", f"only {PREFIX}* extended attributes may be used, not {name!r}")
    if len(raw) > MAX_NAME_BYTES or "\x00" in name:
        raise GuestError("invalid_argument", f"an attribute name is at most {MAX_NAME_BYTES} bytes, no NUL")
    return name


def _value(params: dict[str, Any]) -> bytes:
    text: str = get_str(params, "value_b64")
    if len(text) > (MAX_VALUE_BYTES + 2) // 3 * 4:
        raise GuestError("invalid_argument", f"an attribute value is at most {MAX_VALUE_BYTES} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise GuestError("invalid_argument", "'value_b64' must be base64") from exc


def read_all(path: str) -> dict[str, str]:
    """Every user. attribute of `path` as {name: value_b64}, at most MAX_LISTED_BYTES of values."""
    found: dict[str, str] = {}
    total = 0
    try:
        for name in sorted(os.listxattr(path)):
            if not name.startswith(PREFIX):
                continue
            try:
                value = os.getxattr(path, name)
            except OSError as exc:
                if exc.errno == errno.ENODATA:
                    continue  # removed meanwhile
                raise
            total += len(value)
            if total > MAX_LISTED_BYTES:
                raise GuestError(
                    "invalid_argument", f"the attributes of {path!r} exceed {MAX_LISTED_BYTES} bytes"
                )
            found[name] = base64.b64encode(value).decode()
    except OSError as exc:
        raise _translated(exc, path) from exc
    return found


def attributes_or_empty(path: str) -> dict[str, str] | None:
    """read_all for entries: a path whose filesystem has no user attributes simply has none; a path whose
    attributes exceed MAX_LISTED_BYTES has None (the listing goes on; files.xattr_get reads each)."""
    try:
        return read_all(path)
    except GuestError as exc:
        if exc.code == "not_supported":
            return {}
        if exc.code == "invalid_argument":
            return None
        raise
    except OSError:
        return {}  # vanished or unreadable meanwhile: the listing goes on


def files_xattr_list(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    return {"xattrs": read_all(resolve(params))}


def files_xattr_get(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path, name = resolve(params), _name(params)
    try:
        value = os.getxattr(path, name)
    except OSError as exc:
        raise _translated(exc, path) from exc
    return {"name": name, "value_b64": base64.b64encode(value).decode()}


def files_xattr_set(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path, name, value = resolve(params), _name(params), _value(params)
    if len(value) > MAX_VALUE_BYTES:
        raise GuestError("invalid_argument", f"an attribute value is at most {MAX_VALUE_BYTES} bytes")
    try:
        os.setxattr(path, name, value)
    except OSError as exc:
        raise _translated(exc, path) from exc
    return {}


def files_xattr_remove(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    path, name = resolve(params), _name(params)
    try:
        os.removexattr(path, name)
    except OSError as exc:
        raise _translated(exc, path) from exc
    return {}
