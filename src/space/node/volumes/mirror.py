"""Find the Debian archive mirror this machine's apt sources already use.

Invariants:
- No host name is ever written in SPACE's code: the mirror comes from the machine's own apt configuration
  (deb822 `*.sources` files first, then one-line `sources.list` entries), so the only network traffic a
  template build causes goes where apt on this machine already goes.
- Security suites are skipped (debootstrap needs the main archive); non-Debian repositories are skipped.
"""

from __future__ import annotations

import pathlib
import re

from space.core.errors import NotFound

APT_DIR = pathlib.Path("/etc/apt")


def _deb822_candidates(sources_dir: pathlib.Path) -> list[str]:
    found: list[str] = []
    for path in sorted(sources_dir.glob("*.sources")):
        try:
            text = path.read_text()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):
            types = re.search(r"^Types:\s*(.+)$", stanza, re.M)
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
            if types and "deb" not in types.group(1).split():
                continue
            if re.search(r"^Enabled:\s*no", stanza, re.M | re.I):
                continue
            if uris and suites and "security" not in suites.group(1):
                found.append(uris.group(1))
    return found


def _legacy_candidates(apt_dir: pathlib.Path) -> list[str]:
    found: list[str] = []
    for path in [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list"))]:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            match = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line.strip())
            if match and "security" not in match.group(2):
                found.append(match.group(1))
    return found


def find_mirror(apt_dir: pathlib.Path = APT_DIR) -> str:
    """The URI of the Debian archive in the apt sources, without a trailing slash."""
    candidates = _deb822_candidates(apt_dir / "sources.list.d") + _legacy_candidates(apt_dir)
    for uri in candidates:
        # "debian" in the path/host tells a Debian archive from third-party repositories (cloud SDKs, node).
        if "debian" in uri and "security" not in uri and uri.startswith(("http://", "https://", "file:")):
            return uri.rstrip("/")
    raise NotFound("no Debian mirror found in the apt sources", apt_dir=str(apt_dir))
