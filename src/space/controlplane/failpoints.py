"""Crash injection for tests: named points where a control plane process SIGKILLs itself.

`SPACE_FAILPOINTS="suspend.uploaded,restore.placed"` in a control plane's environment makes it kill itself
(SIGKILL: nothing gets to clean up, exactly like a crash) the first time it reaches one of those points.
Unset (always, outside tests), `hit` is a set lookup and nothing else. The integration tests use it to crash
the control plane at every step of suspend and restore and check that a restart converges
(tests/controlplane/test_controlplane_suspend.py); the points are listed in POINTS so a renamed point fails
those tests instead of silently never firing.
"""

from __future__ import annotations

import os
import signal
from typing import Final

from space.controlplane.settings import ControlPlaneSettings

POINTS: Final = frozenset(
    {
        "suspend.recorded",  # snapshot id + prefix on the sandbox row, no snapshot row yet
        "suspend.row",  # snapshot row with the wrapped data key written, node not called yet
        "suspend.uploaded",  # the node answered (artifact committed), manifest not yet read back
        "suspend.verified",  # snapshot restorable, the node still holds the paused sandbox
        "suspend.marked",  # the record `suspended` (node_id cleared), the node's copy not yet deleted
        "restore.placed",  # target node recorded, node not called yet
        "restore.done",  # the node restored it, the record still `restoring`
        "recover.begun",  # `recovering` recorded with its checkpoint, node not called yet
    }
)

_ARMED: Final = ControlPlaneSettings.from_env(only="failpoints").armed_failpoints


def hit(name: str) -> None:
    """Die here if the failpoint `name` is armed (see module docstring)."""
    if name in _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)
