"""The node agent's process: argument parsing, building the agent, serving its RPC, reporting to the control
plane. `python -m space.node.agent.server` runs `main` (space.node.agent.server).

    python -m space.node.agent.server --data-dir D --listen 127.0.0.1:PORT [--rpc-token-file F] \\
        [--control-plane URL [--bootstrap-token-file F] [--advertise-url URL]] [--driver runsc|fake] \\
        [--no-prepare] [--listen-socket PATH] [--tls-cert PEM --tls-key PEM]

Invariants:
- The RPC accepts only this node's own token, never the bootstrap token: a node given the same secret for
  both refuses to start (ADR 0021).
- The process's files are its own (umask 077, ADR 0022); SIGPIPE does not kill it when a client vanishes.
- SIGINT/SIGTERM stop the RPC (requests in flight finish; heartbeats go on meanwhile), then the heartbeat,
  then deregister the node (`offline`) and only if that was accepted release its lease (ADR 0033), then
  close the agent; sandboxes keep running (runsc) for the next start to adopt. A node that could not
  deregister keeps its lease armed in the helper, which fences its sandboxes when it ends.
- With --tls-cert/--tls-key the RPC is HTTPS only (the unix socket too) and the advertised URL defaults
  to https://LISTEN; a certificate without its key, or a key others can read, stops the start before
  anything is built (identity.check_tls_files; ADR 0079 "TLS to nodes").
- Environment variables are read once, here, through NodeAgentSettings; the flags win over them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Generator, Sequence

import uvicorn
from fastapi import FastAPI

from space.core import errors
from space.core.settings import DiskReserve
from space.node.agent import template_travel
from space.node.agent.agent import NodeAgent
from space.node.agent.app import create_app
from space.node.agent.egress_settings import EgressSettings
from space.node.agent.egress_settings import load_settings as load_egress_settings
from space.node.agent.egress_wiring import install as egress_install
from space.node.agent.fencing import Fence
from space.node.agent.helper_client import HelperClient
from space.node.agent.identity import (
    NodeIdentity,
    check_tls_files,
    default_identity_file,
    default_rpc_token_file,
    load_or_create_rpc_token,
    read_private,
)
from space.node.agent.pools import WarmPools, parse_pool_sizes
from space.node.agent.registration import IncompatiblePeer, Reporter
from space.node.agent.rpc_listen import KEEPALIVE_S, close_listeners, open_listeners
from space.node.agent.service import NodeService
from space.node.agent.settings import NodeAgentSettings
from space.node.rlimits import raise_fd_limit
from space.rest.logs import configure_process_logging, uvicorn_log_config

log = logging.getLogger("space.node.rpc")
#: The agent's exit status when the control plane speaks no common protocol version (EX_CONFIG): its
#: systemd unit does not restart it for that (RestartPreventExitStatus; ADR 0071).
EXIT_INCOMPATIBLE = 78
DESCRIPTION = (
    "The node agent's RPC service: lifecycle verbs for the reconciler and the data plane for the gateway."
)


def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError("--listen is HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def default_store_url(data_dir: pathlib.Path) -> str:
    """A one-machine node's store: a directory next to its btrfs image (create it for the agent user with
    space.node.local.ensure_local_store)."""
    return (data_dir / "objects").as_uri()


def _build_agent(
    data_dir: pathlib.Path, driver: str, store_url: str | None, settings: NodeAgentSettings
) -> NodeAgent:
    if driver == "fake":
        from space.node.drivers.fake import FakeDriver  # development only: not imported on a real node
        from space.objectstore.backends import open_store

        log.warning("--driver fake: sandboxes are host processes WITHOUT ISOLATION (development only)")
        return NodeAgent(FakeDriver(data_dir), store=open_store(store_url) if store_url else None)
    from space.node.local import connect_agent  # the runsc driver and its helper client

    return connect_agent(data_dir, store_url=store_url, settings=settings)


def _enrolment(
    service: NodeService,
    data_dir: pathlib.Path,
    rpc_token: str,
    identity_file: pathlib.Path | None,
    bootstrap_token_file: pathlib.Path | None,
) -> str | None:
    """Load the node's identity into `service` and return the bootstrap token, if any (never the RPC
    token: InvalidArgument if the two are the same secret)."""
    service.identity = NodeIdentity.load(identity_file or default_identity_file(data_dir))
    bootstrap_token: str | None = None
    if bootstrap_token_file is not None:
        bootstrap_token = read_private(bootstrap_token_file) or None
    if bootstrap_token is not None and hmac.compare_digest(bootstrap_token.encode(), rpc_token.encode()):
        raise errors.InvalidArgument(
            "the node's RPC token must not be the bootstrap token: every holder of that one could call "
            "this node (give --rpc-token-file its own file, or leave it out to have one made)",
            field="rpc_token",
        )
    if not service.identity.enrolled and bootstrap_token is None:
        log.warning("this node has no identity yet and no --bootstrap-token-file: it cannot enrol")
    return bootstrap_token


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGINT/SIGTERM once it has stopped, which would end the process before
    `serve()` closes the agent; this server only stops, and `serve()` returns normally."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _open_agent(
    data_dir: pathlib.Path, driver: str, store_url: str | None, settings: NodeAgentSettings
) -> NodeAgent:
    try:
        return _build_agent(data_dir, driver, store_url, settings)
    except errors.Unavailable as exc:
        # e.g. the default store directory cannot be created by this user: serve without suspend/restore
        # rather than not at all (those requests then answer 400 naming the missing store).
        log.warning("object store %s unusable (%s): suspend/restore disabled on this node", store_url, exc)
        return _build_agent(data_dir, driver, None, settings)


async def serve(
    data_dir: pathlib.Path,
    listen: tuple[str, int],
    *,
    rpc_token_file: pathlib.Path | None = None,
    bootstrap_token_file: pathlib.Path | None = None,
    identity_file: pathlib.Path | None = None,
    control_plane: str | None = None,
    advertise_url: str | None = None,
    driver: str = "runsc",
    templates: Sequence[str] = ("python",),
    prepare: bool = True,
    log_level: str = "info",
    store_url: str | None = None,
    egress: EgressSettings | None = None,
    disk_reserve: DiskReserve | None = None,
    settings: NodeAgentSettings | None = None,
    pools: dict[str, int] | None = None,
    listen_socket: pathlib.Path | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> None:
    """Run the node agent's RPC until SIGINT/SIGTERM; sandboxes keep running when it stops (runsc). On a
    node whose sandboxes get a network, the agent runs the node's egress gateway (`egress`: its settings;
    default: state in DATA_DIR/egress, fixed ports, the system resolver and trust store).

    The RPC accepts only this node's own token (`rpc_token_file`, default DATA_DIR/identity/rpc.token, made
    at the first start); the bootstrap token (`bootstrap_token_file`) only enrols a node that has no
    identity (`identity_file`, default DATA_DIR/identity/node.json) the control plane accepts (ADR 0021)."""
    tls = check_tls_files(tls_cert, tls_key)  # before anything is built or started
    settings = settings or NodeAgentSettings()
    agent = _open_agent(data_dir, driver, store_url, settings)
    if disk_reserve is not None:
        agent.disk_reserve = disk_reserve  # ADR 0027
    if prepare:
        await agent.prepare(tuple(templates), progress=lambda line: log.info("prepare: %s", line))
    # After prepare: on a runsc node the helper's node.prepare made the identity directory for this user.
    rpc_token = load_or_create_rpc_token(rpc_token_file or default_rpc_token_file(data_dir))
    app = create_app(agent, rpc_token, templates=templates, settings=settings)
    service: NodeService = app.state.service
    bootstrap_token: str | None = None
    if control_plane:
        bootstrap_token = _enrolment(service, data_dir, rpc_token, identity_file, bootstrap_token_file)
    host, port = listen
    reporter: Reporter | None = None
    reporting: asyncio.Task[None] | None = None
    fence = node_fence(agent, enforce_in_agent=settings.fence_without_helper)
    if control_plane:
        # Heartbeats start before the slower rest of the start-up (egress, adopting the sandboxes): a
        # restarted agent must renew the lease its helper still holds before it ends (ADR 0033).
        url = advertise_url or f"{'https' if tls else 'http'}://{host}:{port}"
        reporter = Reporter(service, control_plane, bootstrap_token, url, rpc_token, fence=fence)
        reporting = asyncio.create_task(reporter.run())
    try:
        # Before recover(): adopted sandboxes get their egress policies as they are reconnected.
        service.egress = await egress_install(
            agent, egress or EgressSettings(state_dir=data_dir / "egress"), control_plane=control_plane,
            identity=service.identity,
        )  # fmt: skip
        await _adopt(agent, app)
        start_pools(agent, service, pools, settings)
        app.state.metrics.start()  # the metrics history (ADR 0053) of the sandboxes just adopted onwards
        server = _Server(
            uvicorn.Config(
                app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off",
                timeout_keep_alive=KEEPALIVE_S, log_config=uvicorn_log_config(),
                ssl_certfile=tls_cert, ssl_keyfile=tls_key,
            )
        )  # fmt: skip
        # TCP, and with `listen_socket` a unix socket for a control plane on this machine (ADR 0044).
        listeners = open_listeners(host, port, listen_socket)
        if reporting is not None:  # a control plane of no common protocol version ends the agent (ADR 0071)
            reporting.add_done_callback(lambda task: _stop_if_refused(task, server))
        try:
            await server.serve(sockets=listeners)  # on SIGTERM: stops accepting, lets requests finish
        finally:
            close_listeners(listeners, listen_socket)
    finally:
        if reporter is not None and reporting is not None:
            # Heartbeats ran (and renewed the lease) while requests drained; the one in flight is let finish,
            # so that deregister() names the latest beat the control plane recorded.
            reporter.stop()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, IncompatiblePeer):
                await asyncio.wait_for(reporting, settings.control_plane_timeout_s + 1.0)
        if reporter is not None:
            await reporter.deregister()  # offline, then the lease released: the next start adopts
        await app.state.metrics.close()
        await fence.close()
        await agent.close()
    _raise_if_refused(reporting)


async def _adopt(agent: NodeAgent, app: FastAPI) -> None:
    """Adopt the sandboxes already on this node, and sweep the template builds a killed agent left."""
    adopted = await agent.recover()
    if adopted:
        log.info("adopted %d sandboxes already on this node: %s", len(adopted), ", ".join(adopted))
    # Builds a killed agent left: their build sandboxes (just adopted as ordinary ones) are destroyed,
    # and the user templates held here join the node's reported templates before its first heartbeat.
    try:
        await app.state.template_builds.held()
    except errors.SpaceError as exc:
        log.warning("the sweep of interrupted template builds failed, retried at the next build: %s", exc)


def _raise_if_refused(reporting: asyncio.Task[None] | None) -> None:
    """After a clean stop: the reporter's IncompatiblePeer, if that is what ended it (main exits with it)."""
    if reporting is not None and reporting.done() and not reporting.cancelled():
        refusal = reporting.exception()
        if isinstance(refusal, IncompatiblePeer):
            raise refusal


def _stop_if_refused(task: asyncio.Task[None], server: uvicorn.Server) -> None:
    """The reporter ended on an incompatible control plane: stop serving (serve() then raises it)."""
    if not task.cancelled() and isinstance(task.exception(), IncompatiblePeer):
        log.critical("%s", task.exception())
        server.should_exit = True


def start_pools(
    agent: NodeAgent, service: NodeService, sizes: dict[str, int] | None, settings: NodeAgentSettings
) -> None:
    """Give the agent its warm pools (ADR 0047) and start filling them; nothing when no size is set or the
    driver keeps no pools."""
    if not sizes or not any(sizes.values()):
        return
    if agent.driver.names is None:
        log.warning("--pools ignored: the %s driver keeps no warm pools", agent.driver.name)
        return
    agent.pools = WarmPools(
        lambda: agent.driver, sizes, busy=lambda: agent.steps_in_flight > 0, room=service.has_room,
        fill_yield_s=settings.pool_fill_yield_s, fill_concurrency=settings.pool_fill_concurrency,
        before_fill=lambda template: template_travel.ensure_template_here(agent, template),
    )  # fmt: skip
    agent.pools.start()
    log.info("warm pools: %s", ", ".join(f"{t}={n}" for t, n in sizes.items()))


def node_fence(agent: NodeAgent, *, enforce_in_agent: bool = False) -> Fence:
    """The node's fence (ADR 0033): held by the root helper when the driver has one; else (the fake
    driver) watched on this loop if `enforce_in_agent` (NodeAgentSettings.fence_without_helper), stopping
    every runtime when the lease ends, or not enforced at all."""
    helper = getattr(agent.driver, "helper", None)
    if isinstance(helper, HelperClient):
        return Fence(helper)
    if not enforce_in_agent:
        return Fence(None)

    async def stop_all() -> None:
        sandbox_ids = list(agent.sandboxes)
        for step in (agent.driver.pause, agent.driver.stop):
            for sandbox_id in sandbox_ids:
                with contextlib.suppress(errors.SpaceError):
                    await step(sandbox_id)

    return Fence(None, stop_all)


def _parser(settings: NodeAgentSettings) -> argparse.ArgumentParser:
    """The flags; the defaults of --store-url and --disk-reserve come from the environment (`settings`)."""
    parser = argparse.ArgumentParser(prog="python -m space.node.agent.server", description=DESCRIPTION)
    parser.add_argument("--data-dir", type=pathlib.Path, required=True)
    parser.add_argument("--listen", type=_parse_listen, default=("127.0.0.1", 7070), help="HOST:PORT")
    parser.add_argument(
        "--listen-socket", type=pathlib.Path,
        help="also serve the RPC on this unix socket (mode 0600, this user's), for a control plane on this "
        "machine (its --node-socket URL=PATH; ADR 0044), e.g. DATA_DIR/identity/rpc.sock",
    )  # fmt: skip
    parser.add_argument(
        "--rpc-token-file", type=pathlib.Path,
        help="this node's own RPC secret, required on every RPC call (mode 0600); created with a random "
        "token if absent (default DATA_DIR/identity/rpc.token); sent to the control plane at registration",
    )  # fmt: skip
    parser.add_argument(
        "--bootstrap-token-file", type=pathlib.Path,
        help="the cluster's bootstrap token or a single-use enrolment token (mode 0600): used only to enrol "
        "a node without an identity; never accepted on the RPC",
    )  # fmt: skip
    parser.add_argument(
        "--identity-file",
        type=pathlib.Path,
        help="where the node keeps its node id and identity (default DATA_DIR/identity/node.json)",
    )
    parser.add_argument("--control-plane", help="base URL of the control plane to register with")
    parser.add_argument(
        "--advertise-url",
        help="the URL the control plane should call (default http://LISTEN, https://LISTEN with --tls-cert)",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="serve the RPC over HTTPS with this certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert (owner-only)")
    parser.add_argument("--driver", choices=["runsc", "fake"], default="runsc")
    parser.add_argument("--templates", default="python", help="comma-separated templates to prepare")
    parser.add_argument("--no-prepare", action="store_true", help="skip node/template preparation")
    parser.add_argument(
        "--pools", default=settings.pools, metavar="TEMPLATE=N,...",
        help="warm pool sizes per template: that many sandboxes kept started, so a create binds one "
        "(default $SPACE_NODE_POOLS, else none; ADR 0047)",
    )  # fmt: skip
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--store-url", default=settings.store_url,
        help="object store for templates and suspended sandboxes (file:///dir or s3://bucket/prefix?...); "
        "default $SPACE_STORE_URL, else file://DATA_DIR/objects",
    )  # fmt: skip
    parser.add_argument(
        "--egress-config", type=pathlib.Path,
        help="JSON operator settings of the node's egress gateway (network = sandbox): ports, hosts (a "
        "static name -> addresses map instead of the system resolver), trust_store, allow_networks; see "
        "space.node.agent.egress_settings.load_settings",
    )  # fmt: skip
    parser.add_argument(
        "--disk-reserve", default=settings.disk_reserve, metavar="PERCENT,MB",
        help="free space the node keeps: creates, snapshots, checkpoints and imports are refused when they "
        "would leave less than min(PERCENT of the disk, MB) (default 5,2048; ADR 0027)",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    settings = NodeAgentSettings()
    parser = _parser(settings)
    args = parser.parse_args(argv)
    try:
        pools = parse_pool_sizes(args.pools)
    except errors.InvalidArgument as exc:
        parser.error(f"--pools: {exc.message}")
    try:
        percent, mb = args.disk_reserve.split(",")
        disk_reserve = DiskReserve(percent=float(percent), mb=int(mb))
    except ValueError:  # pydantic's ValidationError is a ValueError
        parser.error("--disk-reserve is PERCENT,MB: a percentage from 0 to 50 and a whole number of MB")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    os.umask(0o077)  # the agent's object-store parts, CA key, policies: its own only (ADR 0022)
    try:  # text, or one JSON object per line (SPACE_LOG_FORMAT; ADR 0071)
        configure_process_logging("agent", args.log_level)
    except errors.InvalidArgument as exc:
        parser.error(exc.message)
    data_dir = args.data_dir.resolve()
    raise_fd_limit()  # descriptors per sandbox channel, stream and connection
    # uvicorn handles SIGINT/SIGTERM inside serve(); SIGPIPE must not kill us when a client vanishes.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        asyncio.run(
            serve(
                data_dir, args.listen, rpc_token_file=args.rpc_token_file,
                bootstrap_token_file=args.bootstrap_token_file, identity_file=args.identity_file,
                control_plane=args.control_plane, advertise_url=args.advertise_url, driver=args.driver,
                templates=tuple(t for t in args.templates.split(",") if t), prepare=not args.no_prepare,
                log_level=args.log_level,
                store_url=args.store_url or default_store_url(data_dir),
                egress=load_egress_settings(data_dir / "egress", args.egress_config),
                disk_reserve=disk_reserve, settings=settings, pools=pools, listen_socket=args.listen_socket,
                tls_cert=args.tls_cert, tls_key=args.tls_key,
            )
        )  # fmt: skip
    except IncompatiblePeer as exc:  # logged; said once more where a terminal or journal shows it
        print(f"space node agent: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INCOMPATIBLE) from exc
