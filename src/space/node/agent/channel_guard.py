"""What bounds a hostile guest on the private channel: token-bucket budgets and a rate-limited log.

The guest is not trusted (see space.node.agent.channel), so everything it can make the agent do on its own
initiative (log a line, drop a malformed or unsolicited frame) is charged to a budget here.

Invariants:
- A budget is a token bucket: a short burst is fine (a torn frame after an agent restart), a sustained flood
  is not. A guest that spends one raises GuestViolation, and the channel closes with that reason.
- What the guest reports is logged at most LOG_BURST times at once and LOGS_PER_SECOND after that; nothing
  suppressed is lost from the count, which goes out with the next message that gets through (or `flush`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PROTOCOL_ERROR_BURST = 100
PROTOCOL_ERRORS_PER_SECOND = 10.0
STRAY_BYTES_BURST = 32 << 20
STRAY_BYTES_PER_SECOND = 8 << 20
LOG_BURST = 20
LOGS_PER_SECOND = 1.0


class GuestViolation(Exception):
    """The guest broke the protocol in a way a correct `spaced` never does: the channel is closed."""


class TokenBucket:
    """`capacity` tokens, refilled at `rate` per second; `take` says whether `amount` was available."""

    def __init__(self, capacity: float, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.rate = rate
        self._clock = clock
        self._tokens = capacity
        self._stamp = clock()

    def take(self, amount: float = 1.0) -> bool:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens >= amount:
            self._tokens -= amount
            return True
        return False


class RateLimitedLog:
    """Warnings about one sandbox, at most LOG_BURST at once and LOGS_PER_SECOND after that; the number
    suppressed is counted and logged with the next message that gets through (or on `flush`)."""

    def __init__(
        self,
        name: str,
        burst: float = LOG_BURST,
        rate: float = LOGS_PER_SECOND,
        *,
        logger: logging.Logger = log,
    ) -> None:
        self.name = name
        self._bucket = TokenBucket(burst, rate)
        self._log = logger
        self.suppressed = 0
        self.suppressed_total = 0
        self.logged = 0

    def warning(self, message: str, *args: object) -> None:
        if not self._bucket.take():
            self.suppressed += 1
            self.suppressed_total += 1
            return
        self.logged += 1
        if self.suppressed:
            self._log.warning(
                "sandbox %s: " + message + " (%d earlier messages suppressed by the rate limit)",
                self.name,
                *args,
                self.suppressed,
            )
            self.suppressed = 0
        else:
            self._log.warning("sandbox %s: " + message, self.name, *args)

    def flush(self) -> None:
        if self.suppressed:
            self._log.warning(
                "sandbox %s: %d channel messages suppressed by the rate limit", self.name, self.suppressed
            )
            self.logged += 1
            self.suppressed = 0
