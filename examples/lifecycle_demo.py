"""`make demo`: the sandbox lifecycle end to end through the public API, with the Python SDK.

Runs against whatever `space up` configured (SPACE_URL / SPACE_API_KEY or the config file it wrote).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from space import Space

T = TypeVar("T")


def step(label: str, work: Callable[[], T]) -> T:
    started = time.perf_counter()
    result = work()
    print(f"  {label:<52} {(time.perf_counter() - started) * 1000:8.1f} ms", flush=True)
    return result


def main() -> None:
    sp = Space()
    sb = step(
        "create a sandbox (python template)",
        lambda: sp.sandboxes.create(template="python", env={"WHO": "demo"}),
    )
    print(f"    -> {sb.id} is {sb.state}")
    r = step(
        "exec: python3 computes something", lambda: sb.exec(["python3", "-c", "print(sum(range(10**6)))"])
    )
    print(f"    -> exit {r.exit_code}, stdout {r.stdout.strip()!r}")
    r = step(
        "exec: a shell string sees the sandbox env", lambda: sb.exec('echo "hello from $WHO in $(uname -s)"')
    )
    print(f"    -> {r.stdout.strip()!r}")
    step("write /work/notes.txt", lambda: sb.files.write("/work/notes.txt", b"first line\n"))
    print(f"    -> {step('read it back', lambda: sb.files.read('/work/notes.txt'))!r}")
    step("pause", sb.pause)
    print(f"    -> {sb.state}")
    r = step("exec on the paused sandbox (resumes it)", lambda: sb.exec("cat /work/notes.txt"))
    print(f"    -> {r.stdout.strip()!r}, state now {sb.refresh().state}")
    snap = step("full checkpoint (processes + files)", lambda: sb.snapshots.create(full=True))
    print(f"    -> {snap.id}")
    sb.files.write("/work/notes.txt", b"an agent's bad edit\n")
    step("roll back to the checkpoint", lambda: sb.rollback(snap))
    print(f"    -> notes.txt is {sb.files.read('/work/notes.txt')!r} again")
    child = step("fork (a child continues from a checkpoint)", sb.fork)
    print(f"    -> child {child.id} reads {child.files.read('/work/notes.txt')!r}")
    step("stop (processes end, files stay)", sb.stop)
    step("start", sb.start)
    print(f"    -> notes.txt survived: {sb.files.read('/work/notes.txt')!r}")
    counter = "i=0; while true; do i=$((i+1)); echo $i > /work/count; sleep 0.1; done"
    sb.exec(f"nohup sh -c '{counter}' >/dev/null 2>&1 &")
    time.sleep(0.5)
    step("suspend (checkpoint uploaded to object storage)", sb.suspend)
    newest = sb.snapshots.list()[-1]
    print(f"    -> {sb.state}; snapshot {newest.id} is in {newest.locations}")
    step("restore (on any node, processes included)", sb.restore)
    before = int(sb.files.read("/work/count"))
    time.sleep(0.5)
    after = int(sb.files.read("/work/count"))
    print(f"    -> {sb.state}; the background counter continues: {before} -> {after}")
    print(f"  sandboxes now: {[s.id for s in sp.sandboxes.list()]}")
    step("delete the child", child.delete)
    step("delete the sandbox", sb.delete)


if __name__ == "__main__":
    main()
