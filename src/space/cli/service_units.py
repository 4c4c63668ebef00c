"""The systemd units of SPACE's roles, rendered from one table each (ADR 0071): what `space service install`
writes, and what the tests validate with `systemd-analyze verify`.

    space-controlplane.service   `space controlplane run --config …` as the user `space-cp`
    space-node-helper.service    the node's root helper (root: btrfs, runsc, network namespaces, nftables)
    space-node-agent.service     the node agent and its egress gateway as the user `space`, after the helper

The units run the commands `space up` and `space node join` run (space.controlplane.local,
space.cli.node_join), with the same arguments, so a node or replica behaves the same under systemd.

Invariants:
- Every unit comes from `UNITS` through `render()`: one place says what each role gets (user, command,
  restart policy, limits, hardening); nothing else writes unit text.
- Hardening is as strict as each process allows, and no stricter: the control plane and the agent get their
  own read-only view of the system (ProtectSystem=strict) with only their state directories writable, no
  new privileges, no capabilities; the helper gets NO mount-namespace option (ProtectSystem, PrivateTmp,
  ProtectHome, PrivateDevices, ReadWritePaths all make one): the btrfs mounts and network namespaces it
  makes must be the host's, or the agent and the runtimes would not see them.
- The helper's unit stops only the helper (KillMode=process): the runtimes it started keep the sandboxes
  running, and the next helper adopts them, as under `space up` (ADR 0037).
- The agent is not restarted for exit status 78 (an incompatible control plane, ADR 0071): restarting
  cannot help, and the journal says why.
- Secrets never enter a unit file: the configuration file reaches the control plane as a systemd
  credential (LoadCredential: a private copy only that service can read), and the node's [node] and
  [objects] settings are an EnvironmentFile that only root reads (0600), as systemd does before it drops
  privileges.
- Every value rendered into a unit is checked first: no newline, and paths absolute (a value that would add
  a directive is refused, not escaped).
"""

from __future__ import annotations

import pathlib
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from space.core import errors

Role = Literal["controlplane", "node", "all"]
ROLES: Final = ("controlplane", "node", "all")
CONTROLPLANE_USER: Final = "space-cp"
AGENT_USER: Final = "space"
CONTROLPLANE_UNIT: Final = "space-controlplane.service"
HELPER_UNIT: Final = "space-node-helper.service"
AGENT_UNIT: Final = "space-node-agent.service"
UNIT_NAMES: Final = (CONTROLPLANE_UNIT, HELPER_UNIT, AGENT_UNIT)
#: The agent's exit status for an incompatible control plane (space.node.agent.launch.EXIT_INCOMPATIBLE).
EXIT_INCOMPATIBLE: Final = 78
#: The name of the control plane's configuration as a systemd credential.
CONFIG_CREDENTIAL: Final = "fleet.toml"
_SAFE_VALUE = re.compile(r"[^\n\r\x00]*")

#: What every long-running unit gets: restart with a pause, JSON log lines for the journal (ADR 0071).
_COMMON_SERVICE: Final[dict[str, str]] = {
    "Type": "simple",
    "RestartSec": "2s",
    "UMask": "0077",
    "Environment": "SPACE_LOG_FORMAT=json PYTHONDONTWRITEBYTECODE=1",
}
#: The read-only view of the system for the unprivileged services (they get ReadWritePaths on top).
_SANDBOXED: Final[dict[str, str]] = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "SystemCallArchitectures": "native",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
}


@dataclass(frozen=True)
class ControlPlanePlan:
    """What the control plane's unit needs from the configuration."""

    config: pathlib.Path
    data_dir: pathlib.Path
    #: Further directories it writes (a file:// object store outside the data directory).
    writable: tuple[pathlib.Path, ...] = ()


@dataclass(frozen=True)
class NodePlan:
    """What the node's units need: the agent's arguments as `space node join` passes them."""

    data_dir: pathlib.Path
    control_plane: str
    listen: str
    advertise_url: str
    templates: str
    cgroup_parent: str
    store_url: str | None
    environment_file: pathlib.Path
    writable: tuple[pathlib.Path, ...] = ()
    favor_cgroup_moves: bool = True  # NodeAgentSettings.favor_cgroup_moves (ADR 0086)


@dataclass(frozen=True)
class Unit:
    name: str
    text: str


def _checked(value: str, what: str) -> str:
    if not _SAFE_VALUE.fullmatch(value):
        raise errors.InvalidArgument(f"{what}: a value in a systemd unit may not hold a newline", field=what)
    return value


def _command(argv: Sequence[str]) -> str:
    """An ExecStart line: each argument quoted (systemd splits like a shell; `$` and `%` are escaped so that
    neither environment nor specifier expansion can change an argument)."""
    words = []
    for arg in argv:
        _checked(arg, "command")
        words.append(shlex.quote(arg).replace("%", "%%").replace("$", "$$"))
    return " ".join(words)


def _paths(paths: Sequence[pathlib.Path]) -> str:
    for path in paths:
        if not path.is_absolute() or " " in str(path):
            raise errors.InvalidArgument(
                f"{path}: a unit's path must be absolute, without spaces", field="path"
            )
        _checked(str(path), "path")
    return " ".join(str(path) for path in paths)


def render(description: str, sections: Mapping[str, Mapping[str, str]]) -> str:
    """A unit file from its sections; an empty value is written as `Key=` (systemd's reset)."""
    lines = ["# Written by `space service install` (ADR 0071); `space service uninstall` removes it.", ""]
    for section, entries in sections.items():
        lines.append(f"[{section}]")
        if section == "Unit":
            lines.append(f"Description={_checked(description, 'description')}")
        for key, value in entries.items():
            lines.append(f"{key}={_checked(value, key)}")
        lines.append("")
    return "\n".join(lines)


def controlplane_unit(plan: ControlPlanePlan, python: str) -> Unit:
    command = [python, "-m", "space.cli.main", "controlplane", "run"]
    service = {
        **_COMMON_SERVICE,
        "SyslogIdentifier": "space-controlplane",
        "User": CONTROLPLANE_USER,
        "Group": CONTROLPLANE_USER,
        "LoadCredential": f"{CONFIG_CREDENTIAL}:{_paths([plan.config])}",
        # %d: the service's credentials directory, where LoadCredential put its private copy.
        "ExecStart": f"{_command(command)} --config %d/{CONFIG_CREDENTIAL}",
        "Restart": "always",
        "MemoryMax": "4G",
        "TasksMax": "4096",
        "LimitNOFILE": "65536",
        **_SANDBOXED,
        "ReadWritePaths": _paths([plan.data_dir, *plan.writable]),
    }
    unit = {"After": "network-online.target", "Wants": "network-online.target"}
    sections = {"Unit": unit, "Service": service, "Install": {"WantedBy": "multi-user.target"}}
    return Unit(CONTROLPLANE_UNIT, render("SPACE control plane (one replica)", sections))


def helper_unit(plan: NodePlan, python: str) -> Unit:
    command = [python, "-m", "space.node.helper.server", "--data-dir", str(plan.data_dir),
               "--agent-user", AGENT_USER, "--cgroup-parent", plan.cgroup_parent]  # fmt: skip
    if not plan.favor_cgroup_moves:
        command.append("--no-favor-cgroup-moves")
    service = {
        **_COMMON_SERVICE,
        "SyslogIdentifier": "space-node-helper",
        "User": "root",
        "ExecStart": _command(command),
        "Restart": "always",
        # The runtimes it started are the sandboxes: they outlive the helper and are adopted (ADR 0037).
        "KillMode": "process",
        "TasksMax": "infinity",
        "LimitNOFILE": "1048576",
        # Only what leaves the host's mounts and namespaces as they are (see the module docstring).
        "NoNewPrivileges": "yes",
        "LockPersonality": "yes",
        "RestrictRealtime": "yes",
    }
    sections = {"Unit": {}, "Service": service, "Install": {"WantedBy": "multi-user.target"}}
    return Unit(HELPER_UNIT, render("SPACE node helper (root: storage, runtimes, network)", sections))


def agent_unit(plan: NodePlan, python: str) -> Unit:
    command = [python, "-m", "space.node.agent.server", "--data-dir", str(plan.data_dir),
               "--listen", plan.listen, "--control-plane", plan.control_plane,
               "--advertise-url", plan.advertise_url, "--templates", plan.templates,
               # Read only while the node has no identity (space node join's token file; ADR 0021).
               "--bootstrap-token-file", str(plan.data_dir / "enrolment.token")]  # fmt: skip
    if plan.store_url is not None:
        command += ["--store-url", plan.store_url]
    service = {
        **_COMMON_SERVICE,
        "SyslogIdentifier": "space-node-agent",
        "User": AGENT_USER,
        "Group": AGENT_USER,
        "EnvironmentFile": f"-{_paths([plan.environment_file])}",
        "ExecStart": _command(command),
        "Restart": "always",
        "RestartPreventExitStatus": str(EXIT_INCOMPATIBLE),
        "MemoryMax": "4G",
        "TasksMax": "8192",
        "LimitNOFILE": "1048576",
        **_SANDBOXED,
        "ReadWritePaths": _paths([plan.data_dir, *plan.writable]),
    }
    unit = {
        "After": f"network-online.target {HELPER_UNIT}",
        "Wants": "network-online.target",
        "Requires": HELPER_UNIT,
    }
    sections = {"Unit": unit, "Service": service, "Install": {"WantedBy": "multi-user.target"}}
    return Unit(AGENT_UNIT, render("SPACE node agent and egress gateway", sections))


def environment_file(variables: Mapping[str, str]) -> str:
    """An EnvironmentFile: one NAME="VALUE" a line, the value quoted for systemd (backslash, quote)."""
    lines = ["# Written by `space service install` from the configuration file's [node] and [objects]."]
    for name, value in sorted(variables.items()):
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            raise errors.InvalidArgument(f"{name!r} is not an environment variable name", field="environment")
        escaped = _checked(value, name).replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{name}="{escaped}"')
    return "\n".join(lines) + "\n"
