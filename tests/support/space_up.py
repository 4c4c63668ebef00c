"""`Cli`: the `space` command run as a subprocess with nothing SPACE_* exported (HOME is a private
directory, so the config file `space up` writes there is the only source); `logs()` gathers the tails of
the data directory's log files for failure messages; `supervisor_events` the supervisor's JSON lines in
space.log and `status_report` what `space status --json` says (ADR 0037)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest


@dataclass
class Cli:
    home: pathlib.Path
    data_dir: pathlib.Path

    def env(self) -> dict[str, str]:
        # Nothing SPACE_* exported: the config file is the only source.
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), "LANG": "C.UTF-8"}

    def run(
        self, *args: str, stdin: bytes | None = None, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        proc = subprocess.run(
            [sys.executable, "-m", "space.cli.main", *args], input=stdin, capture_output=True, env=self.env(),
            cwd=self.home, timeout=timeout, check=False,
        )  # fmt: skip
        if check and proc.returncode != 0:
            out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
            pytest.fail(
                f"space {' '.join(args)} exited {proc.returncode}\nstdout: {out}\nstderr: {err[-3000:]}\n"
                + self.logs()
            )
        return proc

    def json(self, *args: str) -> dict[str, object]:
        data = json.loads(self.run(*args).stdout)
        assert isinstance(data, dict), data
        return data

    def logs(self) -> str:
        parts = []
        for name in ("space.log", "controlplane.log", "agent.log", "helper.log"):
            path = self.data_dir / name
            if path.exists():
                parts.append(f"--- {name} ---\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)


def supervisor_events(data_dir: pathlib.Path) -> list[dict[str, object]]:
    """The supervisor's structured lines in DATA_DIR/space.log (other lines there are free text)."""
    events = []
    path = data_dir / "space.log"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and value.get("source") == "supervisor":
            events.append(value)
    return events


def status_report(cli: Cli) -> dict[str, object]:
    """`space status --json` (exit 0 while SPACE runs, 6 when it does not)."""
    proc = cli.run("status", "--data-dir", str(cli.data_dir), "--json", check=False)
    assert proc.returncode in (0, 6), proc.stderr.decode(errors="replace")
    report = json.loads(proc.stdout)
    assert isinstance(report, dict), report
    return report


def components(report: dict[str, object]) -> dict[str, dict[str, object]]:
    rows = report["components"]
    assert isinstance(rows, list), rows
    return {str(row["name"]): row for row in rows}
