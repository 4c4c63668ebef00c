"""The naive baseline of `space bench`: a plain `runsc run` of a fresh copy of a template's root filesystem,
timed to the container's first answer (issue 12).

What one sample is: copy the template's root filesystem (`cp -a`, no reflink: a fresh copy, as a naive
platform would make one per sandbox; into memory when /dev/shm is there, the naive approach at its best),
write the OCI spec `runsc spec` makes for `/bin/echo ready`, start `runsc run` and stop the clock when
`ready` is read from the container's stdout. The copy is inside the measured time (its share is reported
as `copy_p50_ms`): it is what the naive approach pays per sandbox.

Invariants:
- Runs as root (runsc run), with its own runsc state directory and bundles in a temporary directory that is
  removed, containers included, whatever happens; nothing is left under the node's data directory, which is
  only read.
- The same runsc flags as the node where they matter to the comparison (platform, no network, no overlay).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ANSWER = b"ready"
RUN_TIMEOUT_S = 120.0
Log = Callable[[str], None]


def template_rootfs(node_data_dir: pathlib.Path, template: str) -> pathlib.Path:
    """Where a node keeps a template's root filesystem (space.node.layout: DATA_DIR/fs/templates/NAME)."""
    return node_data_dir / "fs" / "templates" / template


def scratch_dir() -> str:
    """Where the copies go: memory (tmpfs) when the machine has it, so the baseline is the naive approach at
    its fastest (no disk write-back in its time, which made a loaded disk's copies 5-70 s), else /var/tmp."""
    shm = pathlib.Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else "/var/tmp"


@dataclass
class PlainRunsc:
    """Plain `runsc run` samples in ms, and the share of each that was the copy."""

    rootfs: pathlib.Path
    runsc: str = "runsc"
    platform: str = "ptrace"
    samples: list[float] = field(default_factory=list)
    copies: list[float] = field(default_factory=list)

    def measure(self, n: int, log: Log) -> None:
        if not (self.rootfs / "bin").is_dir():
            raise FileNotFoundError(f"no template root filesystem at {self.rootfs}")
        with tempfile.TemporaryDirectory(prefix="space-bench-plain-", dir=scratch_dir()) as tmp:
            work = pathlib.Path(tmp)
            state = work / "state"
            state.mkdir()
            for index in range(n):
                self._once(work, state, index)
                log(f"plain runsc {index + 1}/{n}: {self.samples[-1]:.0f} ms")

    def _flags(self, state: pathlib.Path) -> list[str]:
        return [self.runsc, f"--root={state}", f"--platform={self.platform}", "--network=none",
                "--overlay2=none"]  # fmt: skip

    def _once(self, work: pathlib.Path, state: pathlib.Path, index: int) -> None:
        bundle = work / f"bundle-{index}"
        bundle.mkdir()
        container = f"space-bench-plain-{index}"
        try:
            start = time.perf_counter()
            subprocess.run(
                ["cp", "-a", "--reflink=never", str(self.rootfs), str(bundle / "rootfs")],
                check=True, capture_output=True, timeout=RUN_TIMEOUT_S,
            )  # fmt: skip
            copied = time.perf_counter()
            write_spec(self.runsc, bundle)
            answer = run_to_first_line(
                [*self._flags(state), "run", f"--bundle={bundle}", container], RUN_TIMEOUT_S
            )
            done = time.perf_counter()
            if answer.strip() != ANSWER:
                raise RuntimeError(f"plain runsc answered {answer!r}, not {ANSWER!r}")
            self.samples.append((done - start) * 1000)
            self.copies.append((copied - start) * 1000)
        finally:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    [*self._flags(state), "delete", "--force", container],
                    capture_output=True, timeout=30, check=False,
                )  # fmt: skip
            shutil.rmtree(bundle, ignore_errors=True)


def write_spec(runsc: str, bundle: pathlib.Path) -> None:
    """The default OCI spec of `runsc spec` for `/bin/echo ready`, on a writable root (a fresh copy)."""
    subprocess.run(
        [runsc, "spec", f"--bundle={bundle}", "--", "/bin/echo", ANSWER.decode()],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    path = bundle / "config.json"
    spec = json.loads(path.read_text())
    spec["root"] = {"path": "rootfs", "readonly": False}
    spec["process"]["terminal"] = False
    path.write_text(json.dumps(spec))


def run_to_first_line(argv: list[str], timeout: float) -> bytes:
    """Start `argv`, return the first line it prints, then wait for it to end (killed after `timeout`)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(timeout, proc.kill)  # a container that never answers ends readline() too
    watchdog.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        _out, err = proc.communicate()
        if not line:
            raise RuntimeError(f"plain runsc printed nothing: {err.decode(errors='replace').strip()[-500:]}")
        return line
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
