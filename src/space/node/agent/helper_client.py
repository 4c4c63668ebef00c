"""The unprivileged agent's client of the root node helper.

Invariants:
- Each request uses its own short-lived connection from a small pool, so concurrent verbs on different
  sandboxes run in parallel in the helper and a broken connection affects one request only.
- Helper errors come back as the same typed SpaceError classes they were raised as.
- The helper sees runtime ids only, callers sandbox ids only: with `names` set, every call's sandbox-naming
  arguments are translated to runtime ids and its answer's back (space.node.agent.runtime_names), here and
  nowhere else.
- A verb called within a trace carries its traceparent (`"trace"`); the spans the helper answers with join
  this process's ring (ADR 0072).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from space.core import errors, tracing
from space.node.agent.runtime_names import RuntimeNames

ProgressCallback = Callable[[str], None]
MAX_HELPER_SPANS = 64


LAYER = tracing.Layer("space.node")


def _keep_spans(spans: object) -> None:
    """The helper's spans of a traced verb, into this process's ring beside the agent's own."""
    if isinstance(spans, list):
        for value in spans[:MAX_HELPER_SPANS]:
            record = tracing.record_from_wire(value)
            if record is not None:
                tracing.RING.add(record)


class HelperClient:
    def __init__(self, socket_path: str, *, pool_size: int = 8, default_timeout: float = 120.0) -> None:
        """`pool_size` idle connections are kept for reuse; a verb that names no timeout of its own fails
        after `default_timeout` s (NodeAgentSettings.helper_pool_size, helper_call_timeout_s)."""
        self.socket_path = socket_path
        self.default_timeout = default_timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._pool_size = pool_size
        #: Set by the driver that keeps warm pools; None: ids pass unchanged.
        self.names: RuntimeNames | None = None

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        try:
            return await asyncio.open_unix_connection(self.socket_path, limit=1 << 20)
        except OSError as exc:
            raise errors.Unavailable(f"node helper not reachable at {self.socket_path}: {exc}") from exc

    async def call(
        self,
        verb: str,
        args: dict[str, Any] | None = None,
        *,
        progress: ProgressCallback | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        if timeout is None:
            timeout = self.default_timeout
        # The agent's wait ("helper.rpc"), the helper's own span ("helper.<verb>") inside it.
        with LAYER.span(f"helper.rpc {verb}", verb=verb):
            if self.names is None:
                return await self._call(verb, args, progress, timeout)
            result = await self._call(verb, self.names.args_to_runtime(args or {}), progress, timeout)
            translated: dict[str, Any] = self.names.result_to_sandbox(result)
            return translated

    async def _call(
        self, verb: str, args: dict[str, Any] | None, progress: ProgressCallback | None, timeout: float
    ) -> dict[str, Any]:
        reader, writer = await self._connection()
        reusable = False
        try:
            request: dict[str, Any] = {"verb": verb, "args": args or {}}
            if (traceparent := tracing.traceparent()) is not None:
                request["trace"] = traceparent  # the helper's spans join this trace (ADR 0072)
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            async with asyncio.timeout(timeout):
                while True:
                    line = await reader.readline()
                    if not line:
                        raise errors.Unavailable(f"node helper closed the connection during {verb}")
                    answer = json.loads(line)
                    if "progress" in answer:
                        if progress is not None:
                            progress(str(answer["progress"]))
                        continue
                    reusable = True
                    _keep_spans(answer.pop("spans", None))
                    if answer.get("ok"):
                        result = answer.get("result", {})
                        return result if isinstance(result, dict) else {}
                    raise errors.error_from_dict(answer.get("error") or {})
        except TimeoutError as exc:
            raise errors.Timeout(f"node helper verb {verb} took longer than {timeout}s") from exc
        except (ConnectionError, OSError) as exc:
            raise errors.Unavailable(f"node helper connection failed during {verb}: {exc}") from exc
        finally:
            if reusable and len(self._idle) < self._pool_size:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def close(self) -> None:
        for _reader, writer in self._idle:
            writer.close()
        self._idle.clear()
