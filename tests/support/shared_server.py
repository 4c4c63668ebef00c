"""One test server per test process, shared by every module that binds its session fixture.

pytest gives each module that binds a session fixture (`postgres_url = tests.support.postgres.postgres_url`)
the same fixture object, but a fixture imported under two names is two fixtures: each would start its own
server. `SharedServer` counts the users instead: the first `acquire` starts the server, the last `release`
stops it, so binding a fixture in any number of modules costs one server.

Invariant: `stop` runs exactly once per `start`, after the last user has released the server, and never
while a user still holds it; a failing `start` leaves nothing shared (the next `acquire` tries again).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

ServerT = TypeVar("ServerT")


class SharedServer(Generic[ServerT]):
    def __init__(self, start: Callable[[], ServerT], stop: Callable[[ServerT], None]) -> None:
        self._start = start
        self._stop = stop
        self._lock = threading.Lock()
        self._server: ServerT | None = None
        self._users = 0

    def acquire(self) -> ServerT:
        with self._lock:
            if self._server is None:
                self._server = self._start()
            self._users += 1
            return self._server

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._server is not None:
                server, self._server = self._server, None
                self._stop(server)

    @contextlib.contextmanager
    def use(self) -> Iterator[ServerT]:
        server = self.acquire()
        try:
            yield server
        finally:
            self.release()
