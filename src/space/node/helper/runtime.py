"""Runtime incarnations of sandboxes: holders, runsc containers, their state (root helper only).

A sandbox keeps its id for life, but each boot or restore runs as a new runsc *container* named
`<sandbox id>-<generation>`. That lets the helper retire the previous container (`runsc delete`, ~30 ms) in
the background instead of on the critical path of checkpoint, restore and rollback, without ever reusing a
container id or a cgroup that a retiring container might still remove.

Invariants:
- `run/<sandbox>/container` names the current container; it is written before the holder is spawned, so a
  helper restarted at any moment knows which container is current and that all others may be deleted.
- Each container has its own cgroup `/<cgroup parent>/<container id>` (parent `space` unless the node was
  given its own, so two nodes on one machine never share a cgroup); limits are written into the bundle at
  launch.
- Status is read from runsc's own state file (sub-millisecond) and cross-checked with the sandbox process'
  liveness; `runsc state` (a ~30 ms process) is only the fallback for an unreadable file.
- A runtime a checkpoint holds (the sandbox's own pause, asked over its control socket: ADR 0084) is
  recorded in `run/<sandbox>/held`, naming the container, written before the sandbox is asked; each
  release resumes at most once, and only the current container while it runs.
- Every retired container is deleted by `runsc delete --force` in a tracked background thread; `settle()`
  waits for them, and `sweep()` deletes leftovers of a previous helper (e.g. killed mid-way).
- `run/runtime.json` (the agent's, 0600) is the runtime descriptor of this helper's runsc (core.runtimes),
  published when the helper gets ready to launch (`prime`, at node.prepare) for the agent to report; a
  restore is refused (RuntimeIncompatible) before anything starts when its image needs another runtime.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from space.core import errors, tracing
from space.node.helper import holder, network, sentry
from space.node.helper.freezer import CgroupFreezer
from space.node.helper.runsc import LAYER, Runsc
from space.node.layout import NodeLayout

SOCKET_WAIT_S = 10.0
HOLDER_EXIT_WAIT_S = 30.0
KILL_GRACE_S = 10.0
LIVE_STATUSES = frozenset({"running", "paused", "created"})
#: The node's runtime descriptor under the run directory (read by the agent: space.node.agent.runtime_info).
RUNTIME_DESCRIPTOR = "runtime.json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _runs_for(pid: int, sandbox_id: str) -> bool:
    try:
        return sandbox_id.encode() in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def log_tail(path: pathlib.Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Runtimes:
    def __init__(
        self, layout: NodeLayout, runsc: Runsc, owner_uid: int, cgroup_parent: str = "space"
    ) -> None:
        self.layout = layout
        self.cgroup_parent = cgroup_parent
        self.runsc = runsc
        self.owner_uid = owner_uid
        self.freezer = CgroupFreezer()
        self.network: network.SandboxNetworks | None = None  # set by the helper when sandboxes get one
        self._retiring: dict[str, threading.Thread] = {}
        self._retiring_lock = threading.Lock()
        self._spare: subprocess.Popen[bytes] | None = None
        self._spare_lock = threading.Lock()

    # -- naming and state ----------------------------------------------------------------------------------
    def container(self, sandbox_id: str) -> str | None:
        try:
            name = (self.layout.run_dir(sandbox_id) / "container").read_text().strip()
        except FileNotFoundError:
            return None
        return name or None

    def _next_container(self, sandbox_id: str) -> str:
        current = self.container(sandbox_id)
        generation = 0
        if current is not None:
            with contextlib.suppress(ValueError):
                generation = int(current.rsplit("-", 1)[1]) + 1
        return f"{sandbox_id}-{generation}"

    def _state_file(self, container: str) -> pathlib.Path:
        return self.layout.runsc_root / f"{container}_sandbox:{container}.state"

    def container_state(self, container: str) -> dict[str, Any] | None:
        try:
            raw = self._state_file(container).read_text()
        except FileNotFoundError:
            return None
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return self.runsc.state(container)  # caught mid-write: ask runsc itself
        return value if isinstance(value, dict) else None

    def status(self, sandbox_id: str) -> str:
        """running | paused | created | stopped | absent (runsc knows no current container). Paused is
        runsc's own pause, a frozen cgroup (ADR 0082) or a checkpoint's hold (ADR 0084)."""
        status = self.runsc_status(sandbox_id)
        if status == "running" and (self.frozen(sandbox_id) or self.held(sandbox_id)):
            return "paused"
        return status

    def runsc_status(self, sandbox_id: str) -> str:
        """The status runsc itself records (a frozen runtime is "running" there); "stopped" for a container
        being retired, whose processes may still be on their way out (a discard: ADR 0088)."""
        container = self.container(sandbox_id)
        if container is not None and self.retiring(container):
            return "stopped"
        state = self.container_state(container) if container else None
        if state is None:
            return "absent"
        status = str(state.get("status", "unknown"))
        pid = (state.get("sandbox") or {}).get("pid")
        if status in LIVE_STATUSES and isinstance(pid, int) and pid > 0 and not _pid_alive(pid):
            return "stopped"
        return status

    def cgroup_name(self, sandbox_id: str) -> str | None:
        container = self.container(sandbox_id)
        return f"{self.cgroup_parent}/{container}" if container else None

    def frozen(self, sandbox_id: str) -> bool:
        cgroup = self.cgroup_name(sandbox_id)
        return cgroup is not None and self.freezer.frozen(cgroup)

    def thaw(self, sandbox_id: str) -> None:
        """Undo a freeze (nothing to do for a runtime that is not frozen)."""
        cgroup = self.cgroup_name(sandbox_id)
        if cgroup is not None and self.freezer.frozen(cgroup):
            self.freezer.thaw(cgroup)

    def _hold_mark(self, sandbox_id: str) -> pathlib.Path:
        return self.layout.run_dir(sandbox_id) / "held"

    def held(self, sandbox_id: str) -> bool:
        """Whether the current container's tasks were stopped by `hold` and not released since."""
        container = self.container(sandbox_id)
        try:
            return container is not None and self._hold_mark(sandbox_id).read_text() == container
        except FileNotFoundError:
            return False

    def hold(self, sandbox_id: str) -> None:
        """Stop the runtime's tasks from inside (the sandbox's own pause, what `runsc pause` asks, made
        directly: ADR 0084) while it keeps answering runsc, so a checkpoint and its disk snapshot are one
        moment. Idempotent, and a runtime runsc itself paused counts as held. The mark (the container's
        name in `run/<sandbox>/held`) is written before the sandbox is asked: a helper that dies in between
        leaves a mark that the next `release` acts on, and a pause is never left without one."""
        container = self.require(sandbox_id, "running", "paused", event="checkpoint")
        if self.held(sandbox_id) or self.runsc_status(sandbox_id) == "paused":
            return
        if not sentry.control_socket(self.layout.runsc_root, container).exists():
            self.runsc.pause(container)  # runsc put its socket elsewhere (a root too long to bind in)
            return
        mark = self._hold_mark(sandbox_id)
        mark.write_text(container)
        try:
            sentry.call(self.layout.runsc_root, container, sentry.Method.PAUSE)
        except errors.RuntimeFailure:
            mark.unlink(missing_ok=True)
            raise

    def release(self, sandbox_id: str) -> None:
        """Undo a hold: ours (the mark), or `runsc pause` (an older helper's, or the freezer's fallback).
        A mark of a runtime that no longer runs is dropped; a resume that fails keeps it for the next try."""
        mark = self._hold_mark(sandbox_id)
        container = self.container(sandbox_id)
        if mark.exists():
            if self.held(sandbox_id) and self.runsc_status(sandbox_id) in LIVE_STATUSES:
                assert container is not None
                sentry.call(self.layout.runsc_root, container, sentry.Method.RESUME)
            mark.unlink(missing_ok=True)
        if container and self.runsc_status(sandbox_id) == "paused":
            self.runsc.resume(container)

    def holder_alive(self, sandbox_id: str) -> bool:
        info_path = self.layout.run_dir(sandbox_id) / "holder.json"
        if not self.layout.channel_socket(sandbox_id).exists():
            return False
        try:
            pid = int(json.loads(info_path.read_text())["holder_pid"])
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            return False
        return _pid_alive(pid)

    def exit_info(self, sandbox_id: str) -> dict[str, Any] | None:
        path = self.layout.run_dir(sandbox_id) / "exit.json"
        try:
            value = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return value if isinstance(value, dict) else None

    # -- launching -------------------------------------------------------------------------------------------
    def launch(self, sandbox_id: str, image: pathlib.Path | None = None) -> str:
        """Start a new incarnation (boot, or restore from `image`); returns the channel socket path."""
        if image is not None:
            self.runsc.check_image(image)
        bundle = self.layout.bundle(sandbox_id)
        config_path = bundle / "config.json"
        container = self._next_container(sandbox_id)
        config = json.loads(config_path.read_text())
        config["linux"]["cgroupsPath"] = f"/{self.cgroup_parent}/{container}"
        entry = network.prepare_launch(self.network, sandbox_id, config)  # netns, before runsc scrapes it
        tmp = bundle / "config.json.tmp"
        tmp.write_text(json.dumps(config, indent=1))
        tmp.replace(config_path)
        run_dir = self.layout.run_dir(sandbox_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        run_dir.chmod(0o755)
        for stale in ("exit.json", "holder.json", "channel.sock"):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / stale).unlink()
        (run_dir / "container").write_text(container)
        argv = (
            self.runsc.run_argv(bundle, container)
            if image is None
            else self.runsc.restore_argv(bundle, image, container)
        )
        return self._spawn_holder(sandbox_id, [*entry, *argv])

    @staticmethod
    def holder_argv() -> list[str]:
        """How a spare holder is started. -I -S and the holder's directory at the END of sys.path: no
        site-packages, no shadowing of the standard library, and not the `space` package (its `typing`
        import alone would cost a holder more than the relay needs). Imported, not run as a script: a
        script is compiled from source in every holder, which leaves ~1.2 MB of compiler garbage in its
        heap; an import loads the cached bytecode (ADR 0045)."""
        boot = (
            f"import sys; sys.path.append({os.path.dirname(holder.__file__)!r}); "
            "from holder import main; raise SystemExit(main())"
        )
        return [sys.executable, "-I", "-S", "-c", boot, "--spare"]

    @classmethod
    def _start_spare(cls) -> subprocess.Popen[bytes]:
        spare = subprocess.Popen(
            cls.holder_argv(),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
        threading.Thread(target=spare.wait, name="reap-holder", daemon=True).start()
        return spare

    def _take_spare(self) -> subprocess.Popen[bytes]:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is None or spare.poll() is not None:
            spare = self._start_spare()
        threading.Thread(target=self._refill_spare, name="spare-holder", daemon=True).start()
        return spare

    def prime(self) -> None:
        """Have a spare holder waiting before the first sandbox is created, and the runtime described."""
        self.publish_descriptor()
        with self._spare_lock:
            if self._spare is not None and self._spare.poll() is None:
                return
        self._refill_spare()

    def publish_descriptor(self) -> pathlib.Path:
        """Write `run/runtime.json` (atomically) for the agent: owned by the agent's user, 0600 like every
        other file of the data directory (ADR 0022), though it holds no secret."""
        path = self.layout.run / RUNTIME_DESCRIPTOR
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.runsc.descriptor(), sort_keys=True))
        tmp.chmod(0o600)
        if os.geteuid() == 0:
            os.chown(tmp, self.owner_uid, -1)
        tmp.replace(path)
        return path

    def _refill_spare(self) -> None:
        fresh = self._start_spare()
        with self._spare_lock:
            if self._spare is None:
                self._spare = fresh
                return
        self._discard(fresh)

    @staticmethod
    def _discard(spare: subprocess.Popen[bytes]) -> None:
        if spare.stdin is not None:
            spare.stdin.close()  # EOF: the spare exits on its own

    def close(self) -> None:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            self._discard(spare)

    @tracing.timed(LAYER, "runsc.launch")  # runsc run|restore in a holder, until its channel is up (ADR 0072)
    def _spawn_holder(self, sandbox_id: str, runtime_argv: list[str]) -> str:
        run_dir = self.layout.run_dir(sandbox_id)
        socket_path = self.layout.channel_socket(sandbox_id)
        log_path = run_dir / "runtime.log"
        spare = self._take_spare()
        job = holder.encode_assignment(str(socket_path), self.owner_uid, str(log_path), runtime_argv)
        assert spare.stdin is not None
        try:
            spare.stdin.write(job)
            spare.stdin.close()
        except BrokenPipeError as exc:
            raise errors.RuntimeFailure(f"holder of {sandbox_id} died before its assignment") from exc
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not socket_path.exists():
            if spare.poll() is not None:
                raise errors.RuntimeFailure(f"holder of {sandbox_id} exited early: {log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise errors.RuntimeFailure(f"holder of {sandbox_id} did not open its socket")
            time.sleep(0.001)
        return str(socket_path)

    # -- control ---------------------------------------------------------------------------------------------
    def settled_status(self, sandbox_id: str, timeout: float = HOLDER_EXIT_WAIT_S) -> str:
        """The status once a runtime that is still booting or restoring (holder up, no runsc state yet, or
        `created`) has come up, so a request right after a launch is not refused as "absent"."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(sandbox_id)
            if status not in {"absent", "created"} or not self.holder_alive(sandbox_id):
                return status
            if time.monotonic() > deadline:
                return status
            time.sleep(0.005)

    def require(self, sandbox_id: str, *allowed: str, event: str) -> str:
        status = self.settled_status(sandbox_id)
        if status not in allowed:
            raise errors.InvalidState(f"runtime of {sandbox_id} is {status}", state=status, event=event)
        container = self.container(sandbox_id)
        assert container is not None
        return container

    def pause(self, sandbox_id: str) -> None:
        """Stop every process of a running runtime: its cgroup frozen, or `runsc pause` where that cannot be
        done (no freezer, or a freeze that did not converge)."""
        container = self.require(sandbox_id, "running", event="pause")
        cgroup = self.cgroup_name(sandbox_id)
        if cgroup is None or not self.freezer.freeze(cgroup):
            self.runsc.pause(container)

    def resume(self, sandbox_id: str) -> None:
        """Undo either kind of pause (a runtime can be frozen by a user's pause AND held by a checkpoint
        that left it paused)."""
        self.require(sandbox_id, "paused", event="resume")
        self.thaw(sandbox_id)
        self.release(sandbox_id)

    def wait_holder_exit(self, sandbox_id: str, timeout: float = HOLDER_EXIT_WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.holder_alive(sandbox_id):
            if time.monotonic() > deadline:
                raise errors.RuntimeFailure(f"runtime of {sandbox_id} did not exit")
            time.sleep(0.002)

    def stop(self, sandbox_id: str) -> None:
        """End the current incarnation (idempotent); its container is retired in the background."""
        self.settled_status(sandbox_id)  # a booting runtime is first let up, then stopped
        self.thaw(sandbox_id)  # frozen tasks act on no signal, and runsc could not reach the sandbox
        with contextlib.suppress(errors.RuntimeFailure):
            self.release(sandbox_id)  # a paused sandbox does not act on SIGKILL until resumed
        status = self.runsc_status(sandbox_id)
        container = self.container(sandbox_id)
        if status in LIVE_STATUSES and container:
            with contextlib.suppress(errors.RuntimeFailure):
                self.runsc.kill(container)
        try:
            self.wait_holder_exit(sandbox_id, timeout=KILL_GRACE_S)
        except errors.RuntimeFailure:
            # runsc could not stop it (e.g. its state is damaged): kill its processes ourselves.
            self._kill_runtime_processes(sandbox_id, container)
            self.wait_holder_exit(sandbox_id)
        if container:
            self.retire(container)

    def discard(self, sandbox_id: str) -> None:
        """End the current incarnation when nothing of it is kept (its root filesystem is replaced next: a
        rollback, a restore over it): a running or paused runtime's processes are SIGKILLed directly, not
        through `runsc kill` (a Go binary started, and a paused sandbox resumed first, for a kill that flushes
        nothing anyone reads, ADR 0077), and their end is not waited for (ADR 0088): the holder's socket is
        unlinked first, so the runtime is gone at once for everyone here (`holder_alive`), and its holder,
        once it has reaped them, leaves the run directory to the next incarnation. A runtime still coming
        up, or one without a live holder, is stopped the usual way; either way its container is retired in
        the background, as `stop` does."""
        with LAYER.span("runtime.discard"):
            container = self.container(sandbox_id)
            live = self.status(sandbox_id) in {"running", "paused"}
            if container and live and self.holder_alive(sandbox_id):
                self.layout.channel_socket(sandbox_id).unlink(missing_ok=True)  # before any of it dies
                self._kill_runtime_processes(sandbox_id, container)
                self.thaw(sandbox_id)  # a frozen task dies of its SIGKILL only once thawed (cgroup v1)
                self.retire(container)  # `runsc delete --force` also waits out its processes' end
                return
            self.stop(sandbox_id)  # a no-op for a runtime already gone; retires its container

    def _kill_runtime_processes(self, sandbox_id: str, container: str | None) -> None:
        """SIGKILL the runtime's processes: runsc's own if it still runs, and (runsc runs sandboxes detached)
        the sandbox and gofer processes its state names; each only while its command line still names the
        sandbox, so a recycled pid is never hit. The holder reaps them and records the end."""
        pids: list[object] = []
        with contextlib.suppress(OSError, ValueError, KeyError, json.JSONDecodeError):
            info = json.loads((self.layout.run_dir(sandbox_id) / "holder.json").read_text())
            pids.append(info["runtime_pid"])
        state = self.container_state(container) if container else None
        if state is not None:
            pids += [(state.get("sandbox") or {}).get("pid"), state.get("goferPid")]
        for pid in pids:
            if isinstance(pid, int) and pid > 0 and _runs_for(pid, sandbox_id):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def retiring(self, container: str) -> bool:
        with self._retiring_lock:
            return container in self._retiring

    def retire(self, container: str) -> None:
        """Delete a container that no longer runs, off the critical path."""
        with self._retiring_lock:
            if container in self._retiring:
                return
            thread = threading.Thread(target=self._delete, args=(container,), name=f"retire-{container}")
            self._retiring[container] = thread
        thread.start()

    def _delete(self, container: str) -> None:
        try:
            if self.container_state(container) is not None:
                self.runsc.delete(container)
        except errors.RuntimeFailure:
            pass
        finally:
            _remove_cgroup_dirs(self.cgroup_parent, container)
            with self._retiring_lock:
                self._retiring.pop(container, None)

    def settle(self, sandbox_id: str | None = None) -> None:
        """Wait until retired containers (of one sandbox, or all) are deleted."""
        with self._retiring_lock:
            threads = [t for c, t in self._retiring.items() if sandbox_id is None or c.startswith(sandbox_id)]
        for thread in threads:
            thread.join(60)

    def sweep(self) -> list[str]:
        """Delete every container that is not the current one of a sandbox (leftovers of a killed helper)."""
        removed = []
        root = self.layout.runsc_root
        for state_file in sorted(root.glob("*_sandbox:*.state")) if root.exists() else []:
            container = state_file.name.split("_sandbox:", 1)[0]
            sandbox_id = container.rsplit("-", 1)[0]
            if self.container(sandbox_id) == container and self.status(sandbox_id) in LIVE_STATUSES:
                continue
            if self.container(sandbox_id) == container and self.holder_alive(sandbox_id):
                continue
            self.retire(container)
            removed.append(container)
        self.settle()
        return removed


def _remove_cgroup_dirs(parent: str, container: str) -> None:
    """runsc removes its cgroups on delete; this sweeps up after a runtime that was killed hard."""
    base = pathlib.Path("/sys/fs/cgroup")
    for controller_dir in base.iterdir() if base.exists() else []:
        leaf = controller_dir / parent / container
        if leaf.is_dir():
            with contextlib.suppress(OSError):
                leaf.rmdir()
