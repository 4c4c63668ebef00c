"""`python -m space.controlplane.server`: migrate the database, then serve the API (and reconcile).

Several of these processes may share one PostgreSQL database: migrations take an advisory lock, and the
reconcilers divide the work through leases.
"""

from __future__ import annotations

import argparse
import pathlib

import uvicorn

from space.controlplane.api.app import create_app
from space.controlplane.e2b import serve as e2b_serve
from space.controlplane.e2b.serve import E2bListen, parse_listen
from space.controlplane.keys import OrgDataKeys
from space.controlplane.node_pools import parse_sockets
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.migrate import migrate
from space.controlplane.store.store import Store
from space.core import errors, retention
from space.node.filemodes import set_owner_only_umask
from space.node.rlimits import raise_fd_limit
from space.rest.logs import configure_process_logging, uvicorn_log_config


def build_store(database_url: str) -> Store:
    migrate(database_url)
    return Store(database_url)


def _check_tls(parser: argparse.ArgumentParser, args: argparse.Namespace, listen: E2bListen) -> None:
    """--tls-cert and --tls-key come together, and not with the E2B front (served in plain HTTP)."""
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert is not None and (listen.api or listen.sandbox):
        parser.error("the E2B front is served without TLS: leave out --e2b-*-listen with --tls-cert")


def main(argv: list[str] | None = None) -> int:
    settings = ControlPlaneSettings.from_env()  # environment variables: space.controlplane.settings
    parser = argparse.ArgumentParser(description="SPACE control plane")
    parser.add_argument("--data-dir", type=pathlib.Path, required=True)
    parser.add_argument("--database-url", default=None, help="default: SQLite in the data directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument(
        "--node-token-file", type=pathlib.Path, required=True,
        help="the cluster's bootstrap token (mode 0600): enrols new nodes (as do enrolment tokens, see "
        "space.controlplane.enrolment) and keys the sealing of their RPC tokens; replicas share it",
    )  # fmt: skip
    parser.add_argument(
        "--store-url",
        default=settings.store_url,
        help="object store shared with the nodes (file:///dir or s3://bucket?endpoint=...): suspend, restore"
        " and checkpoint uploads; the nodes must be started with the same URL",
    )
    parser.add_argument(
        "--keys-dir",
        type=pathlib.Path,
        default=settings.keys_dir,
        help="directory of the embedded key service that wraps data keys (default DATA_DIR/keys); control"
        " plane replicas must share it (or use an external KMS)",
    )
    parser.add_argument(
        "--snapshot-min-intervals",
        default=settings.snapshot_min_intervals,
        help="DISK,FULL: the shortest disk_every_s and full_every_s a snapshot policy may ask for, in "
        "seconds (default 60,300; ADR 0027)",
    )
    parser.add_argument(
        "--node-socket", action="append", default=[], metavar="URL=PATH",
        help="reach the node registered at URL through the unix socket PATH (that agent's --listen-socket, "
        "on this machine; repeatable; added to $SPACE_NODE_POOL_SOCKETS; ADR 0044)",
    )  # fmt: skip
    parser.add_argument(
        "--e2b-api-listen", default=settings.e2b_api_listen, metavar="HOST:PORT",
        help="also serve E2B's control API there (space.controlplane.e2b; docs/e2b.md)",
    )  # fmt: skip
    parser.add_argument(
        "--e2b-sandbox-listen", default=settings.e2b_sandbox_listen, metavar="HOST:PORT",
        help="also serve E2B's in-sandbox API at the root of that address (docs/e2b.md)",
    )  # fmt: skip
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.node_socket:
        sockets = ",".join(filter(None, [settings.pool_sockets, *args.node_socket]))
        settings = settings.model_copy(update={"pool_sockets": sockets})
    try:
        parse_sockets(settings.pool_sockets)
    except errors.InvalidArgument as exc:
        parser.error(exc.message)
    listen = E2bListen(api=args.e2b_api_listen or None, sandbox=args.e2b_sandbox_listen or None)
    _check_tls(parser, args, listen)
    for value, flag in ((listen.api, "--e2b-api-listen"), (listen.sandbox, "--e2b-sandbox-listen")):
        try:
            if value is not None:
                parse_listen(value, flag)
        except errors.InvalidArgument as exc:
            parser.error(exc.message)
    try:
        disk_s, full_s = (int(part) for part in args.snapshot_min_intervals.split(","))
        retention.set_minimum_intervals(disk_s, full_s)
    except (ValueError, errors.InvalidArgument):
        parser.error("--snapshot-min-intervals is DISK,FULL: two whole numbers of seconds, each at least 1")
    set_owner_only_umask()  # the database, its WAL, key files: owner-only (ADR 0022)
    try:  # text, or one JSON object per line (SPACE_LOG_FORMAT; ADR 0071)
        configure_process_logging("controlplane", args.log_level)
    except errors.InvalidArgument as exc:
        parser.error(exc.message)
    raise_fd_limit()  # every relayed stream holds a client and a node connection
    url = args.database_url or sqlite_url(args.data_dir)
    store = build_store(url)
    app = create_app(
        store,
        node_token=args.node_token_file.read_text().strip(),
        data_dir=args.data_dir,
        store_url=args.store_url,
        data_keys=OrgDataKeys.local(store, args.keys_dir) if args.keys_dir else None,
        settings=settings,
    )
    if listen.api or listen.sandbox:  # the E2B front beside the API, over the same services
        e2b_serve.run(app, host=args.host, port=args.port, log_level=args.log_level, listen=listen)
    else:
        uvicorn.run(
            app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
            log_config=uvicorn_log_config(), ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
