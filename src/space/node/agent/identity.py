"""The node's credentials towards the control plane (ADR 0021, superseding parts of ADR 0019): its own RPC
token, and its identity (node id + per-node secret) issued at enrolment.

    DATA_DIR/identity/rpc.token   the secret the control plane must present on this node's RPC
    DATA_DIR/identity/node.json   {"node_id", "identity"} from this node's enrolment

Invariants:
- Both files are 0600 in a 0700 directory owned by the agent's user (the root helper's node.prepare makes the
  directory on a runsc node, which the agent cannot create under the root-owned data directory); a file
  that others can read is refused at start, never used. Secrets never reach a log.
- The RPC token is generated at the node's first start and kept: the control plane stores it (sealed) at
  each registration and is the only other holder. The cluster's bootstrap token is never an RPC token.
- The identity is kept across restarts: a restarted node re-registers WITH it and keeps its node id; the
  bootstrap (or a single-use enrolment) token is needed only when the node has no identity the control
  plane accepts. `node_id` and `secret` change together (`set`), and are written to disk before they are
  used, so nobody sends one registration's id with another's secret and a crash never loses an identity
  the control plane already holds.
- The RPC's TLS key (`check_tls_files`, ADR 0079 "TLS to nodes") is like these: a key others can read
  is refused before the agent starts, and a certificate is never served without its key.
- Everything after registration (heartbeats, credential fetches, audit posts) authenticates with
  `IdentityAuth`, which reads the CURRENT secret per request, so a new enrolment takes effect in every
  client at once, without rebuilding any of them.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Final

import httpx

from space.core import errors
from space.crypto.keys import write_private_file

IDENTITY_DIR: Final = "identity"
RPC_TOKEN_FILE: Final = "rpc.token"  # noqa: S105 - a file name
IDENTITY_FILE: Final = "node.json"
MIN_TOKEN_LENGTH: Final = 16  # an operator-supplied RPC token shorter than this is refused


def identity_dir(data_dir: pathlib.Path) -> pathlib.Path:
    return data_dir / IDENTITY_DIR


def default_rpc_token_file(data_dir: pathlib.Path) -> pathlib.Path:
    return identity_dir(data_dir) / RPC_TOKEN_FILE


def default_identity_file(data_dir: pathlib.Path) -> pathlib.Path:
    return identity_dir(data_dir) / IDENTITY_FILE


def _ensure_private_dir(directory: pathlib.Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise errors.Unavailable(
            f"the node's identity directory {directory} cannot be created by this user ({exc}); "
            "create it owned by the agent's user, mode 0700 (the node helper's node.prepare does)"
        ) from exc


def read_private(path: pathlib.Path) -> str | None:
    """The stripped text of a secret file, None if it does not exist; PermissionDenied if others may read
    it (a leaked secret is not used: the operator fixes the mode, or removes the file to get a new one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise errors.PermissionDenied(f"cannot read the node secret {path}: {exc}") from exc
    with os.fdopen(fd, "r", encoding="utf-8") as handle:
        if os.fstat(handle.fileno()).st_mode & 0o077:
            raise errors.PermissionDenied(f"the node secret {path} is readable by others: chmod 0600 it")
        return handle.read().strip()


def check_tls_files(cert: str | None, key: str | None) -> bool:
    """Whether the RPC serves TLS: both files given, existing, the key owner-only (True), or neither (False).
    InvalidArgument for a certificate without its key (or a key without its certificate) or a missing
    file, PermissionDenied for a key others may read: checked before anything starts."""
    if cert is None and key is None:
        return False
    if cert is None or key is None:
        raise errors.InvalidArgument(
            "the node's RPC TLS needs both a certificate and its key (tls_cert and tls_key)", field="tls_key"
        )
    for what, path in (("certificate", cert), ("key", key)):
        if not pathlib.Path(path).is_file():
            raise errors.InvalidArgument(f"the node's TLS {what} {path} does not exist", field="tls")
    if os.stat(key).st_mode & 0o077:
        raise errors.PermissionDenied(f"the node's TLS key {key} is readable by others: chmod 0600 it")
    return True


def load_or_create_rpc_token(path: pathlib.Path) -> str:
    """This node's RPC token: the one in `path`, else a new random one written there (0600) first."""
    token = read_private(path)
    if token is None:
        _ensure_private_dir(path.parent)
        fresh = secrets.token_urlsafe(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:  # another start raced us: use its token
            token = read_private(path)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(fresh + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            token = fresh
    if not token or len(token) < MIN_TOKEN_LENGTH:
        raise errors.InvalidArgument(
            f"the node's RPC token in {path} must be at least {MIN_TOKEN_LENGTH} characters",
            field="rpc_token",
        )
    return token


@dataclass
class NodeIdentity:
    node_id: str | None = None
    secret: str | None = field(default=None, repr=False)
    #: Where `set` persists the identity (None: memory only, for tests of the logic above it).
    path: pathlib.Path | None = None

    @classmethod
    def load(cls, path: pathlib.Path) -> NodeIdentity:
        """The identity persisted in `path` (an empty one, persisting there, if the node never enrolled)."""
        raw = read_private(path)
        if not raw:
            return cls(path=path)
        try:
            data = json.loads(raw)
            node_id, secret = str(data["node_id"]), str(data["identity"])
        except (ValueError, KeyError, TypeError) as exc:
            raise errors.InvalidArgument(
                f"the node identity file {path} is malformed; remove it to enrol this node anew"
            ) from exc
        made = cls(path=path)
        made._assign(node_id, secret)
        return made

    def _assign(self, node_id: str, secret: str) -> None:
        if not node_id or not secret:
            raise ValueError("a node identity needs a node id and a secret")
        self.node_id, self.secret = node_id, secret

    def set(self, node_id: str, secret: str) -> None:
        """Adopt the identity of a new enrolment, on disk first (a crash after the control plane answered
        must not leave a node whose identity only the control plane knows in memory of a dead process)."""
        if not node_id or not secret:
            raise ValueError("a node identity needs a node id and a secret")
        if self.path is not None:
            _ensure_private_dir(self.path.parent)
            payload = json.dumps({"node_id": node_id, "identity": secret}).encode()
            write_private_file(self.path, payload)
        self._assign(node_id, secret)

    @property
    def enrolled(self) -> bool:
        return self.node_id is not None and self.secret is not None

    def current_node_id(self) -> str | None:
        """For space.node.agent.credential_manager's `NodeIdProvider`."""
        return self.node_id


class IdentityAuth(httpx.Auth):
    """httpx authentication with the node's current identity: `Authorization: Bearer <secret>`."""

    def __init__(self, identity: NodeIdentity) -> None:
        self._identity = identity

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        secret = self._identity.secret
        if secret is not None:
            request.headers["Authorization"] = f"Bearer {secret}"
        yield request
