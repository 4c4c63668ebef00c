"""SPACE's kernel bridge: the small program the code-interpreter template carries (installed by a file step
of its build spec, `space.node.code_interpreter.spec`), which the control plane runs through the node's
exec calls to drive the sandbox's Jupyter kernels. It never listens on any socket of its own: the
control plane reaches it only through the sandbox daemon's processes.

Usage (one request per run, its JSON on stdin, answers as JSON lines on stdout):
    bridge.py start    {"id", "language"?, "cwd"?}   start a context's kernel (idempotent), then
                                                     one line {"ok": context} or {"error": {...}}
    bridge.py list     {}                            {"ok": [context, ...]} (contexts whose kernel lives)
    bridge.py remove   {"id"}                        stop the kernel, forget the context
    bridge.py restart  {"id"}                        a new kernel for the same context
    bridge.py execute  {"code", "context_id"?, "env_vars"?, "timeout"?}
        first line {"ok": {"context_id"}} or {"error": {...}}; then one line per output, in E2B's shapes:
        {"type": "stdout"|"stderr", "text", "timestamp"}, {"type": "result", <format>: ..., "is_main_result"},
        {"type": "error", "name", "value", "traceback"}, {"type": "number_of_executions", "execution_count"},
        and last {"type": "end_of_execution"} (after a timeout also {"type": "timeout"} before it).

Invariants:
- Standard library and jupyter_client only (ipykernel runs the kernels); nothing of SPACE is imported.
- A context is a directory STATE/<id> holding meta.json (id, language, cwd), kernel.json (the kernel's
  connection file, written by ipykernel) and kernel.pid; ids fullmatch CONTEXT_ID (no path tricks).
- The default context (id `default`) is started when first used if it is not running yet; any other
  context must have been started (error code `not_found` otherwise).
- A kernel runs in a session of its own, so it outlives the bridge run that started it (the sandbox's
  init reaps it when it ends).
- SIGTERM or the request's timeout interrupts the kernel's execution (SIGINT to the kernel: ipykernel's
  interrupt), then the bridge waits at most DRAIN_S for the kernel to go idle and ends: a client that goes
  away never leaves a cell running.
- Env vars of an execution are set in the kernel before the code and restored after it.
- An execution shows at most `max_output_bytes` of events: beyond, the kernel is interrupted at once (a
  flood stops at its source, not after it has filled the bridge's queues) and one `OutputLimitExceeded`
  error is shown.
- Kernels run `kernel_launcher.py` (installed beside the bridge): ipykernel with its output bounded (a
  flood is many small messages that the budget above acts on; no output is kept after its execution).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

STATE = "/var/lib/space-code"
CONTEXT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
DEFAULT_CONTEXT = "default"
LANGUAGES = ("python",)
KERNEL_START_S = 120.0
DRAIN_S = 5.0
#: The output an execution may show (the control plane asks for less): past it the cell is interrupted.
MAX_OUTPUT_BYTES = 64 << 20
POLL_S = 0.25
#: What runs a context's kernel: ipykernel, its output bounded (installed beside this file).
KERNEL_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_launcher.py")
#: Jupyter MIME types -> E2B's result fields; any other type goes to `extra`.
FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def env_set_code(env: dict[str, str]) -> str:
    """Kernel code that sets `env` and remembers what it replaced (for env_restore_code)."""
    return (
        "import os as _space_os\n"
        f"_space_saved_env = {{_k: _space_os.environ.get(_k) for _k in {sorted(env)!r}}}\n"
        f"_space_os.environ.update({dict(env)!r})\n"
    )


ENV_RESTORE = (
    "for _k, _v in _space_saved_env.items():\n"
    "    if _v is None:\n"
    "        _space_os.environ.pop(_k, None)\n"
    "    else:\n"
    "        _space_os.environ[_k] = _v\n"
    "del _space_saved_env\n"
)


class BridgeError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def emit(item: Any) -> None:
    sys.stdout.write(json.dumps(item, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def context_dir(context_id: str) -> str:
    if not isinstance(context_id, str) or CONTEXT_ID.fullmatch(context_id) is None:
        raise BridgeError("invalid_argument", "invalid context id")
    return os.path.join(STATE, context_id)


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def kernel_pid(context_id: str) -> int | None:
    """The pid of the context's kernel if it is alive, else None."""
    try:
        with open(os.path.join(context_dir(context_id), "kernel.pid"), encoding="ascii") as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", encoding="ascii") as f:
        if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
            return None
    return pid


def _meta(context_id: str) -> dict[str, Any]:
    try:
        found = _read_json(os.path.join(context_dir(context_id), "meta.json"))
    except (OSError, ValueError):
        raise BridgeError("not_found", f"context {context_id} not found") from None
    return dict(found)


def _default_cwd() -> str:
    home = "/home/user"
    return home if os.path.isdir(home) else os.environ.get("HOME", "/")


def start(request: dict[str, Any]) -> dict[str, Any]:
    context_id = str(request.get("id") or DEFAULT_CONTEXT)
    where = context_dir(context_id)
    language = request.get("language") or "python"
    if language not in LANGUAGES:
        raise BridgeError("invalid_argument", f"language {language!r} is not supported (python only)")
    cwd = request.get("cwd") or _default_cwd()
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\x00" in cwd:
        raise BridgeError("invalid_argument", "cwd must be an absolute path")
    if kernel_pid(context_id) is not None:
        return _meta(context_id)
    meta = {"id": context_id, "language": language, "cwd": cwd}
    os.makedirs(where, mode=0o700, exist_ok=True)
    with open(os.path.join(where, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    _launch(where, cwd)
    return meta


def _launch(where: str, cwd: str) -> None:
    connection = os.path.join(where, "kernel.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(connection)
    if not os.path.isdir(cwd):
        raise BridgeError("invalid_argument", f"cwd {cwd} is not a directory")
    env = dict(os.environ, MPLBACKEND="module://matplotlib_inline.backend_inline", PYTHONUNBUFFERED="1")
    with open(os.path.join(where, "kernel.log"), "ab") as log:
        child = subprocess.Popen(
            [sys.executable, KERNEL_LAUNCHER, "-f", connection],
            cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    with open(os.path.join(where, "kernel.pid"), "w", encoding="ascii") as f:
        f.write(str(child.pid))
    client = _client(where, deadline=time.monotonic() + KERNEL_START_S, child=child)
    client.stop_channels()


def _client(where: str, *, deadline: float, child: subprocess.Popen[bytes] | None = None) -> Any:
    """A started BlockingKernelClient of the kernel in `where`, once it answers kernel_info."""
    connection = os.path.join(where, "kernel.json")
    while not os.path.exists(connection):
        if child is not None and child.poll() is not None:
            raise BridgeError("internal", f"the kernel exited with {child.returncode} before it started")
        if time.monotonic() > deadline:
            raise BridgeError("deadline_exceeded", "the kernel did not start in time")
        time.sleep(0.05)
    blocking = importlib.import_module("jupyter_client.blocking")
    client = blocking.BlockingKernelClient(connection_file=connection)
    for _ in range(100):
        try:
            client.load_connection_file()
            break
        except (ValueError, OSError):  # the file is being written
            time.sleep(0.05)
    client.start_channels()
    try:
        client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
    except RuntimeError as exc:
        client.stop_channels()
        raise BridgeError("deadline_exceeded", f"the kernel did not answer: {exc}") from exc
    return client


def stop_kernel(context_id: str) -> None:
    pid = kernel_pid(context_id)
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if kernel_pid(context_id) is None:
            return
        time.sleep(0.05)


def list_contexts(_request: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    names = sorted(os.listdir(STATE)) if os.path.isdir(STATE) else []
    for name in names:
        if CONTEXT_ID.fullmatch(name) and kernel_pid(name) is not None:
            with contextlib.suppress(BridgeError):
                found.append(_meta(name))
    return found


def remove(request: dict[str, Any]) -> dict[str, Any]:
    context_id = str(request.get("id", ""))
    where = context_dir(context_id)
    meta = _meta(context_id)
    stop_kernel(context_id)
    shutil.rmtree(where, ignore_errors=True)
    return meta


def restart(request: dict[str, Any]) -> dict[str, Any]:
    context_id = str(request.get("id", ""))
    meta = _meta(context_id)
    stop_kernel(context_id)
    _launch(context_dir(context_id), meta["cwd"])
    return meta


#: Set by SIGTERM (the control plane's caller went away); the execution loop polls it.
TERMINATED: list[bool] = []


def _on_term(_signum: int, _frame: Any) -> None:
    TERMINATED.append(True)


def result_of(content: dict[str, Any], *, main: bool) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in (content.get("data") or {}).items():
        field = FORMATS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            item[field] = value
    if extra:
        item["extra"] = extra
    return item


def translate(msg: dict[str, Any]) -> dict[str, Any] | None:
    """E2B's event for one iopub message of our execution (None for what E2B does not show)."""
    kind = msg["msg_type"]
    content = msg["content"]
    if kind == "stream":
        name = "stderr" if content.get("name") == "stderr" else "stdout"
        return {"type": name, "text": content.get("text", ""), "timestamp": time.time_ns()}
    if kind in ("execute_result", "display_data"):
        return result_of(content, main=kind == "execute_result")
    if kind == "error":
        trace = "\n".join(content.get("traceback") or [])
        return {"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
                "traceback": trace}  # fmt: skip
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": content.get("execution_count")}
    return None


def _silent(client: Any, code: str) -> None:
    """Run `code` without output or history, and wait for its reply (earlier replies are skipped)."""
    msg_id = client.execute(code, silent=True, store_history=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        reply = client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            return


class Execution:
    """One execute request and the iopub messages of its parent id, until the kernel goes idle."""

    def __init__(self, client: Any, context_id: str, timeout: float | None, max_output: int) -> None:
        self.client = client
        self.context_id = context_id
        self.deadline = time.monotonic() + timeout if timeout else None
        self.interrupted_at: float | None = None
        self.timed_out = False
        self.max_output = max_output
        self.output = 0
        self.flooded = False

    def interrupt(self) -> None:
        if self.interrupted_at is not None:
            return
        self.interrupted_at = time.monotonic()
        pid = kernel_pid(self.context_id)
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)

    def run(self, code: str) -> None:
        """Show the execution's events until the kernel is idle (or the interrupt's drain time is over). A
        reader thread drains the kernel's messages all along, so a cell that floods while stdout is slow
        is cut at its budget at once instead of filling queues (and the sandbox's memory)."""
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False)
        events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        done = threading.Event()
        reader = threading.Thread(target=self._read, args=(msg_id, events, done), daemon=True)
        reader.start()
        try:
            while True:
                try:
                    event = events.get(timeout=POLL_S)
                except queue.Empty:
                    event = {}
                if event is None:
                    return
                if event:
                    emit(event)
                if self._expired() and events.empty():
                    return
        finally:
            done.set()
            reader.join(timeout=2)

    def _read(self, msg_id: str, events: queue.Queue[dict[str, Any] | None], done: threading.Event) -> None:
        while not done.is_set():
            try:
                msg = self.client.get_iopub_msg(timeout=POLL_S)
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                events.put(None)
                return
            event = translate(msg)
            for shown in self.admit(event) if event is not None else []:
                events.put(shown)

    def admit(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """What to show of `event` within the output budget: past it the cell is interrupted (at its
        source: the kernel stops producing) and only one OutputLimitExceeded error is shown."""
        if self.flooded:
            return []
        self.output += len(json.dumps(event))
        if self.output <= self.max_output:
            return [event]
        self.flooded = True
        self.interrupt()
        value = f"the execution's output exceeds {self.max_output} bytes; it was interrupted"
        return [{"type": "error", "name": "OutputLimitExceeded", "value": value, "traceback": ""}]

    def _expired(self) -> bool:
        now = time.monotonic()
        if TERMINATED:
            self.interrupt()
        if self.deadline is not None and now > self.deadline and self.interrupted_at is None:
            self.timed_out = True
            self.interrupt()
        return self.interrupted_at is not None and now - self.interrupted_at > DRAIN_S


def execute(request: dict[str, Any]) -> None:
    context_id = request.get("context_id") or DEFAULT_CONTEXT
    where = context_dir(str(context_id))
    if kernel_pid(context_id) is None:
        if context_id != DEFAULT_CONTEXT:
            raise BridgeError("not_found", f"context {context_id} not found")
        start({"id": DEFAULT_CONTEXT})
    code = request.get("code")
    if not isinstance(code, str):
        raise BridgeError("invalid_argument", "code must be a string")
    env = request.get("env_vars") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise BridgeError("invalid_argument", "env_vars must map strings to strings")
    timeout = request.get("timeout")
    client = _client(where, deadline=time.monotonic() + KERNEL_START_S)
    emit({"ok": {"context_id": context_id}})
    signal.signal(signal.SIGTERM, _on_term)
    max_output = int(request.get("max_output_bytes") or MAX_OUTPUT_BYTES)
    run = Execution(client, context_id, float(timeout) if timeout else None, max_output)
    try:
        if env:
            _silent(client, env_set_code(env))
        run.run(code)
    finally:
        if env:
            with contextlib.suppress(Exception):
                _silent(client, ENV_RESTORE)
    if run.timed_out:
        emit({"type": "timeout"})
    emit({"type": "end_of_execution"})
    client.stop_channels()


COMMANDS = {"start": start, "list": list_contexts, "remove": remove, "restart": restart}


def main(argv: list[str]) -> int:
    os.makedirs(STATE, mode=0o700, exist_ok=True)
    try:
        command = argv[1] if len(argv) > 1 else ""
        request = json.loads(sys.stdin.read() or "{}")
        if not isinstance(request, dict):
            raise BridgeError("invalid_argument", "the request must be a JSON object")
        if command == "execute":
            execute(request)
        elif command in COMMANDS:
            emit({"ok": COMMANDS[command](request)})
        else:
            raise BridgeError("invalid_argument", f"unknown command {command!r}")
    except BridgeError as exc:
        emit({"error": {"code": exc.code, "message": exc.message}})
        return 2
    except ValueError as exc:
        emit({"error": {"code": "invalid_argument", "message": f"malformed request: {exc}"}})
        return 2
    except Exception as exc:  # the caller gets a line it can read, whatever went wrong
        emit({"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"[:1000]}})
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
