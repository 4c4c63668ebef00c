"""`Cli`: the `space` command run as a subprocess with nothing SPACE_* exported (HOME is a private
directory, so the config file `space up` writes there is the only source); `logs()` gathers the tails of
the data directory's log files for failure messages."""

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
