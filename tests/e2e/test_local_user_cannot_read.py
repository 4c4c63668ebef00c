"""A local unprivileged user next to a running `space up` reads nothing secret (issue 9, ADR 0022).

A real `space up --detach` (root helper, runsc node agent as `space`, control plane) is made to hold every
kind of secret: the org admin key, the node token (and the node's identity, where it has one), a sandbox
with an env secret and a credential bound to it, a full checkpoint (a memory image holding the env secret)
and a sandbox suspended to the object store. Then, as `nobody` (setpriv), a probe walks the data
directory and /var/cache/space, opens every file, lists every directory, and reads /proc/<pid>/environ and
cmdline of every SPACE process (supervisor, helper, agent, control plane, holders, runsc, gofer, sentry):
no secret may turn up, and the data directory may not even be listed. A second probe adds the agent's
group (what the data directory's 0710 lets through) and tries every path inside by name, to prove the
modes inside (0600 files, 0700 directories) hold on their own.

The search is proven able to fail (positive controls): the same probe as root finds the admin key in
admin.key, the node token in node.token and the env secret in the checkpoint image; as `nobody` it finds
every secret in a planted world-readable file and in the environment of a process of its own.

The data directory starts as an "older run" would have left it (0755, world-readable logs) to prove that
`space up` tightens it. The detached supervisor's log must not hold the admin key, and the node's btrfs
filesystem must be mounted nosuid,nodev.
"""

from __future__ import annotations

import grp
import json
import os
import pathlib
import pwd
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.cluster import free_port, host_leftovers, sandbox_ids_in
from tests.support.host import runtime_id

pytestmark = pytest.mark.root

PROBE = pathlib.Path(__file__).resolve().parents[1] / "support" / "local_probe.py"
CACHE_DIR = pathlib.Path("/var/cache/space")
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@dataclass
class Installation:
    home: pathlib.Path
    data_dir: pathlib.Path
    probe_dir: pathlib.Path  # world-readable copy of the probe script

    def env(self) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), "LANG": "C.UTF-8"}
        if "PYTHONPATH" in os.environ:  # the tree under test, when it is not the installed one
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        return env

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        proc = subprocess.run(
            [sys.executable, "-m", "space.cli.main", *args], capture_output=True, env=self.env(),
            cwd=self.home, timeout=timeout, check=False,
        )  # fmt: skip
        if check and proc.returncode != 0:
            pytest.fail(
                f"space {args[0]} {args[1] if len(args) > 1 else ''} exited {proc.returncode}\n"
                f"stderr: {proc.stderr.decode(errors='replace')[-3000:]}\n{self.log_tails()}"
            )
        return proc

    def log_tails(self) -> str:
        parts = []
        for name in ("space.log", "controlplane.log", "agent.log", "helper.log"):
            path = self.data_dir / name
            if path.exists():
                parts.append(f"--- {name} ---\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def probe(self, prefix: list[str], request: dict[str, Any]) -> dict[str, Any]:
        proc = subprocess.run(
            [*prefix, "/usr/bin/python3", "-I", str(self.probe_dir / PROBE.name)],
            input=json.dumps(request).encode(), capture_output=True, timeout=600, check=False,
            cwd="/",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
        result: dict[str, Any] = json.loads(proc.stdout)
        return result


@pytest.fixture
def installation(tmp_path: pathlib.Path) -> Iterator[Installation]:
    if os.geteuid() != 0:
        pytest.fail("`space up` starts the node's root helper: run the tests as root")
    home = tmp_path / "home"
    home.mkdir()
    probe_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-probe-", dir="/var/tmp"))
    probe_dir.chmod(0o755)
    shutil.copy(PROBE, probe_dir / PROBE.name)
    (probe_dir / PROBE.name).chmod(0o644)
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-local-user-", dir="/var/tmp"))
    made = Installation(home, data_dir, probe_dir)
    try:
        yield made
    finally:
        seen = sandbox_ids_in(data_dir)
        down = made.run("down", "--data-dir", str(data_dir), "--purge", timeout=600, check=False)
        logs = made.log_tails()
        left = host_leftovers(data_dir, seen)
        if not left["mounts"]:  # never recurse into a mount left behind: leave it for a post-mortem
            shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(probe_dir, ignore_errors=True)
        assert down.returncode == 0, down.stderr.decode(errors="replace") + logs
        assert {k: v for k, v in left.items() if v} == {}, f"left behind by `space down --purge`: {left}"


def _descendants(roots: set[int]) -> set[int]:
    """`roots` and every process below them (holders and runsc's children do not name the data dir)."""
    parents: dict[int, int] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents[int(entry.name)] = int(fields[1])
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def _space_processes(data_dir: pathlib.Path) -> dict[int, str]:
    """Every process of this installation: those naming its data directory, and all their descendants."""
    named = set()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(data_dir).encode() in cmdline:
                named.add(int(entry.name))
    found = {}
    for pid in _descendants(named):
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        found[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def _all_paths(root: pathlib.Path) -> list[str]:
    """Every path under `root`, as root sees them (what a user guessing names could try)."""
    found = [str(root)]
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        found.extend(os.path.join(dirpath, name) for name in (*dirnames, *filenames))
    return found


def _private(path: pathlib.Path) -> bool:
    return stat.S_IMODE(path.lstat().st_mode) & 0o077 == 0


def test_a_local_user_reads_no_secret_of_a_running_installation(installation: Installation) -> None:
    inst = installation
    data_dir = inst.data_dir
    agent = pwd.getpwnam("space")  # `make setup` creates it; the agent runs as this user
    # An older run's leftovers: a world-listable data directory and world-readable logs.
    data_dir.chmod(0o755)
    for name in ("space.log", "agent.log"):
        (data_dir / name).write_text("an older run's log line\n")
        (data_dir / name).chmod(0o644)

    up = inst.run("up", "--data-dir", str(data_dir), "--port", str(free_port()), "--detach", timeout=900)
    key_line = re.search(r"^SPACE_API_KEY=(\S+)$", up.stdout.decode(), re.M)
    assert key_line, up.stdout.decode()  # the key goes to the terminal of whoever ran `space up`
    admin_key = key_line.group(1)
    env_secret = "envsecret-" + secrets.token_hex(12)
    credential_value = "credvalue-" + secrets.token_hex(12)
    inst.run("credential", "set", "PROBED", "--value", credential_value, "--host", "example.com")
    create = ["sandbox", "create", "--json", "--env", f"PROBE_SECRET={env_secret}"]
    sandbox = json.loads(inst.run(*create, "--credential", "PROBED", "--allow", "example.com").stdout)["id"]
    seen = inst.run("exec", sandbox, "--", "sh", "-c", "printenv PROBE_SECRET").stdout.decode().strip()
    assert seen == env_secret  # the secret is really in the sandbox (and so in its memory image)
    snapshot = json.loads(inst.run("snapshot", "create", sandbox, "--full", "--json").stdout)["id"]
    suspended = json.loads(inst.run(*create).stdout)["id"]
    inst.run("sandbox", "suspend", suspended, timeout=600)
    assert json.loads(inst.run("sandbox", "get", suspended, "--json").stdout)["state"] == "suspended"

    node_token = (data_dir / "node.token").read_text().strip()
    needles = {"admin key": admin_key, "node token": node_token, "credential value": credential_value,
               "env secret": env_secret}  # fmt: skip
    # The node's own credentials (ADR 0021): identity/rpc.token, and the secret in identity/node.json.
    # (The directory also holds the agent's non-secret state, e.g. its incarnations map: not needles.)
    identity_dir = data_dir / "identity"
    for path in (identity_dir / "node.json", identity_dir / "rpc.token"):
        text = path.read_text().strip() if path.is_file() else ""
        if path.suffix == ".json":
            fields = json.loads(text)
            needles.update({f"node {key}": str(v) for key, v in fields.items() if key != "node_id" and v})
        elif text:
            needles[f"node {path.name}"] = text
    commands = " ".join(_space_processes(data_dir).values())
    for kind in ("space.cli.main up", "space.node.helper.server", "space.node.agent.server",
                 "space.controlplane.server", "runsc-sandbox", "runsc-gofer", "--spare"):  # fmt: skip
        assert kind in commands, f"no {kind} process among {commands}"

    # -- positive controls: the search finds what is there ------------------------------------------------
    image_dir = data_dir / "fs" / "checkpoints" / runtime_id(data_dir, sandbox) / snapshot
    as_root = inst.probe([], {"needles": needles, "paths": [str(data_dir / "admin.key"),
                              str(data_dir / "node.token"), str(image_dir)]})  # fmt: skip
    found_by_root = {name for name, _where in as_root["found"]}
    assert {"admin key", "node token", "env secret"} <= found_by_root, as_root["found"]
    canary_dir = inst.probe_dir / "canary"
    canary_dir.mkdir(mode=0o755)
    (canary_dir / "planted").write_text("\n".join(f"{k}={v}" for k, v in needles.items()))
    (canary_dir / "planted").chmod(0o644)
    canary_process = subprocess.Popen(
        [*NOBODY, "sleep", "600"], env={"PATH": "/usr/bin:/bin", "CANARY": env_secret + credential_value}
    )
    try:
        control = inst.probe(NOBODY, {"needles": needles, "roots": [str(canary_dir)],
                                      "pids": [canary_process.pid]})  # fmt: skip
    finally:
        canary_process.kill()
        canary_process.wait()
    assert {name for name, _ in control["found"]} == set(needles), control["found"]
    assert ["env secret", f"/proc/{canary_process.pid}/environ"] in control["found"], control["found"]

    # -- the attack: `nobody` walks everything and reads every SPACE process's /proc entries ---------------
    processes = _space_processes(data_dir)
    nobody = inst.probe(NOBODY, {"needles": needles, "roots": [str(data_dir), str(CACHE_DIR)],
                                 "pids": sorted(processes)})  # fmt: skip
    assert nobody["uid"] == pwd.getpwnam("nobody").pw_uid
    assert nobody["found"] == [], f"nobody read secrets: {nobody['found']}"
    assert nobody["too_large"] == [], f"nobody can read large files: {nobody['too_large']}"
    assert str(data_dir) in nobody["unlistable"], "nobody listed the data directory"
    assert not [p for p in nobody["listed"] + nobody["readable"] if p.startswith(str(data_dir))]
    assert nobody["environ_read"] == [], (
        f"nobody read the environment of SPACE processes {nobody['environ_read']}"
    )
    assert len(processes) >= 6, processes  # supervisor, helper, control plane, agent, holder, runsc...

    # -- defence in depth: with the agent's group (what 0710 lets through), every path tried by name -----
    group_member = ["setpriv", "--reuid=nobody", "--regid=nogroup", f"--groups={agent.pw_gid}"]
    paths = _all_paths(data_dir)
    member = inst.probe(group_member, {"needles": needles, "paths": paths, "pids": sorted(processes)})
    assert member["found"] == [], f"a member of the agent's group read secrets: {member['found']}"
    assert member["too_large"] == [], (
        f"the btrfs image or another large file is readable: {member['too_large']}"
    )
    assert str(data_dir) in member["unlistable"], "the data directory is listable by the agent's group"
    readable = sorted(p for p in member["readable"] if p.startswith(str(data_dir)))
    assert readable == [], f"files of the data directory readable by a non-owner: {readable[:20]}"

    # -- modes, logs and the mount, as root -------------------------------------------------------------
    info = data_dir.stat()
    assert stat.S_IMODE(info.st_mode) == 0o710 and info.st_gid == agent.pw_gid, oct(info.st_mode)
    assert grp.getgrgid(info.st_gid).gr_name == grp.getgrgid(agent.pw_gid).gr_name
    private = ["admin.key", "node.token", "btrfs.img", "controlplane.db", "controlplane.db-wal", "space.log",
               "agent.log", "controlplane.log", "helper.log"]  # fmt: skip
    assert [name for name in private if not _private(data_dir / name)] == []
    images = [p for p in image_dir.iterdir()] + [image_dir]
    assert images and all(_private(p) for p in images), [(p.name, oct(p.stat().st_mode)) for p in images]
    logs = sorted(data_dir.glob("*.log")) + sorted((data_dir / "run").glob("*/*.log"))
    for log in logs:
        text = log.read_bytes()
        leaked = [name for name, value in needles.items() if value.encode() in text]
        assert leaked == [], f"{log.name} holds {leaked}"
    supervisor_log = (data_dir / "space.log").read_text()
    assert "SPACE ready at" in supervisor_log and "SPACE_API_KEY" not in supervisor_log, supervisor_log[-500:]
    mount = [line.split() for line in pathlib.Path("/proc/mounts").read_text().splitlines()]
    options = [fields[3].split(",") for fields in mount if fields[1] == str(data_dir / "fs")]
    assert options and {"nosuid", "nodev"} <= set(options[-1]), options
