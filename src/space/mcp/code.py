"""How run_code runs Python in a sandbox. In a sandbox of the code-interpreter template, in its Jupyter
kernel (the API's `run_code`, ADR 0058: state kept between calls, rich results; `execution_text` renders
it); in any other, like a notebook cell (E2B's `run_code`) with the standard library of the sandbox's own
python3 and nothing installed by SPACE (CELL below).

Invariants:
- The code travels on the command's stdin, never in its argv (no length limit of the kernel's, nothing
  in the process list); the argv is the fixed CELL program below.
- What the cell prints comes back as it is; the value of its last expression, if it is one and not None,
  is printed after it as its repr; an exception prints the traceback of the code alone (file "<cell>")
  and exits 1.
"""

from __future__ import annotations

import re

from space.mcp.render import bounded
from space.sdk.code import CodeExecution

__all__ = ["CELL", "execution_text", "run_code_argv"]

CELL = """\
import ast, sys, traceback
source = sys.stdin.read()
namespace = {"__name__": "__main__"}
try:
    tree = ast.parse(source, "<cell>")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), namespace)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), namespace)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException:
    kind, error, trace = sys.exc_info()
    while trace is not None and trace.tb_frame.f_code.co_filename != "<cell>":
        trace = trace.tb_next
    traceback.print_exception(kind, error, trace)
    sys.exit(1)
"""


def run_code_argv() -> list[str]:
    """The argv that runs the code given on stdin as a cell."""
    return ["python3", "-c", CELL]


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: Result formats shown by their size only (an agent reading text gains nothing from base64).
_BINARY_FORMATS = ("png", "jpeg", "pdf", "svg")


def _image_line(kind: str, value: object) -> str:
    return "[svg image]" if kind == "svg" else f"[{kind} image: {len(str(value))} characters of base64]"


def execution_text(execution: CodeExecution) -> str:
    """A kernel execution (the code-interpreter template, ADR 0058) as text: its outcome, its output, the
    text of its results (images by kind and size), and its error with the traceback, colours removed."""
    if execution.timed_out:
        status = "timed out (interrupted)"
    elif execution.error is not None:
        status = f"error: {execution.error.name}: {execution.error.value}"
    else:
        status = "ok"
    parts = [status]
    for name, chunks in (("stdout", execution.stdout), ("stderr", execution.stderr)):
        if chunks:
            parts.append(f"--- {name} ---\n{bounded(''.join(chunks))}")
    for result in execution.results:
        label = "result" if result.get("is_main_result") else "display"
        shown = [_image_line(kind, result[kind]) for kind in _BINARY_FORMATS if result.get(kind)]
        text = result.get("text")
        if text:
            shown.insert(0, bounded(str(text)))
        parts.append(f"--- {label} ---\n" + "\n".join(shown or ["(no text)"]))
    if execution.error is not None and execution.error.traceback:
        parts.append(f"--- traceback ---\n{bounded(_ANSI.sub('', execution.error.traceback))}")
    return "\n".join(parts)
