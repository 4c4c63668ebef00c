"""`space service install|uninstall` (ADR 0071): the systemd units of each role, validated with
`systemd-analyze verify` (Debian's systemd 252). PID 1 on the test machine is not systemd, so the units are
verified, not started: verify parses every directive, checks every value and that each ExecStart program
exists; a warning on its stderr fails the test as an error does. The install is run for real (as root)
into a temporary unit directory and data directory; only the services' start is left to a machine with
systemd."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner, Result

from space.cli import main as cli_main
from space.cli import service
from space.cli import service_units as su
from space.cli.config_file import read_config
from space.core import errors
from space.node.agent import launch
from space.node.agent.settings import NodeAgentSettings
from tests.support import cluster as c

SECRET = "s3cret-access-key-value"


def _config(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "space.toml"
    path.write_text(
        f"""
[controlplane]
data_dir = "{tmp_path}/cp"
listen = "127.0.0.1:{c.free_port()}"

[node]
data_dir = "{tmp_path}/node"
control_plane = "https://cp.example.com:8470"
listen = "127.0.0.1:17070"
templates = "python,base"

[objects]
endpoint = "https://s3.example.com"
access_key_id = "AKIDEXAMPLE"
secret_access_key = "{SECRET}"
"""
    )
    path.chmod(0o600)
    return path


def verify(directory: pathlib.Path) -> subprocess.CompletedProcess[str]:
    files = sorted(str(path) for path in directory.glob("*.service"))
    assert files
    return subprocess.run(["systemd-analyze", "verify", *files], check=False, capture_output=True, text=True)


@pytest.fixture
def rendered(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    config = _config(tmp_path)
    units = service.units_for("all", config, read_config(config))
    directory = tmp_path / "units"
    directory.mkdir()
    for unit in units:
        (directory / unit.name).write_text(unit.text)
    yield directory


def test_every_role_s_units_pass_systemd_analyze_verify(rendered: pathlib.Path) -> None:
    assert sorted(path.name for path in rendered.iterdir()) == sorted(su.UNIT_NAMES)
    checked = verify(rendered)
    assert (checked.returncode, checked.stderr, checked.stdout) == (0, "", "")


def test_the_check_fails_on_a_unit_systemd_would_ignore_a_line_of(rendered: pathlib.Path) -> None:
    # The same check sees a bad value (systemd ignores the line and says so) and a missing program.
    agent = rendered / su.AGENT_UNIT
    agent.write_text(agent.read_text().replace("MemoryMax=4G", "MemoryMax=lots"))
    assert "Invalid memory limit" in verify(rendered).stderr
    helper = rendered / su.HELPER_UNIT
    helper.write_text(helper.read_text().replace(sys.executable, "/nonexistent/python", 1))
    assert verify(rendered).returncode != 0


def _sections(text: str) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        elif "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            current[key] = value
    return sections


def test_each_role_runs_as_its_user_with_its_limits_and_hardening(rendered: pathlib.Path) -> None:
    cp = _sections((rendered / su.CONTROLPLANE_UNIT).read_text())
    helper = _sections((rendered / su.HELPER_UNIT).read_text())
    agent = _sections((rendered / su.AGENT_UNIT).read_text())
    assert cp["Service"]["User"] == "space-cp" and agent["Service"]["User"] == "space"
    assert helper["Service"]["User"] == "root"
    assert cp["Service"]["ExecStart"].endswith("-m space.cli.main controlplane run --config %d/fleet.toml")
    assert "-m space.node.agent.server" in agent["Service"]["ExecStart"]
    assert "--control-plane https://cp.example.com:8470" in agent["Service"]["ExecStart"]
    assert "-m space.node.helper.server" in helper["Service"]["ExecStart"]
    for unit in (cp, agent):
        service_section = unit["Service"]
        assert service_section["ProtectSystem"] == "strict" and service_section["NoNewPrivileges"] == "yes"
        assert service_section["CapabilityBoundingSet"] == "" and service_section["PrivateTmp"] == "yes"
        assert {"MemoryMax", "TasksMax", "LimitNOFILE", "Restart"} <= set(service_section)
    # The helper's mounts and namespaces must be the host's: no option that gives it a mount namespace.
    mount_options = {"ProtectSystem", "PrivateTmp", "ProtectHome", "PrivateDevices", "ReadWritePaths"}
    assert not mount_options & set(helper["Service"])
    assert helper["Service"]["KillMode"] == "process"  # the sandboxes outlive a helper restart
    assert agent["Unit"]["Requires"] == su.HELPER_UNIT and su.HELPER_UNIT in agent["Unit"]["After"]
    assert agent["Service"]["RestartPreventExitStatus"] == "78"  # an incompatible control plane
    assert all(
        unit["Service"]["Environment"].startswith("SPACE_LOG_FORMAT=json") for unit in (cp, helper, agent)
    )


def test_no_secret_is_written_into_a_unit(rendered: pathlib.Path, tmp_path: pathlib.Path) -> None:
    for path in rendered.iterdir():
        assert SECRET not in path.read_text()
    variables = service.node_environment(read_config(tmp_path / "space.toml"))
    assert variables["AWS_SECRET_ACCESS_KEY"] == SECRET  # it goes to the root-only environment file


@pytest.mark.parametrize(
    "hostile",
    ["/var/lib/sp ace", "relative/dir", "/var/lib/space\nExecStartPre=/bin/sh -c evil", "/x\x00y"],
)
def test_a_value_that_would_add_a_directive_is_refused(hostile: str) -> None:
    plan = su.NodePlan(
        data_dir=pathlib.Path(hostile), control_plane="https://cp.example.com", listen="127.0.0.1:7070",
        advertise_url="http://127.0.0.1:7070", templates="python", cgroup_parent="space", store_url=None,
        environment_file=pathlib.Path("/etc/space/node.env"),
    )  # fmt: skip
    with pytest.raises(errors.InvalidArgument):
        su.agent_unit(plan, sys.executable)
    with pytest.raises(errors.InvalidArgument):
        su.environment_file({"AWS_SECRET_ACCESS_KEY": "a\nEVIL=1"})


def test_dollar_and_percent_in_an_argument_stay_literal() -> None:
    line = su._command(["/bin/echo", "$HOME", "%h", "a b"])
    assert line == "/bin/echo '$$HOME' %%h 'a b'"


def _cli(*args: str) -> Result:
    return CliRunner().invoke(cli_main.app, ["service", *args])


def test_dry_run_prints_the_units_and_writes_nothing(tmp_path: pathlib.Path) -> None:
    config = _config(tmp_path)
    units = tmp_path / "units"
    done = _cli("install", "--config", str(config), "--dry-run", "--unit-dir", str(units))
    assert done.exit_code == 0, done.output
    assert f"# {units / su.AGENT_UNIT}" in done.output and "AWS_SECRET_ACCESS_KEY" in done.output
    assert SECRET not in done.output
    assert not units.exists() and not (tmp_path / "node").exists() and not (tmp_path / "cp").exists()
    bad = _cli("install", "--config", str(config), "--dry-run", "--role", "everything")
    assert bad.exit_code != 0 and "--role is one of" in bad.output


def test_a_node_without_a_control_plane_url_is_a_named_error(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "node-only.toml"
    config.write_text(f'[node]\ndata_dir = "{tmp_path}/node"\n')
    done = _cli("install", "--config", str(config), "--role", "node", "--dry-run")
    assert done.exit_code != 0 and "control_plane" in done.output


@pytest.mark.root
def test_install_and_uninstall_a_node_for_real(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert os.geteuid() == 0
    agent_user = pwd.getpwnam("space")  # made by `make setup`; install would make it otherwise
    config = _config(tmp_path)
    environment = tmp_path / "etc" / "node.env"
    monkeypatch.setattr(service, "NODE_ENVIRONMENT", environment)
    token = tmp_path / "token"
    token.write_text("enrol-token-value\n")
    units = tmp_path / "units"
    done = _cli("install", "--role", "node", "--config", str(config), "--unit-dir", str(units),
                "--token-file", str(token))  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "enrol-token-value" not in done.output
    assert sorted(path.name for path in units.iterdir()) == [su.AGENT_UNIT, su.HELPER_UNIT]
    assert verify(units).stderr == ""
    data_dir = tmp_path / "node"
    info = data_dir.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o710, 0, agent_user.pw_gid)
    enrolment = data_dir / "enrolment.token"
    assert enrolment.read_text() == "enrol-token-value\n"
    assert (stat.S_IMODE(enrolment.stat().st_mode), enrolment.stat().st_uid) == (0o600, agent_user.pw_uid)
    assert stat.S_IMODE(environment.stat().st_mode) == 0o600 and SECRET in environment.read_text()
    assert f"EnvironmentFile=-{environment}" in (units / su.AGENT_UNIT).read_text()

    removed = _cli("uninstall", "--role", "node", "--unit-dir", str(units))
    assert removed.exit_code == 0, removed.output
    assert list(units.iterdir()) == [] and not environment.exists()
    assert data_dir.exists()  # data stays
    shutil.rmtree(data_dir)
    assert "no SPACE unit installed" in _cli("uninstall", "--unit-dir", str(units)).output


def _exec_start(unit: pathlib.Path) -> list[str]:
    line = next(row for row in unit.read_text().splitlines() if row.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart=").replace("$$", "$").replace("%%", "%"))


def test_the_agent_unit_s_command_is_one_the_agent_takes(rendered: pathlib.Path) -> None:
    argv = _exec_start(rendered / su.AGENT_UNIT)
    assert argv[:3] == [sys.executable, "-m", "space.node.agent.server"]
    args = launch._parser(NodeAgentSettings()).parse_args(argv[3:])
    assert (args.control_plane, args.listen, args.templates) == (
        "https://cp.example.com:8470", ("127.0.0.1", 17070), "python,base"
    )  # fmt: skip


def test_a_cgroup_parent_the_helper_refuses_is_refused_at_install(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "odd.toml"
    config.write_text(f'[node]\ndata_dir = "{tmp_path}/node"\ncontrol_plane = "https://cp.example.com"\n'
                      'cgroup_parent = "node1"\n')  # fmt: skip
    done = _cli("install", "--config", str(config), "--role", "node", "--dry-run")
    assert done.exit_code != 0 and "cgroup_parent" in done.output


@pytest.mark.root
def test_the_control_plane_and_helper_units_commands_start(
    rendered: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """The units' own command lines, run as root here (systemd would switch users): the control plane
    serves with the configuration the credential carries, the helper listens on its socket."""
    config = tmp_path / "space.toml"
    listen = tomllib.loads(config.read_text())["controlplane"]["listen"]
    cp_argv = [config.as_posix() if arg == "%d/fleet.toml" else arg
               for arg in _exec_start(rendered / su.CONTROLPLANE_UNIT)]  # fmt: skip
    helper_argv = _exec_start(rendered / su.HELPER_UNIT)
    env = {"PATH": os.environ["PATH"], "SPACE_LOG_FORMAT": "json",
           "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2] / "src")}  # fmt: skip
    logs = tmp_path / "logs"
    logs.mkdir()
    started = []
    try:
        for name, argv in (("controlplane", cp_argv), ("helper", helper_argv)):
            with (logs / f"{name}.log").open("wb") as log:
                started.append(
                    subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
                )
        socket_path = tmp_path / "node" / "helper.sock"

        def up() -> bool:
            for process in started:
                assert process.poll() is None, (logs / "controlplane.log").read_text() + (
                    logs / "helper.log"
                ).read_text()
            with contextlib.suppress(httpx.HTTPError):
                return socket_path.exists() and httpx.get(f"http://{listen}/healthz").status_code == 200
            return False

        c.wait_for(up, timeout=60, what="the control plane healthy and the helper listening")
    finally:
        for process in started:
            process.terminate()
            process.wait(20)
    line = (logs / "controlplane.log").read_text().splitlines()[-1]
    assert json.loads(line)["component"] == "controlplane"  # the units' JSON lines
    shutil.rmtree(tmp_path / "node", ignore_errors=True)
