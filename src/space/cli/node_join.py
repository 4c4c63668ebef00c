"""`space node join CONTROL_PLANE_URL --token T`: make this machine a node of a fleet (ADR 0070).

What it does, in order, each step failing with a message that says what to fix:
1. checks the node's prerequisites (runsc, btrfs, nftables, iproute2, util-linux); `--install` installs
   the missing Debian packages with apt from the machine's configured mirror (runsc: scripts/setup.sh);
2. asks the control plane whether it answers (`/healthz`; `--ca-file` verifies its certificate) and, for
   a node without an identity, whether the token enrols (presented to the enrolment route with a body
   that route refuses, so the token is checked without being used: a used, expired or unknown token is
   a 401 before the body is read);
3. starts the root helper, prepares the node (btrfs, network, templates) and starts the node agent as the
   `space` user, which enrols with the token once and keeps its own identity in DATA_DIR/identity; the
   egress gateway runs inside the agent (network = sandbox);
4. supervises the helper and the agent (ADR 0037: a dead one is started again) in the foreground until
   SIGTERM/SIGINT, or `--detach`es as `space up` does (`space down --data-dir D` stops it).

Invariants:
- The token reaches the agent only through DATA_DIR/enrolment.token (0600, the agent's); it is removed
  once the node holds an identity (a single-use token is spent then anyway), never logged or printed.
- The agent's environment is PATH, the variables of the configuration's [node] and [objects] sections
  (space.cli.config_file) and the process-wide ones a starter passes on (space.core.process_env: log
  format, tracing, reported version); `--ca-file` becomes its SSL_CERT_FILE (a copy in the data directory
  it can read). The helper gets the same process-wide ones (space.node.local.HELPER_ENV).
- A setting the node's processes would refuse (a `cgroup_parent` the helper does not take: the one
  validator of space.core.node_cgroups) stops the join before it starts anything; so does `--tls-cert`
  without `--tls-key` or a key others can read (identity.check_tls_files). The agent serves its RPC with
  copies of both (0600, its own) and advertises https://LISTEN unless told otherwise (ADR 0079).
- DATA_DIR/up.json and DATA_DIR/status.json are the ones `space up` writes, so `space down` and
  `space status` see a joined node as they see a one-machine installation.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import pwd
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Final

import httpx
import typer
from rich.console import Console

from space.cli._common import fail
from space.cli.config_file import (
    ConfigFile,
    JoinOptions,
    ObjectsOptions,
    SettingError,
    env_name,
    export_to_environment,
    read_config,
    section_keys,
    settings,
)
from space.cli.controlplane_role import split_listen
from space.core import errors, process_env
from space.node import filemodes
from space.node.agent.identity import NodeIdentity, check_tls_files, default_identity_file
from space.node.agent.settings import NodeAgentSettings

AGENT_USER: Final = "space"
ENROLMENT_FILENAME: Final = "enrolment.token"
CA_COPY: Final = "control-plane-ca.pem"
#: The agent's copies of the RPC's certificate and key (the operator's may be root's only).
TLS_CERT_COPY: Final = "rpc-tls.crt"
TLS_KEY_COPY: Final = "rpc-tls.key"
READY_TIMEOUT_S: Final = 600.0
PROBE_TIMEOUT_S: Final = 10.0
TICK_S: Final = 0.5
#: command -> the Debian package that has it (runsc is not in Debian 12: scripts/setup.sh brings it).
PREREQUISITES: Final = {
    "mkfs.btrfs": "btrfs-progs", "btrfs": "btrfs-progs", "nft": "nftables", "ip": "iproute2",
    "setpriv": "util-linux", "losetup": "mount", "runsc": "runsc (scripts/setup.sh: Debian 13's build)",
}  # fmt: skip
stderr = Console(stderr=True)


def missing_prerequisites(path: str | None = None) -> dict[str, str]:
    """The commands of PREREQUISITES not found on `path` (default $PATH), with their packages."""
    return {
        command: package for command, package in PREREQUISITES.items() if not shutil.which(command, path=path)
    }


def install_prerequisites(missing: dict[str, str]) -> None:
    """apt-get install the missing Debian packages (never runsc: it is not a Debian 12 package)."""
    packages = sorted({package for command, package in missing.items() if command != "runsc"})
    if packages:
        environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
            done = subprocess.run(argv, env=environment, check=False, capture_output=True, text=True)
            if done.returncode != 0:
                raise errors.RuntimeFailure(f"{' '.join(argv)} failed: {done.stderr.strip()[-500:]}")


def _verify(ca_file: str | None) -> ssl.SSLContext | bool:
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


def probe_control_plane(url: str, token: str | None, *, ca_file: str | None = None) -> None:
    """Raise a SpaceError saying what is wrong when `url` is no reachable, trusted SPACE control plane, or
    when `token` (None: not checked) would not enrol a node there. The token is not used up."""
    base = url.rstrip("/")
    try:
        with httpx.Client(base_url=base, verify=_verify(ca_file), timeout=PROBE_TIMEOUT_S) as http:
            health = http.get("/healthz")
            if health.status_code != 200:
                raise errors.Unavailable(f"{base} answers /healthz with {health.status_code}: is it SPACE?")
            if token is None:
                return
            # A body the route refuses (400) once the token is accepted; a refused token is a 401 first.
            answer = http.post("/v1/nodes/register", json=[], headers={"Authorization": f"Bearer {token}"})
    except httpx.ConnectError as exc:
        if isinstance(exc.__cause__, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
            raise errors.Unavailable(
                f"the TLS certificate of {base} is not trusted ({exc}): give its CA with --ca-file"
            ) from exc
        raise errors.Unavailable(f"the control plane at {base} is unreachable: {exc}") from exc
    except httpx.HTTPError as exc:
        raise errors.Unavailable(f"the control plane at {base} is unreachable: {exc}") from exc
    if answer.status_code == 401:
        raise errors.Unauthenticated(
            f"the enrolment token given with --token is refused by {base}: it was used already, has expired, "
            "or was never made there (`space controlplane token create` makes a new one)"
        )
    if answer.status_code != 400:
        raise errors.Unavailable(
            f"{base} answers the enrolment check with {answer.status_code}: is it SPACE?"
        )


def _agent_ids() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam(AGENT_USER)
    except KeyError:
        return 0, 0  # no `space` user (a machine without `make setup`): the agent runs as root
    return entry.pw_uid, entry.pw_gid


def _write_agent_file(path: pathlib.Path, content: bytes, uid: int) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, content)
    finally:
        os.close(fd)
    os.chown(path, uid, -1)


def agent_environment(ca_copy: pathlib.Path | None) -> dict[str, str]:
    """PATH, the source tree, and the set variables of [node] and [objects] (see the module invariants)."""
    src = pathlib.Path(__file__).resolve().parents[2]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": str(src), "HOME": "/"}  # fmt: skip
    for section in ("node", "objects"):
        for key, model in section_keys(section).items():
            name = env_name(model, key)
            if name in os.environ:
                env[name] = os.environ[name]
    env.update(process_env.passed_on(os.environ))  # log format, tracing, reported version (ADR 0079)
    if ca_copy is not None:
        env["SSL_CERT_FILE"] = str(ca_copy)
    return env


@dataclass
class JoinedNode:
    """The helper and the agent of a node joined to a remote control plane, as processes of this one."""

    options: JoinOptions
    store_url: str | None
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from space.node.local import LocalNode

        self.data_dir = pathlib.Path(self.options.data_dir).resolve()
        self.uid, self.gid = _agent_ids()
        self.node = LocalNode(
            self.data_dir,
            agent_user=self.uid,
            store_url=self.store_url,
            cgroup_parent=self.options.cgroup_parent,
        )

    @property
    def control_plane(self) -> str:
        assert self.options.control_plane is not None
        return self.options.control_plane.rstrip("/")

    def enrolled(self) -> bool:
        with contextlib.suppress(errors.SpaceError, OSError):
            return NodeIdentity.load(default_identity_file(self.data_dir)).enrolled
        return False

    def prepare(self, token: str | None, ca_file: str | None, progress: Callable[[str], None]) -> None:
        from space.controlplane.local import _prepare_node, secure_data_dir
        from space.node.local import ensure_local_store

        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        secure_data_dir(self.data_dir, self.gid)
        if token is not None:
            _write_agent_file(self.data_dir / ENROLMENT_FILENAME, token.encode() + b"\n", self.uid)
        self.ca_copy = None
        if ca_file is not None:
            self.ca_copy = self.data_dir / CA_COPY
            _write_agent_file(self.ca_copy, pathlib.Path(ca_file).read_bytes(), self.uid)
        if self.options.tls_cert is not None and self.options.tls_key is not None:
            for source, copy in (
                (self.options.tls_cert, TLS_CERT_COPY),
                (self.options.tls_key, TLS_KEY_COPY),
            ):
                _write_agent_file(self.data_dir / copy, pathlib.Path(source).read_bytes(), self.uid)
        if self.store_url is None or self.store_url.startswith("file://"):
            ensure_local_store(self.store_url or (self.data_dir / "objects").as_uri(), self.uid)
        progress("starting the node helper (root) and preparing storage and templates")
        self.start_helper()
        templates = tuple(t for t in self.options.templates.split(",") if t)
        _prepare_node(self.node, progress, templates=templates)

    def start_helper(self) -> subprocess.Popen[bytes]:
        self.node.stop_helper()  # reaps a dead one (a supervised restart)
        self.node.start_helper()
        assert self.node.helper_process is not None
        self.processes["helper"] = self.node.helper_process
        return self.node.helper_process

    def restart_helper(self) -> subprocess.Popen[bytes]:
        from space.controlplane.local import _prepare_node

        process = self.start_helper()
        _prepare_node(self.node, lambda _line: None, templates=())
        return process

    def spawn_agent(self) -> subprocess.Popen[bytes]:
        host, port = split_listen(self.options.listen)
        tls = self.options.tls_cert is not None
        advertise = self.options.advertise_url or f"{'https' if tls else 'http'}://{self.options.listen}"
        argv = [sys.executable, "-m", "space.node.agent.server", "--data-dir", str(self.data_dir),
                "--listen", f"{host}:{port}", "--control-plane", self.control_plane,
                "--advertise-url", advertise, "--templates", self.options.templates]  # fmt: skip
        token_file = self.data_dir / ENROLMENT_FILENAME
        if token_file.exists():
            argv += ["--bootstrap-token-file", str(token_file)]
        if self.store_url is not None:
            argv += ["--store-url", self.store_url]
        if tls:
            argv += [
                "--tls-cert",
                str(self.data_dir / TLS_CERT_COPY),
                "--tls-key",
                str(self.data_dir / TLS_KEY_COPY),
            ]
        if self.uid:
            argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", *argv]
        log = filemodes.open_private_log(self.data_dir / "agent.log")
        try:
            self.processes["agent"] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                env=agent_environment(getattr(self, "ca_copy", None)), umask=filemodes.OWNER_ONLY_UMASK,
            )  # fmt: skip
        finally:
            os.close(log)
        return self.processes["agent"]

    def wait_enrolled(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the agent holds an identity (then the token file goes); its log's end if it dies first."""
        deadline = time.monotonic() + timeout_s
        while not self.enrolled():
            agent = self.processes["agent"]
            if agent.poll() is not None or time.monotonic() > deadline:
                tail = (self.data_dir / "agent.log").read_text(errors="replace")[-2000:]
                what = "exited" if agent.poll() is not None else "did not enrol in time"
                raise errors.RuntimeFailure(f"the node agent {what}:\n{tail}")
            time.sleep(0.2)
        (self.data_dir / ENROLMENT_FILENAME).unlink(missing_ok=True)

    def stop(self) -> None:
        """The agent first (it deregisters while its helper still answers), then the helper; sandboxes
        keep running and are adopted by the next start."""
        import asyncio

        agent = self.processes.pop("agent", None)
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        self.processes.pop("helper", None)
        asyncio.run(self.node.stop(purge=False))


def _supervise(joined: JoinedNode, token: str | None, ca_file: str | None, *, announce: bool) -> int:
    from space.cli.installation import state_file
    from space.cli.up import _event_log
    from space.controlplane.supervisor import STATUS_FILENAME, Component, Supervisor

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        with stderr.status("joining") as status:
            joined.prepare(token, ca_file, progress=lambda line: status.update(line[:100]))
            status.update(f"starting the node agent; enrolling with {joined.control_plane}")
            joined.spawn_agent()
            joined.wait_enrolled()
    except errors.SpaceError as exc:
        stderr.print(f"error: {exc.code}: {exc.message}")
        joined.stop()
        return 1
    emit = _event_log(joined.data_dir, echo=announce)
    supervisor = Supervisor(
        [Component("helper", joined.restart_helper), Component("agent", joined.spawn_agent)],
        emit=emit, status_file=joined.data_dir / STATUS_FILENAME,
        extra={"supervisor_pid": os.getpid(), "role": "node", "control_plane": joined.control_plane,
               "data_dir": str(joined.data_dir)},
    )  # fmt: skip
    for name, process in joined.processes.items():
        supervisor.adopt(name, process)
    state_file(joined.data_dir).write_text(
        json.dumps({"pid": os.getpid(), "role": "node", "control_plane": joined.control_plane})
    )
    node_id = NodeIdentity.load(default_identity_file(joined.data_dir)).node_id
    emit({"event": "supervisor.started", "pid": os.getpid(), "node_id": node_id})
    typer.echo(f"SPACE_NODE_ID={node_id}")
    sys.stdout.flush()
    try:
        while not stop.wait(TICK_S):
            supervisor.tick()
    finally:
        supervisor.stop()
        joined.stop()
        supervisor.stopped()
        state_file(joined.data_dir).unlink(missing_ok=True)
        emit({"event": "supervisor.stopped", "pid": os.getpid()})
    return 0


@contextlib.contextmanager
def _failing_as_cli() -> Iterator[None]:
    try:
        yield
    except errors.SpaceError as exc:
        raise fail(exc) from None


def join(
    control_plane: Annotated[
        str | None,
        typer.Argument(
            metavar="[CONTROL_PLANE_URL]", help="https://HOST:PORT (default: [node] control_plane)"
        ),
    ] = None,
    *,
    token: Annotated[
        str | None,
        typer.Option(
            "--token", help="enrolment token (`space controlplane token create`); $SPACE_NODE_TOKEN"
        ),
    ] = None,
    token_file: Annotated[
        pathlib.Path | None,
        typer.Option("--token-file", help="read the token from this file (not visible in the process list)"),
    ] = None,
    data_dir: Annotated[str | None, typer.Option("--data-dir", help="default /var/lib/space")] = None,
    config: Annotated[pathlib.Path | None, typer.Option("--config", metavar="FILE", help="TOML file")] = None,
    ca_file: Annotated[
        str | None, typer.Option("--ca-file", metavar="PEM", help="CA that verifies the control plane")
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option("--listen", metavar="ADDR:PORT", help="the agent's RPC (default 127.0.0.1:7070)"),
    ] = None,
    advertise_url: Annotated[
        str | None,
        typer.Option("--advertise-url", metavar="URL", help="how the control plane calls this node"),
    ] = None,
    tls_cert: Annotated[
        str | None, typer.Option("--tls-cert", metavar="PEM", help="serve the node's RPC over HTTPS")
    ] = None,
    tls_key: Annotated[
        str | None, typer.Option("--tls-key", metavar="PEM", help="key of --tls-cert (owner-only)")
    ] = None,
    objects: Annotated[
        str | None, typer.Option("--objects", metavar="URL", help="the object store the control plane uses")
    ] = None,
    install: Annotated[bool, typer.Option("--install", help="apt-get install missing packages")] = False,
    detach: Annotated[bool, typer.Option("--detach", help="return once the node has enrolled")] = False,
    supervisor: Annotated[bool, typer.Option("--supervisor", hidden=True)] = False,
) -> None:
    """Make this machine a node of the fleet whose control plane is at CONTROL_PLANE_URL."""
    with _failing_as_cli():
        token = token or _read_token(token_file) or os.environ.get("SPACE_NODE_TOKEN") or None
        if token is not None and not token.isprintable():
            raise SettingError("--token is not a token (unprintable characters)")
        loaded = read_config(config)
        options = settings(
            JoinOptions, loaded, "node", control_plane=control_plane, data_dir=data_dir, ca_file=ca_file,
            listen=listen, advertise_url=advertise_url, tls_cert=tls_cert, tls_key=tls_key,
        )  # fmt: skip
        check_tls_files(options.tls_cert, options.tls_key)  # a certificate without its key: refused here
        tunables = settings(NodeAgentSettings, loaded, "node", store_url=objects)
        settings(ObjectsOptions, loaded, "objects")
        split_listen(options.listen)
        if os.geteuid() != 0:
            raise errors.PermissionDenied("`space node join` starts the node's root helper: run it as root")
        missing = missing_prerequisites()
        if missing and install:
            install_prerequisites(missing)
            missing = missing_prerequisites()
        if missing:
            listed = ", ".join(f"{command} ({package})" for command, package in missing.items())
            raise errors.Unavailable(
                f"this machine lacks what a node needs: {listed}; --install installs them"
            )
        if ca_file is not None and not pathlib.Path(ca_file).is_file():
            raise SettingError(f"--ca-file {ca_file} does not exist")
        _export(loaded)
        if options.control_plane is None:
            raise SettingError("give CONTROL_PLANE_URL (or control_plane in the file's [node] section)")
        joined = JoinedNode(options, tunables.store_url)
        if joined.enrolled():
            token = None  # a node that holds an identity re-registers with it
        elif token is None:
            raise SettingError("this node has not enrolled yet: give --token")
        probe_control_plane(joined.control_plane, token, ca_file=options.ca_file)
    filemodes.set_owner_only_umask()
    if not detach:
        raise typer.Exit(_supervise(joined, token, options.ca_file, announce=not supervisor))
    _detach(joined, token, sys.argv[1:])


def _read_token(path: pathlib.Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(errors="strict")[:4096].strip() or None
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingError(f"--token-file {path}: cannot read it: {exc}") from exc


def _export(loaded: ConfigFile) -> None:
    export_to_environment(loaded, "node", JoinOptions)
    export_to_environment(loaded, "node", NodeAgentSettings)
    export_to_environment(loaded, "objects", ObjectsOptions)


def _detach(joined: JoinedNode, token: str | None, argv: list[str]) -> None:
    """Start the supervisor in its own session (its output: DATA_DIR/space.log) and wait until it runs.
    The token goes through the environment, never the command line (which others can read)."""
    from space.cli.installation import state_file

    joined.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    state_file(joined.data_dir).unlink(missing_ok=True)
    log = filemodes.open_private_log(joined.data_dir / "space.log")
    arguments = [a for a in argv if a != "--detach"]
    if "--token" in arguments:
        at = arguments.index("--token")
        del arguments[at : at + 2]
    arguments = [a for a in arguments if not a.startswith(("--token=", "--token-file="))]
    if "--token-file" in arguments:
        at = arguments.index("--token-file")
        del arguments[at : at + 2]
    environment = {**os.environ, **({"SPACE_NODE_TOKEN": token} if token else {})}
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "space.cli.main", *arguments, "--supervisor"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=environment,
        )  # fmt: skip
    finally:
        os.close(log)
    with stderr.status(f"joining (log: {joined.data_dir / 'space.log'})"):
        while not state_file(joined.data_dir).exists():
            if child.poll() is not None:
                stderr.print((joined.data_dir / "space.log").read_text(errors="replace")[-3000:])
                raise typer.Exit(1)
            time.sleep(0.2)
    stderr.print(f"node joined {joined.control_plane}; `space down --data-dir {joined.data_dir}` stops it")
