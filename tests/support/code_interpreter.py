"""A code-interpreter sandbox for tests, made from the `code-interpreter` build spec without the network.

Tests send no traffic off the machine, and a node's template build fetches its packages from the machine's
package sources (the Debian archive and the package index of the Internet; ADR 0054). So the tests apply the
template's own spec (`space.node.code_interpreter.spec.code_interpreter_spec`) step by step to a sandbox of
its `from` template, through SPACE's exec and file calls, the same way the node's build runs its steps (as
root, in the sandbox), with the pip step installing wheels this machine's configured local (file://)
package indexes hold (`pip download` against them only: no network), uploaded into the sandbox; then the
start command runs, as it does in every new sandbox of the built template. The pip step's product is kept
in a machine cache (CACHE_DIR, keyed by the requirements and the Debian base) the way the node keeps a
build: the first run on a machine installs (~80 s under load), later ones unpack it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

from space.core.template_spec import FileStep, PipStep, RunStep, TemplateBuildSpec
from space.node.code_interpreter.spec import code_interpreter_spec
from space.node.volumes.template_base import BASE_VERSION

WHEELS_IN_SANDBOX = "/tmp/space-test-wheels"
#: What a pip install as root writes in the Debian base (relative to /): packed into the machine's cache.
INSTALLED = ["usr/local/lib/python3.11/dist-packages", "usr/local/bin"]
#: The product of the pip step, per requirements and base, kept between runs on this machine (like the
#: node's cache of the Debian base): the first run installs, later runs unpack what it installed.
CACHE_DIR = pathlib.Path("/var/cache/space/test-code-interpreter")


def local_indexes() -> list[str]:
    """The file:// package indexes of this machine's pip configuration (what `pip download` may read
    without the network)."""
    found: list[str] = []
    for key in ("global.index-url", "global.extra-index-url"):
        answer = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", key], capture_output=True, text=True, check=False
        )
        found += [url for url in answer.stdout.split() if url.startswith("file://")]
    assert found, "this machine's pip configuration names no local (file://) package index for the wheels"
    return found


def download_wheels(requirements: list[str], dest: pathlib.Path) -> list[pathlib.Path]:
    """The wheels of `requirements` and their dependencies, and pip's own, from the local indexes only."""
    indexes = local_indexes()
    argv = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-cache-dir",
            "--index-url", indexes[0], "-d", str(dest)]  # fmt: skip
    for url in indexes[1:]:
        argv += ["--extra-index-url", url]
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="")
    done = subprocess.run([*argv, *requirements, "pip"], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(dest.glob("*.whl"))


def _check(result: Any, what: str) -> None:
    assert result.exit_code == 0, (
        f"{what}: exit {result.exit_code}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )


def apply_spec(sb: Any, spec: TemplateBuildSpec | None = None) -> TemplateBuildSpec:
    """Apply `spec` (default: the code-interpreter's) to the sandbox `sb` (a space.sdk Sandbox of its `from`
    template), then run its start command."""
    spec = spec or code_interpreter_spec()
    for step in spec.steps:
        started = time.monotonic()
        if isinstance(step, PipStep):
            _pip(sb, step.pip)
        elif isinstance(step, FileStep):
            sb.files.write(step.file.path, base64.b64decode(step.file.content_b64))
            _check(
                sb.exec(["chmod", oct(step.file.mode)[2:], step.file.path], user="root", timeout=60), "chmod"
            )
        elif isinstance(step, RunStep):
            _check(sb.exec(["sh", "-c", step.run], user="root", timeout=600), step.run)
        else:
            raise AssertionError(f"the code-interpreter spec has a step these tests cannot apply: {step}")
        if os.environ.get("SPACE_TEST_TIMINGS"):
            print(
                f"code-interpreter spec: {type(step).__name__} {time.monotonic() - started:.1f} s", flush=True
            )
    if spec.start_cmd:
        _check(sb.exec(["sh", "-c", spec.start_cmd], user=spec.user, timeout=600), "start_cmd")
    return spec


def _pip(sb: Any, requirements: list[str]) -> None:
    cached = _cache_file(requirements)
    if cached.exists():  # the same step's product from an earlier run on this machine
        sb.files.write(f"{WHEELS_IN_SANDBOX}/installed.tar.gz", cached.read_bytes())
        unpack = ["tar", "-C", "/", "-xzf", f"{WHEELS_IN_SANDBOX}/installed.tar.gz"]
        _check(sb.exec(unpack, user="root", timeout=1200), "unpack the cached install")
    else:
        _pip_install(sb, requirements)
        pack = ["sh", "-c", f"tar -C / -czf {WHEELS_IN_SANDBOX}/installed.tar.gz {' '.join(INSTALLED)}"]
        _check(sb.exec(pack, user="root", timeout=1200), "pack the install")
        data = sb.files.read(f"{WHEELS_IN_SANDBOX}/installed.tar.gz")
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(data)
        partial.rename(cached)  # whole or absent: a killed run leaves only a .partial
    _check(sb.exec(["rm", "-rf", WHEELS_IN_SANDBOX], user="root", timeout=60), "rm wheels")


def _cache_file(requirements: list[str]) -> pathlib.Path:
    """Keyed by what decides the install: the requirements and the Debian base (its python)."""
    key = hashlib.sha256(json.dumps([sorted(requirements), BASE_VERSION, INSTALLED]).encode()).hexdigest()
    return CACHE_DIR / f"{key[:32]}.tar.gz"


def _pip_install(sb: Any, requirements: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="space-ci-wheels-") as tmp:
        wheels = download_wheels(requirements, pathlib.Path(tmp))
        for wheel in wheels:
            sb.files.write(f"{WHEELS_IN_SANDBOX}/{wheel.name}", wheel.read_bytes())
    pip_wheel = next(w.name for w in wheels if w.name.startswith("pip-"))
    argv = ["python3", f"{WHEELS_IN_SANDBOX}/{pip_wheel}/pip", "install", "-q", "--no-index", "--find-links",
            WHEELS_IN_SANDBOX, "--break-system-packages", "--root-user-action=ignore",
            "--disable-pip-version-check", *requirements]  # fmt: skip
    _check(sb.exec(argv, user="root", timeout=1200), "pip install")
