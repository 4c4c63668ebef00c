"""The node RPC's routes, one module per resource, each an APIRouter made by
space.node.agent.rpc_auth.resource_router (so every route is behind the capability check):

    node        GET /info, GET /sandboxes (node-level: the node token suffices)
    sandboxes   a sandbox's lifecycle: get, put, pause/resume/stop/start, delete, egress policy
    snapshots   snapshots, suspend, upload, restore, recover, rollback, fork
    processes   exec, background processes, their output, stdin, signals, resize
    files       read, write, list, stat, mkdir, remove, rename, watch
    pty         the terminal WebSocket

space.node.agent.app includes them in this order.
"""
