"""`space backup create|restore`: the control plane's state in one archive, and back (ADR 0062).

The archive holds secrets (the credentials' master key, the cluster's node token, the org keys): it is
written 0600 and never over an existing file; keep it like the data directory itself (docs/operations.md).

Exit codes besides those of space.cli._common: 4 the target is in use (a running control plane) or already
holds one (`--force` replaces it); 7 the archive is refused (damaged, truncated, tampered with, an unsafe
or oversized member); 8 its schema is newer than this SPACE knows.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Annotated

import typer

from space.cli._common import exit_code_for
from space.cli.installation import DEFAULT_DATA_DIR, supervisor_pid
from space.core import errors
from space.node import filemodes

if TYPE_CHECKING:  # the control plane's machinery is imported by the commands that run it
    from space.controlplane.backup.state import Installation

EXIT_ARCHIVE_REFUSED = 7
EXIT_SCHEMA_TOO_NEW = 8

backup_app = typer.Typer(help="Back up and restore the control plane's state.", no_args_is_help=True)

DataDir = Annotated[
    pathlib.Path,
    typer.Option(
        "--data-dir", help="the control plane's data directory (master key; SQLite unless --database)"
    ),
]
Database = Annotated[
    str | None,
    typer.Option(
        "--database", metavar="URL", help="the database (postgresql://...; default: SQLite in DATA_DIR)"
    ),
]
TokenFile = Annotated[
    pathlib.Path | None,
    typer.Option("--node-token-file", help="the cluster's node token (default DATA_DIR/node.token)"),
]
KeysDir = Annotated[
    pathlib.Path | None,
    typer.Option("--keys-dir", help="the embedded key service's directory (default DATA_DIR/keys)"),
]


def exit_code(error: errors.SpaceError) -> int:
    if error.details.get("reason") == "schema_too_new":
        return EXIT_SCHEMA_TOO_NEW
    if isinstance(error, errors.ArtifactCorrupt | errors.TooLarge):
        return EXIT_ARCHIVE_REFUSED
    return exit_code_for(error)


def _fail(error: errors.SpaceError | OSError) -> typer.Exit:
    if isinstance(error, OSError):  # a file of the installation or the archive we may not read or write
        denied = isinstance(error, PermissionError)
        error = (errors.PermissionDenied if denied else errors.Unavailable)(
            f"{error.filename}: {error.strerror}"
        )
    typer.echo(f"error: {error.code}: {error.message}", err=True)
    return typer.Exit(exit_code(error))


def _installation(
    data_dir: pathlib.Path,
    database: str | None,
    token_file: pathlib.Path | None,
    keys_dir: pathlib.Path | None,
) -> Installation:
    from space.controlplane.backup.state import Installation

    return Installation(
        data_dir.resolve(), database,
        token_file.resolve() if token_file else None, keys_dir.resolve() if keys_dir else None,
    )  # fmt: skip


@backup_app.command("create")
def create(
    *,
    data_dir: DataDir = DEFAULT_DATA_DIR,
    database: Database = None,
    node_token_file: TokenFile = None,
    keys_dir: KeysDir = None,
    output: Annotated[
        pathlib.Path | None,
        typer.Option("--output", "-o", help="the archive to write (default ./space-backup-TIMESTAMP.tar.gz)"),
    ] = None,
) -> None:
    """Back up the control plane's database and keys, also while it runs."""
    from space.controlplane.backup.state import create_backup, default_output

    filemodes.set_owner_only_umask()
    target = (output or default_output(pathlib.Path.cwd())).absolute()
    try:
        manifest = create_backup(_installation(data_dir, database, node_token_file, keys_dir), target)
    except (errors.SpaceError, OSError) as error:
        raise _fail(error) from None
    size = target.stat().st_size
    typer.echo(str(target))
    typer.echo(
        f"{manifest.engine} database at schema {manifest.schema_revision}, {len(manifest.members)} members, "
        f"{size} bytes (mode 0600: it holds secrets)",
        err=True,
    )


@backup_app.command("restore")
def restore(
    archive: Annotated[pathlib.Path, typer.Argument(help="an archive of `space backup create`")],
    *,
    data_dir: DataDir = DEFAULT_DATA_DIR,
    database: Database = None,
    node_token_file: TokenFile = None,
    keys_dir: KeysDir = None,
    force: Annotated[
        bool, typer.Option("--force", help="replace a target that already holds a control plane")
    ] = False,
) -> None:
    """Restore a backup into a stopped (or new) control plane, then upgrade its schema if it is older."""
    from space.controlplane.backup.state import restore_backup

    filemodes.set_owner_only_umask()
    resolved = data_dir.resolve()
    pid = supervisor_pid(resolved)
    try:
        if pid is not None:
            raise errors.Conflict(
                f"SPACE is running from {resolved} (supervisor pid {pid}): `space down` first",
                reason="control_plane_running",
            )  # fmt: skip
        installation = _installation(data_dir, database, node_token_file, keys_dir)
        manifest = restore_backup(archive.absolute(), installation, replace=force)
    except (errors.SpaceError, OSError) as error:
        raise _fail(error) from None
    typer.echo(
        f"restored the {manifest.engine} backup of {manifest.created_at} (schema {manifest.schema_revision}, "
        f"SPACE {manifest.space_version}) into {resolved}",
        err=True,
    )
