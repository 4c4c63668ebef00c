"""The E2B-compatible front (docs/e2b.md, docs/adr/0052-e2b-control-front.md): E2B's control API
(`control.create_control_app`) and its in-sandbox API (`envd`), each an ASGI app on its own port, both over
the control plane's own Services (same process, same store).

Invariants:
- The front is a translation layer only: every answer comes from SPACE's own store, reconciler and node
  calls (the same lifecycle table, the same project isolation); there is no second path into a sandbox.
- The caller is a SPACE API key (`X-API-Key`, or `Authorization: Bearer`), of any shape SPACE issues;
  another project's sandbox answers exactly like a missing one.
"""
