"""The control plane's kill points, and the full list of kill points of every component.

The mechanism is `space.faults.failpoints` (every component imports it; `SPACE_FAILPOINTS` arms it). This
module adds the control plane's explicitly named points (POINTS: the steps of suspend, restore and
recovery that are not lifecycle transitions) and `all_points()`, the list the crash-injection harness
(tests/crash/test_crash_injection.py) covers, derived from the tables that define the steps:
- the control plane: both sides of the compare-and-swap of every (state, event) of the lifecycle table
  (`Store.transition`), plus POINTS;
- the node agent: before and after every route of its RPC app (space.node.agent.killpoints);
- the root helper: before and after every verb of its verb table (space.node.helper.server);
- the object store: after a part is written and after one is read (space.objectstore.artifacts).
A new transition, route, verb or named point is a new kill point without anyone listing it here.
"""

from __future__ import annotations

from typing import Final

from space.core.lifecycle import TRANSITIONS
from space.faults import failpoints as fault_points
from space.faults.failpoints import transition_points

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


def hit(name: str) -> None:
    """Die here if the kill point `name` is armed (space.faults.failpoints)."""
    fault_points.hit(name)


def control_plane_points() -> list[str]:
    """Every kill point of the control plane process: the lifecycle table's transitions and POINTS."""
    transitions = [(state.value, event.value) for state, event in TRANSITIONS]
    return sorted({*transition_points(transitions), *POINTS})


def all_points() -> dict[str, list[str]]:
    """component -> its kill points, derived from the tables that define the steps (module docstring)."""
    # Imported here: only the harness asks, and the control plane process needs none of these at run time.
    from space.node.agent.app import ROUTERS
    from space.node.agent.killpoints import agent_points
    from space.node.helper.server import helper_points
    from space.objectstore.artifacts import ARTIFACT_POINTS

    return {
        "controlplane": control_plane_points(),
        "agent": agent_points(ROUTERS),
        "helper": helper_points(),
        "objectstore": sorted(ARTIFACT_POINTS),
    }
