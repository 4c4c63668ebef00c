"""spaced's settings: every environment variable the daemon reads, read here and nowhere else.

    variable            default   meaning
    SPACED_WORKDIR      /work     what relative paths (files.*, a process's "cwd") resolve against, and a
                                  process's default cwd (the template's `workdir`, ADR 0057; the fake
                                  driver points it elsewhere)
    SPACED_USER         (unset)   the user (name or uid) a process runs as and a written file belongs to
                                  when the call names none (the template's `default_user`, ADR 0057);
                                  unset: root, the daemon's own user
    SPACED_SUDO_SOCKET  space-sudo  the abstract unix socket name of the default user's sudo service
                                  (space.guest.sudo); only tests running daemons side by side change it
    SPACED_LOG          (unset)   a file for the daemon's diagnostics (its fd 2); unset: /dev/null
    SPACED_REAP_ALL     (unset)   "1": reap every child with waitpid(-1) and become a child subreaper, as
                                  spaced does anyway when it is PID 1
    SPACED_WATCH_POLL   (unset)   "1": files.watch polls instead of using inotify (tests of the fallback)
    SPACED_CHANNEL      (unset)   a device to speak the channel on instead of stdin/stdout (the microVM's
                                  virtio serial port, e.g. /dev/vport1p1: ADR 0068)

Invariants:
- The settings are read once, when spaced starts (this module's first import); a later change of the
  daemon's environment (sys.configure) reaches the processes it starts, never these settings.
- SPACED_* variables are the daemon's own: `inherited_environment` never passes one to a process, nor
  PYTHONPATH (which points at spaced's code, not the workload's).
- Standard library only, and cheap to import (a NamedTuple: importing dataclasses costs spaced boot time).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

OWN_PREFIX = "SPACED_"
NOT_INHERITED = frozenset({"PYTHONPATH"})


class GuestSettings(NamedTuple):
    workdir: str = "/work"
    log_path: str | None = None
    reap_all: bool = False
    watch_poll: bool = False
    user: str | None = None
    sudo_socket: str = "space-sudo"
    channel: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> GuestSettings:
        return cls(
            workdir=environ.get("SPACED_WORKDIR", "/work"),
            log_path=environ.get("SPACED_LOG") or None,
            reap_all=environ.get("SPACED_REAP_ALL") == "1",
            watch_poll=environ.get("SPACED_WATCH_POLL") == "1",
            user=environ.get("SPACED_USER") or None,
            sudo_socket=environ.get("SPACED_SUDO_SOCKET") or "space-sudo",
            channel=environ.get("SPACED_CHANNEL") or None,
        )


SETTINGS = GuestSettings.from_environ(os.environ)


def inherited_environment() -> dict[str, str]:
    """The daemon's current environment as its processes inherit it (without its own variables)."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(OWN_PREFIX) and key not in NOT_INHERITED
    }
