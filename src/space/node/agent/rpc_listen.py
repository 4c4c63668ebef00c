"""Where the node RPC listens: TCP (host, port) always and, on the machine of its control plane, a unix
socket too, which spares the hop the loopback TCP stack (ADR 0044).

Invariants:
- The unix socket is the agent user's own, mode 0600, by default in `identity/` (0700, the agent's), next
  to the RPC token: only that user and root (the control plane `space up` starts) can connect. Every
  request on it still needs the node token and, for a sandbox, that sandbox's capability, exactly like TCP.
- A socket file that an agent which died left behind is replaced; any other file at the path is refused
  (InvalidArgument), never removed. The path must fit a socket address (MAX_SOCKET_PATH bytes).
- Connections accepted on the TCP listener have TCP_NODELAY (asyncio sets it for a socket whose protocol
  is IPPROTO_TCP), as uvicorn's own listeners do.
- `close_listeners` closes every listener and removes the unix socket's file (only if it is still a socket).
- An idle connection is kept open KEEPALIVE_S, longer than the control plane's pools keep one idle.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import stat

from space.core import errors

#: The longest path a unix socket address holds (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107
#: How long the RPC keeps an idle connection open (uvicorn's keep-alive). Long enough that a sandbox used
#: every few seconds (an agent's usual pace) reuses its connection instead of opening one per request; the
#: control plane's pools drop idle connections a little sooner (node_pools.KEEPALIVE_EXPIRY_S).
KEEPALIVE_S = 65
SOCKET_MODE = 0o600


def default_rpc_socket(data_dir: pathlib.Path) -> pathlib.Path:
    """The agent's unix socket on a one-machine installation: DATA_DIR/identity/rpc.sock."""
    return data_dir / "identity" / "rpc.sock"


def tcp_listener(host: str, port: int) -> socket.socket:
    """A bound TCP socket for the RPC (uvicorn listens on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on connections of a socket that says
    # it is TCP, and without it Nagle holds a small answer back until the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def unix_listener(path: pathlib.Path) -> socket.socket:
    """A bound unix socket at `path`, mode 0600 (module invariants)."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise errors.InvalidArgument(
            f"the RPC socket path {str(path)!r} is longer than {MAX_SOCKET_PATH} bytes", field="listen_socket"
        )
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Bound under a umask that leaves the owner alone, so the file is never open to others, not even
        # between bind() and chmod().
        previous = os.umask(0o177)
        try:
            sock.bind(os.fspath(path))
        finally:
            os.umask(previous)
        os.chmod(path, SOCKET_MODE)
    except OSError:
        sock.close()
        raise
    return sock


def _remove_stale(path: pathlib.Path) -> None:
    try:
        found = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(found.st_mode):
        raise errors.InvalidArgument(
            f"{str(path)!r} exists and is not a socket: not replaced", field="listen_socket"
        )
    path.unlink()


def open_listeners(host: str, port: int, socket_path: pathlib.Path | None) -> list[socket.socket]:
    """The RPC's listeners: TCP on (host, port), and the unix socket at `socket_path` if one is given."""
    listeners = [tcp_listener(host, port)]
    if socket_path is not None:
        try:
            listeners.append(unix_listener(socket_path))
        except BaseException:
            listeners[0].close()
            raise
    return listeners


def close_listeners(listeners: list[socket.socket], socket_path: pathlib.Path | None) -> None:
    for sock in listeners:
        sock.close()
    if socket_path is not None:
        with contextlib.suppress(FileNotFoundError, errors.InvalidArgument):
            _remove_stale(socket_path)
