"""`POST /v1/sandboxes/{id}/code`: run code in the sandbox's Jupyter kernel (ADR 0058), answered as NDJSON.

Invariants:
- Needs a member key (code changes the sandbox) and a running sandbox (a paused one is resumed, like every
  data-plane call); the sandbox's template must carry the kernel bridge (the `code-interpreter` template),
  else 409 naming the template.
- The answer is the bridge's events (`space.controlplane.code_runs`), one JSON object per line, in E2B's
  shapes but one: stdout/stderr {"text"}, result {<format>: ..., "is_main_result"}, `exception` {"name",
  "value", "traceback"} (E2B's `error`: on SPACE's streams `error` is the stream's own failure),
  number_of_executions, and last end_of_execution; `timeout` comes before it when the request's timeout
  interrupted the kernel. Errors found before the first event are the API's error body.
- The execution is bounded (code_runs: code size, output, deadline) and interrupted when the client goes
  away.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from space.controlplane.api.deps import Auth, Svc, node_of, running_sandbox
from space.controlplane.code_runs import (
    CONTEXT_ID,
    MAX_CODE_BYTES,
    MAX_ENV_VARS,
    MAX_EXECUTION_S,
    KernelBridge,
)
from space.core.ids import parse_sandbox_id

router = APIRouter()

NDJSON = "application/x-ndjson"
CODE_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {"description": "NDJSON events of the execution, one per line", "content": {NDJSON: {}}}
}


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(max_length=MAX_CODE_BYTES)
    language: str = Field(default="python", pattern="^python$")
    context: str | None = Field(default=None, pattern=CONTEXT_ID.pattern, max_length=64)
    env: dict[str, str] | None = Field(default=None, max_length=MAX_ENV_VARS)
    timeout: float | None = Field(default=None, gt=0, le=MAX_EXECUTION_S)


@router.post("/sandboxes/{sandbox_id}/code", response_model=None, responses=CODE_ANSWER)
async def run_code(sandbox_id: str, body: RunCodeRequest, who: Auth, services: Svc) -> StreamingResponse:
    """Run code in the sandbox's kernel (`context`: a context id, default the default context)."""
    who.require("member")
    parse_sandbox_id(sandbox_id, field="sandbox_id")
    sb = await running_sandbox(services, who, sandbox_id)
    await asyncio.to_thread(services.store.record_activity, sb.id)  # a kernel at work is not idle
    bridge = KernelBridge(services.nodes.client(node_of(sb)), sb.id, sb.template)
    events = await bridge.execute(body.code, context_id=body.context, env_vars=body.env, timeout=body.timeout)
    return StreamingResponse(_ndjson(events), media_type=NDJSON)


async def _ndjson(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            # On SPACE's streams `error` is an in-band failure of the stream itself (the SDK raises it): the
            # code's own exception is `exception`.
            shown = {**event, "type": "exception"} if event.get("type") == "error" else event
            yield json.dumps(shown, separators=(",", ":")).encode() + b"\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]
