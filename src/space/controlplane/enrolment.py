"""`python -m space.controlplane.enrolment`: make a token that enrols new nodes (ADR 0021).

    python -m space.controlplane.enrolment --data-dir D [--database-url URL] [--uses 1] [--ttl 3600]

Prints the token once on stdout; the database keeps only its SHA-256 and a use count. Give it to ONE new
node as its `--bootstrap-token-file` (mode 0600): the node enrols with it, keeps its own identity and RPC
token in its data directory, and never needs the token again, so the cluster's `node.token` need not be on
that machine at all. An operator's tool: it needs the database, there is no API route for it.
"""

from __future__ import annotations

import argparse
import pathlib

from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.migrate import migrate
from space.controlplane.store.store import Store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="make a token that enrols new SPACE nodes")
    parser.add_argument("--data-dir", type=pathlib.Path, help="the control plane's data directory (SQLite)")
    parser.add_argument("--database-url", default=None, help="default: SQLite in the data directory")
    parser.add_argument("--uses", type=int, default=1, help="how many nodes it may enrol (default 1)")
    parser.add_argument("--ttl", type=float, default=3600.0, help="seconds it stays valid (0: no expiry)")
    args = parser.parse_args(argv)
    if args.database_url is None and args.data_dir is None:
        parser.error("give --data-dir or --database-url")
    url = args.database_url or sqlite_url(args.data_dir)
    migrate(url)
    store = Store(url)
    try:
        _token_id, secret = store.create_enrolment_token(uses=args.uses, ttl_s=args.ttl or None)
    finally:
        store.close()
    print(secret)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
