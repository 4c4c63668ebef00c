"""`space controlplane run|token create|admin-key create`: a control-plane replica of a fleet (ADR 0070).

`run` serves the API of one replica in the foreground (a service manager keeps it running): any number of
replicas may share one PostgreSQL database (`--database`), one object store (`--objects s3://...`), the
cluster's node token and the key service's directory (or a KMS). Each start migrates the database first;
migrations take an advisory lock, so when replicas start together one upgrades and the others wait
(space.controlplane.store.migrate).

Invariants:
- Settings layer as space.cli.config_file says: flags over environment over the `--config` file. The
  tunables of the file's [controlplane] and the credentials of its [objects] are handed to the server as the
  environment variables they are (only where the variable is unset), so the server reads them the one way
  it always has.
- A node token made here is 0600 and never printed; enrolment tokens are printed once, on stdout only.
"""

from __future__ import annotations

import os
import pathlib
import secrets
from typing import Annotated

import typer

from space.cli._common import handles_errors
from space.cli.config_file import (
    ConfigFile,
    ObjectsOptions,
    RunOptions,
    SettingError,
    export_to_environment,
    read_config,
    settings,
)
from space.controlplane.settings import ControlPlaneSettings

controlplane_app = typer.Typer(help="A control-plane replica of a fleet (ADR 0070).", no_args_is_help=True)
token_app = typer.Typer(help="Tokens that enrol new nodes (ADR 0021).", no_args_is_help=True)
admin_key_app = typer.Typer(help="The bootstrap organisation admin key.", no_args_is_help=True)
controlplane_app.add_typer(token_app, name="token")
controlplane_app.add_typer(admin_key_app, name="admin-key")

ConfigOption = Annotated[
    pathlib.Path | None,
    typer.Option("--config", metavar="FILE", help="TOML configuration file (docs/operations.md)"),
]
DatabaseOption = Annotated[
    str | None,
    typer.Option(
        "--database", metavar="URL", help="postgresql://... (default: SQLite in the data directory)"
    ),
]
DataDirOption = Annotated[
    str | None,
    typer.Option("--data-dir", help="this replica's directory (default /var/lib/space-controlplane)"),
]


def split_listen(listen: str) -> tuple[str, int]:
    """HOST and PORT of a checked `ADDR:PORT` (brackets of an IPv6 address removed)."""
    host, _, port = listen.rpartition(":")
    number = int(port)
    if not 0 < number < 65536:
        raise SettingError(f"listen address {listen!r}: port out of range", field="listen")
    return host.strip("[]"), number


def _node_token_file(options: RunOptions, data_dir: pathlib.Path) -> pathlib.Path:
    """The cluster's node token: the configured file (which must exist), or DATA_DIR/node.token, made
    once with a random token."""
    if options.node_token_file is not None:
        path = pathlib.Path(options.node_token_file)
        if not path.is_file():
            raise SettingError(f"node token file {path} does not exist", field="node_token_file")
        return path
    path = data_dir / "node.token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
    return path


def server_argv(config: ConfigFile, options: RunOptions, tunables: ControlPlaneSettings) -> list[str]:
    """The arguments of space.controlplane.server for these options (data directory made, 0700)."""
    if (options.tls_cert is None) != (options.tls_key is None):
        raise SettingError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
    for path in (options.tls_cert, options.tls_key):
        if path is not None and not pathlib.Path(path).is_file():
            raise SettingError(f"TLS file {path} does not exist", field="tls")
    host, port = split_listen(options.listen)
    data_dir = pathlib.Path(options.data_dir)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    argv = ["--data-dir", str(data_dir), "--host", host, "--port", str(port),
            "--node-token-file", str(_node_token_file(options, data_dir))]  # fmt: skip
    if options.database is not None:
        argv += ["--database-url", options.database]
    if tunables.store_url is not None:
        argv += ["--store-url", tunables.store_url]
    if options.tls_cert is not None and options.tls_key is not None:
        argv += ["--tls-cert", options.tls_cert, "--tls-key", options.tls_key]
    return argv


@controlplane_app.command("run")
@handles_errors
def run(
    *,
    config: ConfigOption = None,
    database: DatabaseOption = None,
    objects: Annotated[
        str | None,
        typer.Option(
            "--objects",
            metavar="URL",
            help="object store shared with the nodes: s3://BUCKET/PREFIX (endpoint and credentials from the "
            "AWS_* environment or [objects]) or file:///DIR",
        ),
    ] = None,
    listen: Annotated[
        str | None, typer.Option("--listen", metavar="ADDR:PORT", help="default 127.0.0.1:8470")
    ] = None,
    tls_cert: Annotated[str | None, typer.Option("--tls-cert", metavar="PEM", help="serve HTTPS")] = None,
    tls_key: Annotated[str | None, typer.Option("--tls-key", metavar="PEM", help="key of --tls-cert")] = None,
    data_dir: DataDirOption = None,
    node_token_file: Annotated[
        str | None, typer.Option("--node-token-file", help="the cluster's node token (replicas share it)")
    ] = None,
    nodes_ca_file: Annotated[
        str | None,
        typer.Option(
            "--nodes-ca-file", metavar="PEM", help="CA that verifies https nodes (default: the system's)"
        ),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
) -> None:
    """Run one control-plane replica in the foreground (migrating the database first, under a lock)."""
    loaded = read_config(config)
    options = settings(
        RunOptions, loaded, "controlplane", database=database, listen=listen, tls_cert=tls_cert,
        tls_key=tls_key, data_dir=data_dir, node_token_file=node_token_file,
    )  # fmt: skip
    tunables = settings(
        ControlPlaneSettings, loaded, "controlplane", store_url=objects, nodes_ca_file=nodes_ca_file
    )
    settings(ObjectsOptions, loaded, "objects")  # checked before anything starts
    if tunables.nodes_ca_file is not None:  # checked before server_argv makes the data directory
        if not pathlib.Path(tunables.nodes_ca_file).is_file():
            raise SettingError(
                f"nodes CA file {tunables.nodes_ca_file} does not exist", field="nodes_ca_file"
            )
        os.environ["SPACE_NODES_CA_FILE"] = tunables.nodes_ca_file  # the server's node pools read it there
    argv = server_argv(loaded, options, tunables)
    export_to_environment(loaded, "controlplane", ControlPlaneSettings)
    export_to_environment(loaded, "objects", ObjectsOptions)
    from space.controlplane import server

    raise typer.Exit(server.main([*argv, "--log-level", log_level]))


def _database_url(config: pathlib.Path | None, database: str | None, data_dir: str | None) -> str:
    from space.controlplane.store.engine import sqlite_url

    options = settings(RunOptions, read_config(config), "controlplane", database=database, data_dir=data_dir)
    return options.database or sqlite_url(pathlib.Path(options.data_dir))


@token_app.command("create")
@handles_errors
def token_create(
    config: ConfigOption = None,
    database: DatabaseOption = None,
    data_dir: DataDirOption = None,
    uses: Annotated[int, typer.Option("--uses", min=1, max=1000, help="nodes it may enrol")] = 1,
    ttl: Annotated[
        float, typer.Option("--ttl", min=0, max=30 * 86400, help="seconds it stays valid (0: no expiry)")
    ] = 3600.0,
) -> None:
    """Make a token that enrols new nodes (`space node join URL --token T`); printed once."""
    from space.controlplane.store.migrate import migrate
    from space.controlplane.store.store import Store

    url = _database_url(config, database, data_dir)
    migrate(url)
    store = Store(url)
    try:
        _token_id, secret = store.create_enrolment_token(uses=uses, ttl_s=ttl or None)
    finally:
        store.close()
    typer.echo(secret)


@admin_key_app.command("create")
@handles_errors
def admin_key_create(
    config: ConfigOption = None,
    database: DatabaseOption = None,
    data_dir: DataDirOption = None,
    org: Annotated[str, typer.Option("--org", help="organisation (made with a default project)")] = "default",
) -> None:
    """Make an organisation admin key (the organisation too, the first time); printed once."""
    from space.controlplane.store.migrate import migrate
    from space.controlplane.store.store import Store

    url = _database_url(config, database, data_dir)
    migrate(url)
    store = Store(url)
    try:
        record = store.get_org_by_name(org) or store.create_org(org)
        if store.get_project_by_name(record.id, "default") is None:
            store.create_project(record.id, "default")
        _key, secret = store.create_api_key(None, record.id, "admin")
    finally:
        store.close()
    typer.echo(secret)
