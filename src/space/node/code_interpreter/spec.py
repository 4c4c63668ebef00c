"""The `code-interpreter` template: its build spec (built with the node's template build, ADR 0054) and the
paths the control plane uses to drive its kernels (ADR 0058).

Invariants:
- The spec is data: built from `base` (user `user`, home /home/user, as E2B's code interpreter runs), pip
  packages pinned (so its spec hash, and the node's cache of the build, change only when this file or
  the bridge does), the kernel bridge written by a file step, and a start command that starts the
  default context's kernel in every new sandbox of the template.
- The bridge (`kernel_bridge.py` beside this module) is installed byte for byte; BRIDGE_PATH is where the
  control plane runs it, BRIDGE_ARGV the fixed argv prefix (the request travels on stdin, never in argv).
  The kernel launcher (`kernel_launcher.py`, what runs each kernel) is installed beside it, byte for byte.
"""

from __future__ import annotations

import base64
from importlib import resources
from typing import Final

from space.core.template_spec import TemplateBuildSpec, parse_build_spec

TEMPLATE_NAME: Final = "code-interpreter"
#: E2B's names for it: the SDK's default template and the name its docs use.
E2B_NAMES: Final = ("code-interpreter-v1", "code-interpreter")
BASE_TEMPLATE: Final = "base"
BRIDGE_DIR: Final = "/opt/code-interpreter"
BRIDGE_PATH: Final = f"{BRIDGE_DIR}/bridge.py"
#: Where the bridge finds the kernel launcher: beside itself, under this name.
KERNEL_LAUNCHER_PATH: Final = f"{BRIDGE_DIR}/kernel_launcher.py"
#: Where the bridge keeps its contexts: writable by the template's default user.
STATE_DIR: Final = "/var/lib/space-code"
PYTHON: Final = "python3"
BRIDGE_ARGV: Final = (PYTHON, BRIDGE_PATH)
#: Pinned: a new version is a new spec hash, hence a new build.
PACKAGES: Final = (
    "ipykernel==7.4.0",
    "jupyter_client==8.10.0",
    "matplotlib==3.11.2",
    "numpy==2.3.5",
    "pandas==3.0.6",
)


def bridge_source() -> bytes:
    """The kernel bridge program, as the template carries it."""
    return resources.files("space.node.code_interpreter").joinpath("kernel_bridge.py").read_bytes()


def launcher_source() -> bytes:
    """The kernel launcher, as the template carries it."""
    return resources.files("space.node.code_interpreter").joinpath("kernel_launcher.py").read_bytes()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def code_interpreter_spec() -> TemplateBuildSpec:
    """The build spec of the `code-interpreter` template."""
    return parse_build_spec(
        {
            "from": BASE_TEMPLATE,
            "steps": [
                {"pip": list(PACKAGES)},
                {"file": {"path": BRIDGE_PATH, "content_b64": _b64(bridge_source()), "mode": 0o755}},
                {
                    "file": {
                        "path": KERNEL_LAUNCHER_PATH,
                        "content_b64": _b64(launcher_source()),
                        "mode": 0o644,
                    }
                },
                {"run": f"chmod 0755 {BRIDGE_DIR} && mkdir -p {STATE_DIR} && chmod 1777 {STATE_DIR}"},
            ],
            "user": "user",
            "start_cmd": f"{PYTHON} {BRIDGE_PATH} start </dev/null",
        }
    )


def main() -> None:
    """`python -m space.node.code_interpreter.spec`: the spec as JSON, for `space.templates.build(...)` or
    the API's `POST /v1/templates`."""
    print(code_interpreter_spec().canonical_json())


if __name__ == "__main__":
    main()
