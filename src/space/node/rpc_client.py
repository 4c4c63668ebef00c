"""NodeClient: the control plane's (and gateway's) async client of one node agent's RPC.

The calls are grouped by concern under space.node.rpc (transport, lifecycle, transfer, processes, files,
relay, metrics, templates, traces); NodeClient is all of them on one authenticated connection.

Invariants:
- Every failure is a space.core error: an error answer is rebuilt with `errors.error_from_dict` (same code,
  message, details; e.g. InvalidState keeps `.state`), a node that cannot be reached is Unavailable, a
  request that runs out of time is Timeout, a stream that breaks off is Unavailable. Nothing else escapes.
- Streams are never buffered whole: file bodies go out from an async iterable and come back as an async
  iterator of chunks; NDJSON answers come back as an async iterator of dicts, and an error line at the end
  of a stream raises the typed error it carries.
- `proxy_stream` is for the gateway: it relays a request body and hands back the response body as an
  iterator of raw chunks, so a public request can be passed through without holding it in memory. Its node
  path is built here from the sandbox id and fixed or validated segments, each quoted as ONE segment.
- Every call scoped to a sandbox carries a capability for that sandbox (space.core.capability, keyed by
  this client's node token, DEFAULT_TTL_S), minted from the `sandbox_id` the caller passes explicitly (the
  id of the record it authorized), never from a path; the node refuses it for any other sandbox.
- The lifecycle calls are as idempotent as the node makes them (see space.node.agent.server): retrying one
  after a timeout or a crash is always safe; `fork` and `create_snapshot` take an idempotency key (or, for
  fork, the children's ids) to make their retries safe too.
"""

from __future__ import annotations

from space.node.rpc.files import FileCalls
from space.node.rpc.lifecycle import LifecycleCalls
from space.node.rpc.metrics import MetricsCalls
from space.node.rpc.processes import ProcessCalls
from space.node.rpc.relay import RelayCalls
from space.node.rpc.templates import TemplateCalls
from space.node.rpc.traces import TraceCalls
from space.node.rpc.transfer import TransferCalls


class NodeClient(
    LifecycleCalls,
    TransferCalls,
    ProcessCalls,
    FileCalls,
    RelayCalls,
    MetricsCalls,
    TemplateCalls,
    TraceCalls,
):
    """Every call of one node agent's RPC; `async with NodeClient(url, token) as node: ...`."""
