"""Running a template build's steps inside its build sandbox, as root, through the guest daemon
(docs/adr/0054-template-build.md).

Invariants:
- Nothing of a build runs on the host: every step is an exec or a file write in the build sandbox.
- Every command is an argv (no shell) except a `run` step, which is the user's own `sh -c` inside the
  sandbox; package names reach argv only after space.core.template_spec refused anything option-like.
- Steps run in order; the first that exits non-zero (or times out) ends the build with BuildFailed naming
  the step, its exit code and the tail of its output.
- Output is streamed as log lines, each at most MAX_LOG_LINE characters (longer ones are cut, marked),
  and at most MAX_LOG_TOTAL bytes in all: past that one line says how much was dropped, the build goes on.
- What the build itself put into the tree for its own use (its apt sources, apt's lists, the node's egress
  CA in the trust store) is removed again before the tree is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from space.core import errors
from space.core.template_spec import (
    AptStep,
    EnvStep,
    FileStep,
    PipStep,
    RunStep,
    TemplateBuildSpec,
    WorkdirStep,
    step_kind,
)
from space.node.agent import egress_sandbox
from space.node.agent.guest import GuestSession
from space.node.agent.template_build_sources import BuildSources

MAX_LOG_LINE: Final = 4096
MAX_LOG_TOTAL: Final = 1 << 20
TAIL_BYTES: Final = 2048
#: Inside the build sandbox: the build's own apt configuration (removed before the commit).
BUILD_DIR: Final = "/var/lib/space-build"
APT_ENV: Final = {"DEBIAN_FRONTEND": "noninteractive"}


class BuildFailed(errors.SpaceError):
    """A build step failed inside the build sandbox (its exit code and output tail are in `details`)."""

    code = "build_failed"


class LogSink:
    """Process output as bounded log lines (see the module invariants); keeps the current step's tail."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._started = time.monotonic()
        self._partial = b""
        self.total = 0
        self.dropped = 0
        self.tail = b""

    def note(self, text: str) -> None:
        """A line of SPACE's own about the build, with the seconds since it started."""
        self.line(f"space: [{time.monotonic() - self._started:.1f} s] {text}")

    def line(self, text: str) -> None:
        if len(text) > MAX_LOG_LINE:
            text = text[:MAX_LOG_LINE] + f" [line cut: {len(text) - MAX_LOG_LINE} more characters]"
        size = len(text.encode())
        if self.total + size > MAX_LOG_TOTAL:
            if self.dropped == 0:
                self._emit(f"[log truncated: more than {MAX_LOG_TOTAL} bytes; the rest is dropped]")
            self.dropped += size
            return
        self.total += size
        self._emit(text)

    def feed(self, _channel: Any, data: bytes) -> None:
        self.tail = (self.tail + data)[-TAIL_BYTES:]
        self._partial += data
        *lines, self._partial = self._partial.split(b"\n")
        if len(self._partial) > MAX_LOG_LINE:  # an endless line: flush it in pieces
            lines.append(self._partial)
            self._partial = b""
        for raw in lines:
            self.line(raw.decode(errors="replace").rstrip("\r"))

    def flush(self) -> None:
        if self._partial:
            self.line(self._partial.decode(errors="replace"))
            self._partial = b""


class StepRunner:
    """Runs one build's steps in its sandbox (session), logging into `sink`."""

    def __init__(
        self, session: GuestSession, spec: TemplateBuildSpec, sources: BuildSources, sink: LogSink
    ) -> None:
        self.session = session
        self.spec = spec
        self.sources = sources
        self.sink = sink
        self.env: dict[str, str] = {}
        self.workdir = "/"
        self._apt_ready = False

    async def exec(self, what: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> None:
        self.sink.tail = b""
        result = await self.session.exec(
            list(argv), env={**self.env, **(env or {})}, cwd=self.workdir, user="root",
            timeout=self.sources.step_timeout_s, on_output=self.sink.feed, max_output=0,
        )  # fmt: skip
        self.sink.flush()
        if result.timed_out or result.exit_code != 0:
            tail = self.sink.tail.decode(errors="replace")
            ended = "timed out" if result.timed_out else f"exited with code {result.exit_code}"
            raise BuildFailed(
                f"{what} {ended}: {tail[-500:]}", exit_code=result.exit_code, tail=tail,
                timed_out=result.timed_out,
            )  # fmt: skip

    async def run_all(self) -> None:
        if self.spec.user is not None and self.spec.user != "root":
            user = self.spec.user
            self.sink.note(f"user {user}")
            script = 'id -u "$1" >/dev/null 2>&1 || useradd -m -s /bin/bash "$1"'
            await self.exec("creating the user", ["sh", "-c", script, "sh", user])
        for index, step in enumerate(self.spec.steps, start=1):
            self.sink.note(f"step {index}/{len(self.spec.steps)}: {step_kind(step)}")
            try:
                await self._step(step)
            except BuildFailed as exc:
                exc.details["step"] = index
                exc.message = f"step {index} ({step_kind(step)}): {exc.message}"
                exc.args = (exc.message,)
                raise
        await self._make_workdir()

    async def _step(self, step: Any) -> None:
        if isinstance(step, AptStep):
            await self.apt_install(step.apt)
        elif isinstance(step, PipStep):
            await self.pip_install(step.pip)
        elif isinstance(step, FileStep):
            parent = posixpath.dirname(step.file.path)
            await self.session.mkdir(parent, parents=True)
            await self.session.write_file(step.file.path, step.file.content(), mode=step.file.mode)
            await self.session.chmod(step.file.path, step.file.mode)  # exactly the mode, whatever the umask
        elif isinstance(step, RunStep):
            await self.exec("the command", ["sh", "-c", step.run])
        elif isinstance(step, EnvStep):
            self.env.update(step.env)
        elif isinstance(step, WorkdirStep):
            await self.exec("creating the workdir", ["mkdir", "-p", step.workdir])
            self.workdir = step.workdir

    def _apt(self, *args: str) -> list[str]:
        return [
            "apt-get", "-o", f"Dir::Etc::SourceList={BUILD_DIR}/sources.list",
            "-o", f"Dir::Etc::SourceParts={BUILD_DIR}/sources.list.d", *args,
        ]  # fmt: skip

    async def apt_install(self, packages: Sequence[str]) -> None:
        if not self._apt_ready:
            await self.session.mkdir(f"{BUILD_DIR}/sources.list.d", parents=True)
            await self.session.write_file(
                f"{BUILD_DIR}/sources.list", self.sources.apt_sources.encode(), mode=0o644
            )
            await self.exec("apt-get update", self._apt("update"), env=APT_ENV)
            self._apt_ready = True
        argv = self._apt("install", "-y", "--no-install-recommends", *packages)
        await self.exec("apt-get install", argv, env=APT_ENV)

    async def pip_install(self, requirements: Sequence[str]) -> None:
        probe = await self.session.exec(
            ["python3", "-m", "pip", "--version"], user="root", cwd="/", max_output=0
        )
        if probe.exit_code != 0:
            self.sink.note("the template has no pip: installing python3-pip with apt first")
            await self.apt_install(["python3-pip"])
        # --break-system-packages: the template is an image, not a Debian system somebody upgrades with apt
        # later; installing beside apt's packages is what the user asked for (ADR 0054).
        argv = [
            "python3", "-m", "pip", "install", "--break-system-packages", "--root-user-action=ignore",
            "--no-cache-dir", "--disable-pip-version-check", "--no-input",
            "--index-url", self.sources.pip_index,
        ]  # fmt: skip
        trusted = self.sources.pip_trusted_host()
        if trusted is not None:
            argv += ["--trusted-host", trusted]
        await self.exec("pip install", [*argv, *requirements])

    async def _make_workdir(self) -> None:
        workdir = self.spec.final_workdir()
        user = self.spec.user
        if workdir is not None and user is not None and user != "root":
            # The default user works in its workdir: it owns it unless the build gave it to somebody else.
            script = '[ "$(stat -c %u "$1")" != 0 ] || chown "$2:" "$1"'
            await self.exec("handing the workdir to the user", ["sh", "-c", script, "sh", workdir, user])

    async def clean(self, egress: bool) -> None:
        """Remove what the build put into the tree for itself (see the module invariants). The node's CA is
        taken out of the bundle directly (its marked block, and its PEM wherever a ca-certificates trigger
        copied it), not by `update-ca-certificates --fresh`, which took a minute in a loaded sandbox."""
        self.sink.note("cleaning up")
        ca = b""
        if egress:
            with contextlib.suppress(errors.NotFound):
                ca = await self.session.read_file(egress_sandbox.CA_FILE_PATH)
        script = (
            f"rm -rf {BUILD_DIR}; if [ -d /var/lib/apt/lists ]; then apt-get clean; "
            "rm -rf /var/lib/apt/lists/*; fi"
        )
        if egress:  # the CA file, and the links a ca-certificates trigger made to it
            script += (
                f"; rm -f {egress_sandbox.CA_FILE_PATH}; find /etc/ssl/certs -maxdepth 1 -xtype l -delete"
            )
        await self.exec("cleaning up", ["sh", "-c", script])
        if egress:
            try:
                bundle = await self.session.read_file(egress_sandbox.CA_BUNDLE_PATH)
            except errors.NotFound:
                return
            cleaned = without_node_ca(bundle, ca)
            if cleaned != bundle:
                await self.session.write_file(egress_sandbox.CA_BUNDLE_PATH, cleaned, mode=0o644)


def without_node_ca(bundle: bytes, ca_pem: bytes = b"") -> bytes:
    """`bundle` without the node's egress CA: its marked block (egress_sandbox.with_node_ca puts it there)
    and any other copy of `ca_pem` (update-ca-certificates appends local certificates verbatim)."""
    kept = bundle
    while egress_sandbox.CA_BEGIN in kept:
        head, _, rest = kept.partition(egress_sandbox.CA_BEGIN)
        _, found, tail = rest.partition(egress_sandbox.CA_END)
        kept = head + (tail if found else b"")
    pem = ca_pem.strip()
    if pem:
        kept = kept.replace(pem + b"\n", b"").replace(pem, b"")
    return kept


async def run_steps(runner: StepRunner, *, egress: bool) -> None:
    """All steps, then the clean-up and a sync of the guest's file system."""
    await runner.run_all()
    await runner.clean(egress)
    await asyncio.wait_for(runner.session.sync(), 120)
