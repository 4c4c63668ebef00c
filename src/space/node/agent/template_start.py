"""A template's start command (`start_cmd` in its metadata, docs/adr/0054-template-build.md): what the node
starts in every new sandbox of the template before handing it out.

Invariants:
- It runs through the sandbox's daemon as a background process naming no user, cwd or env of its own, so it
  gets the template's defaults (default_user, workdir, env: the daemon's settings, ADR 0057); it runs in a
  session of its own (as every daemon process does), stdin /dev/null, its stdout and stderr appended to
  the driver's `start_log` inside the sandbox (default /tmp/space-start.log), never held in the daemon's
  output buffer (a chatty server would fill it and block).
- It is started where the sandbox boots cold: the create that boots it and the boot that makes the
  template's warm start. The warm start is taken only after the command exited or START_SETTLE_S passed
  (whichever first), so sandboxes restored from it, pooled ones included, hold what it started
  (a command that starts a server and exits: the server; a command that is the server: itself).
- A template build's own sandbox never runs its base's start command (what it would start or write must not
  end up in the committed tree).
- Its failure (the daemon refusing to start it, or a non-zero exit seen while settling) is logged and
  returned to the caller to record; it never fails the create.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import time

from space.core import errors
from space.node.agent.guest import GuestSession

log = logging.getLogger("space.node.agent.agent")

#: The daemon process tag of a start command (visible in the sandbox's process list).
START_TAG = "space-start"
#: A warm start waits at most this long for the start command to exit before it is taken.
START_SETTLE_S = 30.0
#: How often a settling start command's state is asked.
SETTLE_POLL_S = 0.2


def wrapped(start_cmd: str, log_path: str) -> list[str]:
    """The argv that runs `start_cmd` under /bin/sh with its output appended to `log_path`."""
    return ["/bin/sh", "-c", f"exec >>{shlex.quote(log_path)} 2>&1 </dev/null\n{start_cmd}"]


async def start(
    session: GuestSession, template: str, start_cmd: str, log_path: str
) -> tuple[str | None, str | None]:
    """Start `start_cmd` in the sandbox of `session`: (process id, None), or (None, why) when the daemon
    refused to start it (logged)."""
    try:
        started = await session.start_background(wrapped(start_cmd, log_path), tag=START_TAG)
    except errors.SpaceError as exc:
        log.warning("template %s: its start command did not start: %s", template, exc.message)
        return None, exc.message
    return str(started["process_id"]), None


async def settle(
    session: GuestSession, template: str, process_id: str, wait_s: float = START_SETTLE_S
) -> str | None:
    """Wait until the start command exited or `wait_s` passed; a failure (non-zero exit, signal) as text
    (logged), None otherwise (exited 0, or still running: a server)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = [p for p in await session.processes() if p.get("process_id") == process_id]
        if not found:
            return None  # already dropped from the daemon's table: nothing more to know
        if found[0].get("running"):
            await asyncio.sleep(SETTLE_POLL_S)
            continue
        if found[0].get("exit_code") == 0:
            return None
        why = f"exited with {found[0].get('exit_code')} (signal {found[0].get('signal')})"
        log.warning("template %s: its start command %s", template, why)
        return why
    log.info("template %s: its start command still runs after %.0f s (kept running)", template, wait_s)
    return None
