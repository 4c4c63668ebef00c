"""Print the Debian archive mirror this machine's apt sources already use (never a hard-coded host)."""

from __future__ import annotations

import pathlib
import re
import sys


def find_mirror() -> str:
    candidates: list[str] = []
    sources_dir = pathlib.Path("/etc/apt/sources.list.d")
    for path in sorted(sources_dir.glob("*.sources")):
        text = path.read_text()
        for stanza in re.split(r"\n\s*\n", text):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
            if uris and suites and "security" not in suites.group(1):
                candidates.append(uris.group(1))
    legacy = pathlib.Path("/etc/apt/sources.list")
    paths = [legacy, *sorted(sources_dir.glob("*.list"))]
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            match = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line.strip())
            if match and "security" not in match.group(2):
                candidates.append(match.group(1))
    for uri in candidates:
        if "debian" in uri and "security" not in uri:
            return uri.rstrip("/")
    raise SystemExit("no Debian mirror found in the apt sources")


if __name__ == "__main__":
    sys.stdout.write(find_mirror() + "\n")
