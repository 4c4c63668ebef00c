"""E2B's in-sandbox API (envd) over SPACE's node calls: `envd_app(services)` (docs/adr/0051).

Modules: app (the ASGI app and its routing), caller (who calls, which sandbox), process_service and
process_events (`process.Process`), filesystem_service, entries and watchers (`filesystem.Filesystem`),
files_rest (`/files`, `/health`), keepalive (stream keep-alives), rpc_errors (SPACE errors as Connect
errors and envd statuses).

Invariants:
- The daemon never talks to clients: every call becomes SPACE's own node calls for the caller's running
  sandbox (`services.nodes.client(node)` with that sandbox's capability), the same path as SPACE's data
  plane; there is no second way into a sandbox.
- The wire is the `e2b` package's own: its generated Connect service classes and messages, served by
  connectrpc (pinned together with the `e2b` version, pyproject.toml).
"""

from space.controlplane.e2b.envd.app import envd_app

__all__ = ["envd_app"]
