"""Where a template build's packages come from, and what the build sandbox may therefore reach
(docs/adr/0054-template-build.md).

Invariants:
- No host name is written in SPACE's code: the Debian archive comes from this machine's apt sources
  (space.node.volumes.mirror, read by the helper: verb template.sources), the Python package index from
  pip's own configuration on this machine, or else pip's built-in default read from the pip library at
  run time.
- The build sandbox's egress policy allows exactly the hosts of those two URLs (`allow_hosts`), nothing
  else; a source that is not http(s) (a file:// index, say) is not reachable from a sandbox and is skipped.
- Reading the configuration happens when a build first needs it, not at agent start: a node that never
  builds never needs a mirror.
"""

from __future__ import annotations

import importlib
import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from space.core import errors
from space.core.settings import SandboxLimits

if TYPE_CHECKING:
    from space.node.agent.helper_client import HelperClient

log = logging.getLogger(__name__)

#: The build sandbox's resources: package installs need more memory and disk than a default sandbox.
BUILD_LIMITS = SandboxLimits(cpus=2.0, memory_mb=2048, pids=2048, disk_mb=16384)
#: A step (one apt install, one pip install, one command) that runs longer than this fails the build.
STEP_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class BuildSources:
    """The package sources of builds on this node and the build sandbox's limits."""

    apt_sources: str  # a sources.list, used by the build's apt-get only (the template's own stays as is)
    pip_index: str  # a PEP 503 simple index URL
    limits: SandboxLimits = BUILD_LIMITS
    step_timeout_s: float = STEP_TIMEOUT_S
    extra_hosts: tuple[str, ...] = field(default=())

    def allow_hosts(self) -> list[str]:
        """The hosts the build sandbox may reach: those of the apt sources and of the package index."""
        hosts: list[str] = []
        urls = [words[1] for words in _deb_lines(self.apt_sources)] + [self.pip_index]
        for url in urls:
            host = host_of(url)
            if host is not None and host not in hosts:
                hosts.append(host)
        return hosts + [h for h in self.extra_hosts if h not in hosts]

    def pip_trusted_host(self) -> str | None:
        """pip refuses a plain-http index unless told to trust its host; an https index needs nothing."""
        parts = urllib.parse.urlsplit(self.pip_index)
        return parts.hostname if parts.scheme == "http" else None


def _deb_lines(sources: str) -> list[list[str]]:
    out = []
    for line in sources.splitlines():
        words = [w for w in line.split() if not (w.startswith("[") or w.endswith("]"))]
        if len(words) >= 3 and words[0] == "deb":
            out.append(words)
    return out


def host_of(url: str) -> str | None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        return None
    return parts.hostname


def _pip_configured_index() -> str | None:
    """`index-url` from pip's configuration files and environment on this machine, if set."""
    try:
        configuration: Any = importlib.import_module("pip._internal.configuration")
        config = configuration.Configuration(isolated=False)
        config.load()
        for key in ("global.index-url", ":env:.index-url", "install.index-url"):
            try:
                value = config.get_value(key)
            except configuration.ConfigurationError:
                continue
            if isinstance(value, str) and host_of(value) is not None:
                return value
    except (ImportError, AttributeError, OSError) as exc:
        log.warning("pip's configuration could not be read: %s", exc)
    return None


def _pip_default_index() -> str:
    """pip's own default index, read from the pip library (so it is never written here)."""
    try:
        index: Any = importlib.import_module("pip._internal.models.index")
        return str(index.PyPI.simple_url)
    except (ImportError, AttributeError) as exc:
        raise errors.Unavailable("no Python package index configured and pip is not installed") from exc


async def machine_sources(helper: HelperClient) -> BuildSources:
    """The sources this machine's apt and pip use: the Debian archive and suite as the helper reads them
    from the apt sources (the agent reads no system configuration of its own), pip's index from here."""
    archive = await helper.call("template.sources")
    return BuildSources(
        apt_sources=f"deb {archive['mirror']} {archive['suite']} main\n",
        pip_index=_pip_configured_index() or _pip_default_index(),
    )
