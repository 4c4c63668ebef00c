"""SPACE's sandbox records as E2B's answers (`Sandbox`, `SandboxDetail`, `ListedSandbox`), and E2B's
two-state view of SPACE's lifecycle.

Invariants:
- Field names and required keys are those of E2B's generated models (e2b.api.client.models); the tests
  round-trip every answer through `Model.from_dict`.
- E2B sees `running` or `paused`: a sandbox that is paused, stopped or suspended, or on its way there, is
  `paused`; every other live sandbox is `running` (including one being created, resumed or recovered: it
  will run without being asked). A deleted sandbox, or one wished deleted, is not shown at all.
- Times are RFC 3339 in UTC with microseconds (E2B's `startedAfter` filter compares at that precision).
- `envdAccessToken` (and `trafficAccessToken`, the same token: ADR 0058) is only in answers to keys that may
  change the sandbox (access.py).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

from space.controlplane.api.deps import Principal
from space.controlplane.e2b.access import envd_access_token
from space.controlplane.store.records import SandboxRecord
from space.core.lifecycle import State

#: The envd protocol version the in-sandbox front speaks (E2B's SDK gates features on it).
ENVD_VERSION = "0.6.13"
#: E2B requires a client id in every sandbox answer; it means nothing (E2B answers a constant too).
CLIENT_ID = "space"
#: E2B's template name for its default image, which is SPACE's built-in `base` (user `user` in /home/user
#: with passwordless sudo: ADR 0057), and SPACE's own default template.
E2B_DEFAULT_TEMPLATE = "base"
SPACE_DEFAULT_TEMPLATE = "python"
#: A sandbox without a deadline still needs an `endAt` (a required field): this far after its start.
NO_DEADLINE = timedelta(days=3650)

_PAUSED_STATES = frozenset(
    {State.PAUSED, State.PAUSING, State.STOPPED, State.STOPPING, State.SUSPENDED, State.SUSPENDING}
)
_GONE = frozenset({State.DELETED, State.DELETING})
#: The SPACE states E2B's `state` filter selects (by the recorded state; `e2b_state` also looks at the wish).
SPACE_STATES_OF: dict[str, tuple[State, ...]] = {
    "paused": tuple(sorted(_PAUSED_STATES)),
    "running": tuple(sorted(set(State) - _PAUSED_STATES - _GONE)),
}


#: E2B template names that are another name on SPACE: the code interpreter SDK's default template is the
#: `code-interpreter` template (ADR 0058).
E2B_ALIASES = {"code-interpreter-v1": "code-interpreter"}


def space_template(template_id: str) -> str:
    """The SPACE template an E2B template id names: the same name (E2B's `base` is SPACE's `base`), but
    for E2B_ALIASES."""
    return E2B_ALIASES.get(template_id, template_id)


def visible(sb: SandboxRecord) -> bool:
    """Whether E2B's view shows the sandbox (not deleted, not being deleted, not wished deleted)."""
    return sb.state not in _GONE and sb.desired_state not in _GONE


def e2b_state(sb: SandboxRecord) -> str:
    if sb.state in _PAUSED_STATES or sb.desired_state in (State.PAUSED, State.STOPPED, State.SUSPENDED):
        return "paused"
    return "running"


def rfc3339(value: datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def end_at(sb: SandboxRecord) -> datetime:
    expires = sb.expires_at
    return expires if expires is not None else sb.created_at + NO_DEADLINE


def metadata_of(sb: SandboxRecord) -> dict[str, str]:
    found = getattr(sb, "metadata", None)  # issue 13 adds it to SPACE's own records
    return dict(found) if isinstance(found, dict) else {}


def sandbox_answer(sb: SandboxRecord, who: Principal, node_token: str) -> dict[str, Any]:
    """E2B's `Sandbox` (create, connect, fork)."""
    body: dict[str, Any] = {
        "templateID": sb.template,
        "sandboxID": sb.id,
        "alias": sb.template,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "trafficAccessToken": None,
        "domain": None,
    }
    if who.role != "read-only":
        body["envdAccessToken"] = envd_access_token(node_token, sb.id)
        # The code interpreter's SDK sends only this header on its context calls (port 49999, ADR 0058):
        # the same token, the same rights in this one sandbox.
        body["trafficAccessToken"] = body["envdAccessToken"]
    return body


def listed_answer(sb: SandboxRecord) -> dict[str, Any]:
    """E2B's `ListedSandbox`."""
    return {
        "templateID": sb.template,
        "alias": sb.template,
        "sandboxID": sb.id,
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(sb.created_at),
        "endAt": rfc3339(end_at(sb)),
        "cpuCount": max(1, math.ceil(sb.limits.cpus)),
        "memoryMB": sb.limits.memory_mb,
        "diskSizeMB": sb.limits.disk_mb,
        "state": e2b_state(sb),
        "envdVersion": ENVD_VERSION,
        "metadata": metadata_of(sb),
    }


def detail_answer(sb: SandboxRecord, who: Principal, node_token: str) -> dict[str, Any]:
    """E2B's `SandboxDetail` (get_info)."""
    on_timeout = "pause" if getattr(sb, "on_timeout", None) == "pause" else "kill"
    body = listed_answer(sb) | {
        "domain": None,
        # SPACE brings a paused or suspended sandbox back when it is used (envd front, connect): always.
        "lifecycle": {"autoResume": True, "onTimeout": on_timeout},
    }
    if who.role != "read-only":
        body["envdAccessToken"] = envd_access_token(node_token, sb.id)
    return body
