"""How run_code runs Python in a sandbox: like a notebook cell (E2B's `run_code`), with the standard library
of the sandbox's own python3 and nothing installed by SPACE.

Invariants:
- The code travels on the command's stdin, never in its argv (no length limit of the kernel's, nothing
  in the process list); the argv is the fixed CELL program below.
- What the cell prints comes back as it is; the value of its last expression, if it is one and not None,
  is printed after it as its repr; an exception prints the traceback of the code alone (file "<cell>")
  and exits 1.
"""

from __future__ import annotations

__all__ = ["CELL", "run_code_argv"]

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
