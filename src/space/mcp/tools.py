"""The MCP tools of SPACE, once for both transports: `build_server(clients)` is an MCPServer whose tools act
through SPACE's async SDK on the client `clients(ctx)` hands them for each call.

Tools (argument names are those agents know from Daytona's MCP server and E2B's SDK: `id` for the
sandbox, `command`, `cwd`, `timeout`, `path`, `content` + `encoding`, `code`): create_sandbox,
list_sandboxes, delete_sandbox, execute_command, run_code, read_file, write_file, list_files,
pause_sandbox, resume_sandbox, snapshot, list_snapshots, rollback, fork, set_egress_policy,
login_placeholders, screenshot (a PNG of a `browser` sandbox's page), browser_login (its login form filled
with a login credential's placeholders, ADR 0066).

Invariants:
- Every argument is bounded in the schema (lengths, counts, ranges), so an oversized argument is refused
  before the tool runs; results are bounded by space.mcp.render.
- read_file never reads a file above READ_LIMIT_BYTES whole: it answers with the file's size and how to
  read it in parts.
- A SpaceError of the SDK becomes a ToolError (space.mcp.render.error_text); anything else the SDK's own
  handler reports as a failed call without its text.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import BaseModel, Field

from space.core.cdp_screenshot import MAX_URL
from space.core.errors import Conflict, SpaceError
from space.core.sandbox_options import MAX_METADATA_KEY, MAX_METADATA_KEYS, MAX_METADATA_VALUE
from space.mcp import render
from space.mcp.code import execution_text, run_code_argv
from space.sdk import AsyncSandbox, AsyncSpace

__all__ = ["MAX_ARGUMENT_CHARS", "READ_LIMIT_BYTES", "WRITE_LIMIT_BYTES", "ClientSource", "build_server"]

ToolContext = Context[Any, Any]
#: Hands a tool the SDK client it acts through (and closes it after, if it made one for the call).
ClientSource = Callable[[ToolContext], AbstractAsyncContextManager[AsyncSpace]]

READ_LIMIT_BYTES = 256 * 1024
WRITE_LIMIT_BYTES = 512 * 1024
#: Commands and code (the API's JSON bodies are 1 MiB at most).
MAX_ARGUMENT_CHARS = 256 * 1024
MAX_TIMEOUT_S = 3600

SandboxId = Annotated[str, Field(min_length=1, max_length=64, description="The sandbox's id (sb-...).")]
Path = Annotated[
    str,
    Field(min_length=1, max_length=4096, description="A path in the sandbox, absolute or relative to /work."),
]
Timeout = Annotated[
    float, Field(gt=0, le=MAX_TIMEOUT_S, description="Seconds before the command is killed (default 60).")
]
Hosts = Annotated[list[Annotated[str, Field(min_length=1, max_length=253)]], Field(max_length=256)]
Env = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=256)], Annotated[str, Field(max_length=32_768)]],
    Field(max_length=256, description="Environment variables."),
]
Encoding = Literal["text", "base64"]
# The server checks metadata fully (space.core.sandbox_options); the schema only bounds its size.
Labels = Annotated[
    dict[
        Annotated[str, Field(min_length=1, max_length=MAX_METADATA_KEY)],
        Annotated[str, Field(max_length=MAX_METADATA_VALUE)],
    ],
    Field(max_length=MAX_METADATA_KEYS, description="Labels (metadata): string keys and values."),
]
# Hints an agent may use to decide what to confirm with its user (they promise nothing).
READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
CHANGES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
DESTROYS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)

INSTRUCTIONS = (
    "SPACE runs long-lived sandboxes (each its own kernel, files and network). Create one with create_sandbox"
    " and pass its id to the other tools; run shell commands with execute_command and Python with run_code"
    " (without an id, run_code uses a new sandbox and deletes it after). Snapshots and rollback undo"
    " changes; fork copies a sandbox with its running processes."
)


class Limits(BaseModel):
    """Resources of a new sandbox (left out: the server's defaults)."""

    cpus: float | None = Field(default=None, ge=0.1, le=64)
    memory_mb: int | None = Field(default=None, ge=64, le=65536)
    disk_mb: int | None = Field(default=None, ge=64, le=1048576)
    pids: int | None = Field(default=None, ge=16, le=65536)


class SpaceTools:
    """The tools, bound to where their SDK client comes from."""

    def __init__(self, clients: ClientSource) -> None:
        self.clients = clients

    @asynccontextmanager
    async def acting(self, ctx: ToolContext) -> AsyncIterator[AsyncSpace]:
        """The SDK client of this call; a SpaceError inside becomes the tool's error."""
        try:
            async with self.clients(ctx) as space:
                yield space
        except SpaceError as error:
            raise ToolError(render.error_text(error)) from error

    # -- sandboxes ---------------------------------------------------------------------------------------
    async def create_sandbox(
        self,
        ctx: ToolContext,
        *,
        template: Annotated[str, Field(min_length=1, max_length=128)] = "python",
        env: Env | None = None,
        limits: Limits | None = None,
        metadata: Labels | None = None,
        ttl_s: Annotated[int | None, Field(gt=0, description="Its deadline, in seconds from now.")] = None,
        on_timeout: Annotated[
            Literal["delete", "pause"] | None,
            Field(description="At the deadline: delete it (default), or pause it until it is used again."),
        ] = None,
        idle_timeout_s: Annotated[int | None, Field(gt=0, description="Pause it when idle this long.")] = (
            None
        ),
        from_snapshot: Annotated[
            str | None,
            Field(
                min_length=1,
                max_length=128,
                description="Start from this full snapshot (its id or name): its files, memory and "
                "processes, with its source's template and limits.",
            ),
        ] = None,
        isolation: Annotated[
            Literal["gvisor", "microvm"] | None,
            Field(description="gvisor (default) or microvm: a QEMU microVM with its own Linux kernel."),
        ] = None,
    ) -> str:
        """Create a sandbox and wait until it runs; answers its id."""
        wanted = limits.model_dump(exclude_none=True) if limits is not None else None
        async with self.acting(ctx) as space:
            sb = await space.sandboxes.create(
                template, env=env, limits=wanted or None, ttl_s=ttl_s, idle_timeout_s=idle_timeout_s,
                metadata=metadata, on_timeout=on_timeout, from_snapshot=from_snapshot, isolation=isolation,
            )  # fmt: skip
        return f"Created sandbox {sb.id}: {render.sandbox_line(sb.data)}"

    async def list_sandboxes(
        self,
        ctx: ToolContext,
        *,
        state: Annotated[str | None, Field(max_length=32, description="Only those in this state.")] = None,
        template: Annotated[str | None, Field(max_length=128)] = None,
        metadata: Annotated[Labels | None, Field(description="Only those with all these labels.")] = None,
    ) -> str:
        """The sandboxes this key can see, newest first: id, state, template, labels."""
        async with self.acting(ctx) as space:
            page = await space.sandboxes.list_page(
                state=state, template=template, metadata=metadata, limit=render.LIST_LINES
            )
        text = render.sandbox_lines(sb.data for sb in page.sandboxes)
        if page.next_page_token is not None:
            text += f"\n(only the newest {render.LIST_LINES}: filter by state, template or metadata)"
        return text

    async def delete_sandbox(self, ctx: ToolContext, *, id: SandboxId) -> str:
        """Delete a sandbox with its files and snapshots (this cannot be undone)."""
        async with self.acting(ctx) as space:
            sb = await space.sandboxes.ref(id).delete()
        return f"Deleted sandbox {id} (state {sb.state})."

    async def pause_sandbox(self, ctx: ToolContext, *, id: SandboxId) -> str:
        """Pause a sandbox: its processes stop in place and resume where they were."""
        async with self.acting(ctx) as space:
            sb = await space.sandboxes.ref(id).pause()
        return render.sandbox_line(sb.data)

    async def resume_sandbox(self, ctx: ToolContext, *, id: SandboxId) -> str:
        """Resume a paused sandbox."""
        async with self.acting(ctx) as space:
            sb = await space.sandboxes.ref(id).resume()
        return render.sandbox_line(sb.data)

    async def fork(
        self, ctx: ToolContext, *, id: SandboxId, count: Annotated[int, Field(ge=1, le=10)] = 1
    ) -> str:
        """Copy a sandbox (files, memory and running processes) into `count` new sandboxes."""
        async with self.acting(ctx) as space:
            children = await space.sandboxes.ref(id).fork(count)
        return f"Forked {id} into {len(children)} sandbox(es):\n" + "\n".join(
            render.sandbox_line(child.data) for child in children
        )

    async def snapshot(
        self,
        ctx: ToolContext,
        *,
        id: SandboxId,
        kind: Annotated[
            Literal["disk", "full"],
            Field(description="disk: the files; full: files, memory and processes (a checkpoint)."),
        ] = "disk",
        name: Annotated[
            str | None,
            Field(
                min_length=1,
                max_length=128,
                description="A name for a full snapshot, to start new sandboxes from (create_sandbox).",
            ),
        ] = None,
    ) -> str:
        """Take a snapshot of a sandbox to roll back to later (a named full one: to start sandboxes from)."""
        async with self.acting(ctx) as space:
            snap = await space.sandboxes.ref(id).snapshots.create(full=kind == "full", name=name)
        if name is not None:
            return (
                f"Snapshot {snap.id} ({snap.kind}, named {name}) of {id}; roll back to it with rollback, or"
                f" start sandboxes from it with create_sandbox(from_snapshot={name!r})."
            )
        return f"Snapshot {snap.id} ({snap.kind}) of {id}; roll back to it with rollback."

    async def list_snapshots(self, ctx: ToolContext, *, id: SandboxId) -> str:
        """The snapshots of a sandbox, oldest first."""
        async with self.acting(ctx) as space:
            snaps = await space.sandboxes.ref(id).snapshots.list()
        if not snaps:
            return f"{id} has no snapshots."
        return "\n".join([f"{len(snaps)} snapshot(s) of {id}:", *(render.snapshot_line(s) for s in snaps)])

    async def rollback(
        self,
        ctx: ToolContext,
        *,
        id: SandboxId,
        snapshot_id: Annotated[str, Field(min_length=1, max_length=64)],
    ) -> str:
        """Put a sandbox back to one of its snapshots (what changed since is lost)."""
        async with self.acting(ctx) as space:
            sb = await space.sandboxes.ref(id).rollback(snapshot_id)
        return f"Rolled {id} back to {snapshot_id}: {render.sandbox_line(sb.data)}"

    async def set_egress_policy(
        self,
        ctx: ToolContext,
        *,
        id: SandboxId,
        allow: Annotated[Hosts | None, Field(description="Hosts it may reach (*.example.com).")] = None,
        deny: Annotated[Hosts | None, Field(description="Hosts it may not reach.")] = None,
    ) -> str:
        """Set which hosts a sandbox may reach (a list left out keeps its value; [] empties it)."""
        async with self.acting(ctx) as space:
            policy = await space.sandboxes.ref(id).set_egress(allow=allow, deny=deny)
        applied = "applied now" if policy.get("applied", True) else "applied when the sandbox next runs"
        return (
            f"Egress of {id} ({applied}): allow {policy.get('allow') or 'nothing'},"
            f" deny {policy.get('deny') or 'nothing'}."
        )

    async def login_placeholders(
        self,
        ctx: ToolContext,
        *,
        id: SandboxId,
        credential: Annotated[
            str, Field(min_length=1, max_length=64, description="A login credential bound to the sandbox.")
        ],
    ) -> str:
        """What to type into a site's login form for a `login` credential bound to the sandbox: the origin
        and, per form field, a placeholder. SPACE's egress gateway replaces the placeholders with the real
        username and password only when that form is submitted to that origin; the sandbox never sees them."""
        async with self.acting(ctx) as space:
            answer = await space.sandboxes.ref(id).login_placeholders(credential)
        fields = ", ".join(f"{name}={value}" for name, value in answer.get("fields", {}).items())
        action = answer.get("form_action") or "its login form"
        return f"Log in at {answer.get('origin')} ({action}) with {fields}."

    async def screenshot(
        self,
        ctx: ToolContext,
        *,
        id: SandboxId,
        url: Annotated[
            str | None,
            Field(
                min_length=1,
                max_length=MAX_URL,
                description="A page to load first (in a page of its own); none: the browser's first page.",
            ),
        ] = None,
    ) -> Image:
        """A PNG screenshot from a `browser` sandbox's Chromium (ADR 0064)."""
        async with self.acting(ctx) as space:
            png = await space.sandboxes.ref(id).browser.screenshot(url)
        return Image(data=png, format="png")

    async def browser_login(
        self,
        ctx: ToolContext,
        *,
        id: SandboxId,
        credential: Annotated[
            str, Field(min_length=1, max_length=64, description="A login credential bound to the sandbox.")
        ],
        target_id: Annotated[
            str | None,
            Field(
                min_length=1,
                max_length=128,
                description="The page (a DevTools target id); none: the first on the credential's origin.",
            ),
        ] = None,
    ) -> str:
        """Log in to a site in a `browser` sandbox's Chromium with a `login` credential (ADR 0066): SPACE
        fills the open login page's form with placeholders and submits it; the egress gateway puts the real
        username and password into that submission, so neither you nor the sandbox ever sees them."""
        async with self.acting(ctx) as space:
            answer = await space.sandboxes.ref(id).browser.login(credential, target_id=target_id)
        moved = "and the page loaded" if answer.get("navigated") else "but no new page loaded yet"
        return (
            f"Submitted the login form of {answer.get('origin')} with {credential!r} {moved}: now at"
            f" {answer.get('url')} (title {answer.get('title')!r}, target {answer.get('target_id')})."
        )

    # -- commands and code -------------------------------------------------------------------------------
    async def execute_command(
        self,
        ctx: ToolContext,
        *,
        id: SandboxId,
        command: Annotated[str, Field(min_length=1, max_length=MAX_ARGUMENT_CHARS)],
        cwd: Path | None = None,
        timeout: Timeout = 60,
        env: Env | None = None,
    ) -> str:
        """Run a shell command in a sandbox to its end; answers its exit code, stdout and stderr."""
        async with self.acting(ctx) as space:
            result = await space.sandboxes.ref(id).exec(command, cwd=cwd, timeout=timeout, env=env)
        return render.exec_text(result)

    async def run_code(
        self,
        ctx: ToolContext,
        *,
        code: Annotated[str, Field(min_length=1, max_length=MAX_ARGUMENT_CHARS)],
        id: Annotated[
            str | None,
            Field(max_length=64, description="The sandbox; left out: a new one, deleted after."),
        ] = None,
        timeout: Timeout = 60,
    ) -> str:
        """Run Python code like a notebook cell: what it prints, and the value of its last expression. In a
        code-interpreter sandbox it runs in the sandbox's Jupyter kernel (variables stay between calls)."""
        async with self.acting(ctx) as space:
            if id is not None:
                return await _run(space.sandboxes.ref(id), code, timeout)
            sb = await space.sandboxes.create()
            try:
                return await _run(sb, code, timeout)
            finally:
                await sb.delete()

    # -- files -------------------------------------------------------------------------------------------
    async def read_file(
        self, ctx: ToolContext, *, id: SandboxId, path: Path, encoding: Encoding = "text"
    ) -> str:
        """A file's content: as text, or base64 for binary files (at most 256 KiB)."""
        async with self.acting(ctx) as space:
            files = space.sandboxes.ref(id).files
            info = await files.stat(path, follow=True)  # a symlink reads as what it leads to
            if info.get("type") not in {None, "file"}:
                raise ToolError(f"invalid_argument: {path} is a {info.get('type')}, not a file")
            size = int(info.get("size") or 0)
            if size > READ_LIMIT_BYTES:
                raise ToolError(
                    f"too_large: {path} holds {render.size_text(size)}; read_file returns at most"
                    f" {render.size_text(READ_LIMIT_BYTES)}: read parts with execute_command (head -c, tail,"
                    " sed -n, grep)"
                )
            data = await files.read(path)
        if encoding == "base64":
            return base64.b64encode(data[:READ_LIMIT_BYTES]).decode("ascii")
        try:
            return data[:READ_LIMIT_BYTES].decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(
                f"invalid_argument: {path} is not UTF-8 text ({render.size_text(len(data))}):"
                " read it with encoding=base64"
            ) from None

    async def write_file(
        self,
        ctx: ToolContext,
        *,
        id: SandboxId,
        path: Path,
        content: Annotated[str, Field(max_length=WRITE_LIMIT_BYTES * 4 // 3 + 4)],
        encoding: Encoding = "text",
    ) -> str:
        """Write a file (replaced if it exists; its directories are made): text, or base64 for binary."""
        data = _decoded(content, encoding)
        async with self.acting(ctx) as space:
            written = await space.sandboxes.ref(id).files.write(path, data)
        return f"Wrote {written} bytes to {path} in {id}."

    async def list_files(self, ctx: ToolContext, *, id: SandboxId, path: Path = ".") -> str:
        """The entries of a directory (default: the work directory, /work)."""
        async with self.acting(ctx) as space:
            entries = await space.sandboxes.ref(id).files.list(path, limit=render.LIST_LINES)
        return render.file_lines(path, entries, truncated=entries.truncated)


async def _run(sb: AsyncSandbox, code: str, timeout: float) -> str:
    """In the sandbox's kernel when its template has one (ADR 0058), else as a one-off cell."""
    try:
        execution = await sb.run_code(code, timeout=timeout)
    except Conflict:  # the template has no kernel (the API names the code-interpreter template)
        result = await sb.exec(run_code_argv(), stdin=code.encode("utf-8"), timeout=timeout)
        return render.exec_text(result)
    return execution_text(execution)


def _decoded(content: str, encoding: Encoding) -> bytes:
    if encoding == "base64":
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise ToolError("invalid_argument: content is not valid base64") from None
    else:
        data = content.encode("utf-8")
    if len(data) > WRITE_LIMIT_BYTES:
        raise ToolError(
            f"too_large: {render.size_text(len(data))} to write; write_file takes at most"
            f" {render.size_text(WRITE_LIMIT_BYTES)} a call"
        )
    return data


#: (name, annotations) of every tool, in the order tools/list shows them.
TOOLS: tuple[tuple[str, ToolAnnotations], ...] = (
    ("create_sandbox", CHANGES),
    ("list_sandboxes", READ_ONLY),
    ("delete_sandbox", DESTROYS),
    ("execute_command", CHANGES),
    ("run_code", CHANGES),
    ("read_file", READ_ONLY),
    ("write_file", CHANGES),
    ("list_files", READ_ONLY),
    ("pause_sandbox", CHANGES),
    ("resume_sandbox", CHANGES),
    ("snapshot", CHANGES),
    ("list_snapshots", READ_ONLY),
    ("rollback", DESTROYS),
    ("fork", CHANGES),
    ("set_egress_policy", CHANGES),
    ("login_placeholders", CHANGES),
    ("screenshot", CHANGES),
    ("browser_login", CHANGES),
)


def build_server(clients: ClientSource, *, name: str = "space") -> MCPServer[Any]:
    """An MCPServer with SPACE's tools, acting through the clients `clients` hands out."""
    # MCPServer() calls logging.basicConfig, which configures the process's logging if nothing has yet:
    # the process decides that (the control plane's server, `space mcp`), not a library it builds. A
    # handler on the root logger for the time of the call makes basicConfig a no-op.
    root = logging.getLogger()
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        server: MCPServer[Any] = MCPServer(name, instructions=INSTRUCTIONS)
    finally:
        root.removeHandler(placeholder)
    tools = SpaceTools(clients)
    for tool_name, hints in TOOLS:
        method = getattr(tools, tool_name)
        server.add_tool(method, name=tool_name, description=inspect.getdoc(method), annotations=hints)
    return server
