"""`spaced`, the in-sandbox daemon: processes, files, readiness and activity over the private channel.

Invariants of the whole package:
- Standard library plus `space.protocol` only (checked by scripts/check_imports.py): it must run on any
  template that has a python3 (Debian 12's 3.11 at least).
- Nothing the workload or the host sends can kill the daemon: bad input becomes ERROR frames, handler
  failures become ERROR frames, and the daemon's own fds 0/1/2 never carry the channel.
- The daemon reads its environment variables in settings.py only (read once at start-up, documented there).
- Start-up imports only what the first answer needs (`space.guest.daemon` and the protocol); handlers pull
  in their heavier modules on first use, because import time is part of sandbox creation time.
"""
