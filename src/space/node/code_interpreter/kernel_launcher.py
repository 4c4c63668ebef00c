"""What runs a code-interpreter context's Jupyter kernel: `python3 kernel_launcher.py -f CONNECTION_FILE`,
started by the kernel bridge (`kernel_bridge.py`, installed beside it by the template's build spec). It is
ipykernel's own launcher (`python -m ipykernel_launcher`) with the kernel's memory for output bounded.

Measured (issue 13, ADR 0058): a cell `while True: print('x' * 65536)` took the sandbox down (512 MB)
before the bridge's output budget could act, because
- ipykernel (7.4) buffers all that a cell writes to stdout/stderr between its timed flushes (0.2 s apart)
  and sends it as ONE message: the loop buffered hundreds of MB in the kernel, and the bridge decoded that
  message into more copies of it;
- IPython (9) keeps every cell's stdout/stderr text, displays, results and traceback in the shell's
  history manager for the kernel's life (for `%notebook`): each flood, each log line, stayed.

Invariants:
- A writer to the kernel's stdout or stderr has at most STREAM_CHUNK characters unsent: a write past it
  waits until the kernel's IOPub thread has sent them (`bound_streams`). So a flood is many small
  messages, sent at the pace the IOPub thread sends them; the bridge's budget counts them as they come
  and its interrupt (SIGINT) lands in that wait.
- No output or traceback of an execution is kept by the shell's history manager once the execution has
  ended (`forget_outputs`); the Out/_ cache of results and `sys.last_*` are IPython's usual ones.
- Standard library and ipykernel only; nothing of SPACE is imported. The kernel's code sees the sys.path
  `python -m ipykernel_launcher` gives it (the cwd first, not this file's directory).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

#: The most text (characters) a writer to the kernel's stdout/stderr has unsent.
STREAM_CHUNK = 64 << 10


def bound_streams(stream_class: Any) -> None:
    """Bound ipykernel's output streams (`stream_class` is its OutStream): once a writer has buffered
    STREAM_CHUNK characters (a longer write is cut there) it flushes, which waits until the IOPub thread
    has sent them. A message then carries at most STREAM_CHUNK characters of one writer (ipykernel's
    timed flushes only make them smaller). Idempotent."""
    write = stream_class.write
    if getattr(write, "space_bounded", False):
        return

    def bounded_write(self: Any, string: Any) -> Any:
        if not isinstance(string, str) or not string:
            return write(self, string)  # ipykernel's own TypeError, or nothing to send
        start = 0
        while start < len(string):
            pending = getattr(self, "space_pending", 0)
            end = min(len(string), start + STREAM_CHUNK - pending)
            write(self, string[start:end])
            pending += end - start
            start = end
            # Reset before the flush: an interrupt raised in its wait must not leave the count high.
            self.space_pending = 0 if pending >= STREAM_CHUNK else pending
            if pending >= STREAM_CHUNK:
                self.flush()
        return len(string)

    bounded_write.space_bounded = True  # type: ignore[attr-defined]
    stream_class.write = bounded_write


#: What IPython's history manager keeps of every execution for the kernel's life (for `%notebook`).
KEPT_PER_EXECUTION = ("outputs", "exceptions")


def forget_outputs(shell: Any) -> None:
    """Drop what the IPython shell keeps of each execution's output and traceback (KEPT_PER_EXECUTION of
    its history manager) when the execution ends (`post_execute`). What a shell does not have (another
    IPython) is left as it is."""
    history = getattr(shell, "history_manager", None)

    def forget() -> None:
        for name in KEPT_PER_EXECUTION:
            clear = getattr(getattr(history, name, None), "clear", None)
            if callable(clear):
                clear()

    if history is not None:
        shell.events.register("post_execute", forget)


def main(argv: list[str]) -> None:
    """What `python -m ipykernel_launcher ARGV` runs, with bound_streams applied before the kernel makes
    its streams and forget_outputs once it has made its shell."""
    sys.path[0] = os.getcwd()  # as under `python -m`: the cwd, not the template's bridge directory
    bound_streams(importlib.import_module("ipykernel.iostream").OutStream)
    app = importlib.import_module("ipykernel.kernelapp").IPKernelApp.instance()
    app.initialize(argv)
    forget_outputs(app.shell)
    app.start()


if __name__ == "__main__":
    main(sys.argv[1:])
