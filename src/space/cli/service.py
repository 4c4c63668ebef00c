"""`space service install|uninstall`: run this machine's SPACE roles as systemd services (ADR 0071).

`install --role controlplane|node|all --config FILE` reads the configuration file (space.cli.config_file:
the same one `space controlplane run` and `space node join` read), renders the units of the role(s)
(space.cli.service_units), and, unless `--dry-run` (which prints them and touches nothing):
creates the users (`space-cp` for the control plane, `space` for the node agent) and the state directories
with the modes `space up` gives them, writes the node's environment file (0600, root) and an enrolment
token (`--token-file`, kept for the agent until it holds an identity), writes the units, and where systemd
runs, reloads it and enables them (`--now`: starts them too). `uninstall` disables, stops and removes the
units and the environment file; users and data stay (`space down --purge --data-dir D` removes a node's).

Invariants:
- Nothing is written by `--dry-run`, and nothing but the unit directory, /etc/space/node.env, the users and
  the state directories by `install`.
- A unit file is replaced only when it is one of SPACE's (UNIT_NAMES): the command writes no other name.
- The enrolment token is read from a file (never an argument: the process list is public) and written
  owner-only for the agent's user; it is never printed.
"""

from __future__ import annotations

import os
import pathlib
import pwd
import shutil
import subprocess
import sys
from typing import Annotated, Final

import typer

from space.cli import service_units as su
from space.cli._common import handles_errors
from space.cli.config_file import (
    ConfigFile,
    JoinOptions,
    ObjectsOptions,
    RunOptions,
    env_name,
    read_config,
    section_keys,
    settings,
)
from space.controlplane.settings import ControlPlaneSettings
from space.core import errors
from space.node.agent.settings import NodeAgentSettings

service_app = typer.Typer(help="SPACE's roles as systemd services (ADR 0071).", no_args_is_help=True)
DEFAULT_CONFIG: Final = pathlib.Path("/etc/space/fleet.toml")
DEFAULT_UNIT_DIR: Final = pathlib.Path("/etc/systemd/system")
NODE_ENVIRONMENT: Final = pathlib.Path("/etc/space/node.env")
ENROLMENT_FILENAME: Final = "enrolment.token"

RoleOption = Annotated[
    str, typer.Option("--role", help="controlplane, node or all (both on this machine)", metavar="ROLE")
]
UnitDirOption = Annotated[
    pathlib.Path, typer.Option("--unit-dir", help="where the unit files go", hidden=True)
]


def _file_store(url: str | None) -> tuple[pathlib.Path, ...]:
    """A file:// object store's directory (the service must write it), else nothing."""
    if url is None or not url.startswith("file://"):
        return ()
    return (pathlib.Path(url.removeprefix("file://")),)


def controlplane_plan(config_path: pathlib.Path, loaded: ConfigFile) -> su.ControlPlanePlan:
    options = settings(RunOptions, loaded, "controlplane")
    tunables = settings(ControlPlaneSettings, loaded, "controlplane")
    writable = _file_store(tunables.store_url)
    if tunables.keys_dir is not None:
        writable += (pathlib.Path(tunables.keys_dir),)
    return su.ControlPlanePlan(config_path.resolve(), pathlib.Path(options.data_dir), writable)


def node_environment(loaded: ConfigFile) -> dict[str, str]:
    """The variables of the [node] tunables and the [objects] settings (the agent reads them)."""
    variables: dict[str, str] = {}
    for section, model in (("node", NodeAgentSettings), ("objects", ObjectsOptions)):
        keys = section_keys(section)
        for key, value in loaded.values(section).items():
            if keys[key] is model:
                variables[env_name(model, key)] = (
                    str(value).lower() if isinstance(value, bool) else str(value)
                )
    return variables


def node_plan(loaded: ConfigFile, environment_file: pathlib.Path) -> su.NodePlan:
    options = settings(JoinOptions, loaded, "node")
    tunables = settings(NodeAgentSettings, loaded, "node")
    if options.control_plane is None:
        raise errors.InvalidArgument(
            "the node role needs the control plane's URL: control_plane in the file's [node] section "
            "(or SPACE_NODE_CONTROL_PLANE)",
            field="control_plane",
        )
    data_dir = pathlib.Path(options.data_dir)
    return su.NodePlan(
        data_dir=data_dir, control_plane=options.control_plane.rstrip("/"), listen=options.listen,
        advertise_url=options.advertise_url or f"http://{options.listen}", templates=options.templates,
        cgroup_parent=options.cgroup_parent, store_url=tunables.store_url, environment_file=environment_file,
        writable=_file_store(tunables.store_url), favor_cgroup_moves=tunables.favor_cgroup_moves,
    )  # fmt: skip


def units_for(
    role: str, config_path: pathlib.Path, loaded: ConfigFile, *, python: str = sys.executable
) -> list[su.Unit]:
    """The units of `role` (controlplane, node, all) for this configuration, in start order."""
    if role not in su.ROLES:
        raise errors.InvalidArgument(
            f"--role is one of {', '.join(su.ROLES)}, not {role[:40]!r}", field="role"
        )
    units = []
    if role in {"controlplane", "all"}:
        units.append(su.controlplane_unit(controlplane_plan(config_path, loaded), python))
    if role in {"node", "all"}:
        plan = node_plan(loaded, NODE_ENVIRONMENT)
        units += [su.helper_unit(plan, python), su.agent_unit(plan, python)]
    return units


def systemd_runs() -> bool:
    """Whether systemd is this machine's service manager (else the units are written, not loaded)."""
    return pathlib.Path("/run/systemd/system").is_dir()


def _systemctl(*args: str) -> None:
    done = subprocess.run(["systemctl", *args], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise errors.RuntimeFailure(f"systemctl {' '.join(args)}: {done.stderr.strip()[-500:]}")


def ensure_user(name: str) -> pwd.struct_passwd:
    """The system user `name`, made (no home, no login shell) if missing."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    done = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
         "/usr/sbin/nologin", "--user-group", name],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise errors.RuntimeFailure(f"useradd {name}: {done.stderr.strip()[-300:]}")
    return pwd.getpwnam(name)


def _write(path: pathlib.Path, text: str, mode: int) -> None:
    """Replace `path` atomically with `text` (mode set before the content is visible)."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def _prepare_controlplane(plan: su.ControlPlanePlan) -> None:
    user = ensure_user(su.CONTROLPLANE_USER)
    for directory in (plan.data_dir, *plan.writable):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(directory, user.pw_uid, user.pw_gid)


def _prepare_node(plan: su.NodePlan, loaded: ConfigFile, token_file: pathlib.Path | None) -> None:
    from space.controlplane.local import secure_data_dir
    from space.node.local import ensure_local_store

    user = ensure_user(su.AGENT_USER)
    plan.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    secure_data_dir(plan.data_dir, user.pw_gid)  # 0710 root:space, as `space up` leaves it (ADR 0022)
    ensure_local_store(plan.store_url or (plan.data_dir / "objects").as_uri(), user.pw_uid)
    _write(plan.environment_file, su.environment_file(node_environment(loaded)), 0o600)
    if token_file is not None:
        token = token_file.read_text().strip()
        if not token or "\n" in token:
            raise errors.InvalidArgument(f"{token_file}: expected one enrolment token", field="token_file")
        target = plan.data_dir / ENROLMENT_FILENAME
        _write(target, token + "\n", 0o600)
        os.chown(target, user.pw_uid, user.pw_gid)


@service_app.command("install")
@handles_errors
def install(
    *,
    role: RoleOption = "all",
    config: Annotated[
        pathlib.Path, typer.Option("--config", metavar="FILE", help="TOML file")
    ] = DEFAULT_CONFIG,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the units; change nothing")] = False,
    token_file: Annotated[
        pathlib.Path | None,
        typer.Option("--token-file", help="a node's enrolment token (space controlplane token create)"),
    ] = None,
    now: Annotated[bool, typer.Option("--now", help="also start the services")] = False,
    unit_dir: UnitDirOption = DEFAULT_UNIT_DIR,
) -> None:
    """Write (and enable) the systemd units of this machine's role(s)."""
    loaded = read_config(config)
    units = units_for(role, config, loaded)
    if dry_run:
        for unit in units:
            typer.echo(f"# {unit_dir / unit.name}\n{unit.text}")
        if role in {"node", "all"}:
            variables = ", ".join(sorted(node_environment(loaded))) or "none"
            typer.echo(f"# {NODE_ENVIRONMENT} (0600, root): {variables}")
        return
    if os.geteuid() != 0:
        raise errors.PermissionDenied("installing services needs root")
    if role in {"controlplane", "all"}:
        _prepare_controlplane(controlplane_plan(config, loaded))
    if role in {"node", "all"}:
        _prepare_node(node_plan(loaded, NODE_ENVIRONMENT), loaded, token_file)
    for unit in units:
        _write(unit_dir / unit.name, unit.text, 0o644)
        typer.echo(f"wrote {unit_dir / unit.name}")
    names = [unit.name for unit in units]
    if not systemd_runs():
        typer.echo("systemd is not this machine's service manager: the units are written, not enabled")
        return
    _systemctl("daemon-reload")
    _systemctl("enable", *(["--now"] if now else []), *names)
    typer.echo(
        ("enabled and started: " if now else "enabled (start with systemctl start): ") + " ".join(names)
    )


@service_app.command("uninstall")
@handles_errors
def uninstall(*, role: RoleOption = "all", unit_dir: UnitDirOption = DEFAULT_UNIT_DIR) -> None:
    """Stop, disable and remove SPACE's units (users and data stay)."""
    if role not in su.ROLES:
        raise errors.InvalidArgument(f"--role is one of {', '.join(su.ROLES)}", field="role")
    names = {
        "controlplane": [su.CONTROLPLANE_UNIT],
        "node": [su.AGENT_UNIT, su.HELPER_UNIT],
        "all": [su.AGENT_UNIT, su.HELPER_UNIT, su.CONTROLPLANE_UNIT],
    }[role]
    present = [name for name in names if (unit_dir / name).exists()]
    if present and systemd_runs() and shutil.which("systemctl"):
        _systemctl("disable", "--now", *present)
    for name in present:
        (unit_dir / name).unlink()
        typer.echo(f"removed {unit_dir / name}")
    if role in {"node", "all"}:
        NODE_ENVIRONMENT.unlink(missing_ok=True)
    if present and systemd_runs():
        _systemctl("daemon-reload")
    if not present:
        typer.echo("no SPACE unit installed")
