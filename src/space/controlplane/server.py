"""`python -m space.controlplane.server`: migrate the database, then serve the API (and reconcile).

Several of these processes may share one PostgreSQL database: migrations take an advisory lock, and the
reconcilers divide the work through leases.
"""

from __future__ import annotations

import argparse
import logging
import pathlib

import uvicorn

from space.controlplane.api.app import create_app
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.migrate import migrate
from space.controlplane.store.store import Store


def build_store(database_url: str) -> Store:
    migrate(database_url)
    return Store(database_url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SPACE control plane")
    parser.add_argument("--data-dir", type=pathlib.Path, required=True)
    parser.add_argument("--database-url", default=None, help="default: SQLite in the data directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--node-token-file", type=pathlib.Path, required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s controlplane %(levelname)s %(message)s"
    )
    url = args.database_url or sqlite_url(args.data_dir)
    store = build_store(url)
    app = create_app(store, node_token=args.node_token_file.read_text().strip())
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
