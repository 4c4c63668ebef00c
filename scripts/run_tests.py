"""Runs the whole test suite as two pytest sessions side by side: the tests that need root (real runsc,
btrfs, network namespaces; serial, in one session, as they share the host's node) and every other test.

Why two sessions: the tests without root spend most of their time waiting (fake-driver clusters, HTTP
round trips, crash-and-restart loops), about 9 minutes of wall time for 5 of CPU on two cores, and they
touch nothing of the host that the root tests check (each root session's leak check covers only its own
data directories). Run one after the other, the suite took over 30 minutes; side by side, about the time
of the root session alone.

The root session streams to stdout; the other one is written to a file and printed whole when both have
ended. Last come the failures of both and one summary line per session, so the end of the output says
what failed. The exit status is the first non-zero one (root first)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

# pytest's per-test failure lines and its final "N passed, ... in S" line.
VERDICT_PREFIXES = (b"FAILED ", b"ERROR ", b"XPASS ")
# Each session picks its test services' loopback ports in its own part of the range below the kernel's
# ephemeral ports (tests/support/cluster.py free_port): a port one session freed to restart a service on is
# never taken by the other.
ROOT_PORTS, UNIT_PORTS = "10000-21000", "21000-32000"
SUMMARY = re.compile(rb"^=* ?\d+ (passed|failed|error|errors|skipped|deselected)\b.* in \d+(\.\d+)?s")


def is_verdict(line: bytes) -> bool:
    return line.startswith(VERDICT_PREFIXES) or SUMMARY.match(line) is not None


def main(extra: list[str]) -> int:
    base = [sys.executable, "-m", "pytest", "tests", "-q", *extra]
    verdicts: list[bytes] = []
    with tempfile.TemporaryFile("w+b", prefix="space-unit-tests-") as unit_log:
        started = time.monotonic()
        unit = subprocess.Popen(
            [*base, "-m", "not root", "-p", "no:cacheprovider", "--durations=15"],
            stdout=unit_log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SPACE_TEST_PORTS": UNIT_PORTS},
        )
        try:
            # Unbuffered: through a pipe, its progress would come in 8 KiB blocks, minutes late.
            root = subprocess.Popen(
                [*base, "-m", "root", "--durations=40"],
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "SPACE_TEST_PORTS": ROOT_PORTS},
            )
            assert root.stdout is not None
            for line in root.stdout:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                if is_verdict(line):
                    verdicts.append(b"root: " + line)
            root_status = root.wait()
        except BaseException:
            unit.kill()
            raise
        unit_status = unit.wait()
        elapsed = time.monotonic() - started
        unit_log.seek(0)
        print(f"\n===== the session without root (ran beside the root session), exit {unit_status} =====")
        sys.stdout.flush()
        for line in unit_log:
            sys.stdout.buffer.write(line)
            if is_verdict(line):
                verdicts.append(b"unit: " + line)
    print(f"\n===== both sessions, {elapsed:.0f} s =====")
    sys.stdout.flush()
    sys.stdout.buffer.write(b"".join(verdicts))
    sys.stdout.flush()
    print(f"root session exit {root_status}; session without root exit {unit_status}")
    return root_status or unit_status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
