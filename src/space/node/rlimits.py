"""Raise this process's open-file limit at start (node agent, root helper, control plane).

Each sandbox, stream, relayed connection and pooled node connection holds descriptors; the default soft
limit (1024 on Debian) runs out long before memory or CPU do. The soft limit is raised to the hard limit
(capped, so that code sizing tables by it stays sane); the hard limit itself is the administrator's
(systemd LimitNOFILE, limits.conf) and is never raised here.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

CAP = 1 << 20  # a hard limit of "unlimited" is not a table size anyone wants


def raise_fd_limit() -> int:
    """Set the soft RLIMIT_NOFILE to the hard limit (at most CAP); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = CAP if hard == resource.RLIM_INFINITY else min(hard, CAP)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft
