"""The node agent's RPC service: lifecycle verbs for the reconciler and the data plane for the gateway.

    python -m space.node.agent.server --data-dir D --listen 127.0.0.1:PORT [--rpc-token-file F] \
        [--control-plane URL [--bootstrap-token-file F] [--advertise-url URL]] [--driver runsc|fake] \
        [--no-prepare]

This module is the agent's entry point only (every launcher runs it by this name). Where the parts live:

    launch           argument parsing, serving, shutdown (`main`, `serve`)
    settings         every tunable and environment variable (NodeAgentSettings)
    app              the FastAPI app (`create_app`): routers, auth middleware, error model
    rpc_auth         the node token (BearerAuth) and sandbox capabilities (require_capability)
    routes/          one router per resource: node, sandboxes, snapshots, processes, files, pty
    service          the verbs the routes run (NodeService), over service_core (state, observation)
    streams          NDJSON and byte streams between HTTP and a sandbox's daemon
    idempotency      Idempotency-Key memory of snapshot and fork
    registration     enrolment, registration and the heartbeat loop
    agent            the sandbox manager (NodeAgent) the service drives

Invariants: `python -m space.node.agent.server` behaves as `space.node.agent.launch.main`; importing this
module starts nothing.
"""

from __future__ import annotations

from space.node.agent.launch import main

if __name__ == "__main__":
    main()
