"""Stage 4 of an HTTP exchange, scrub: no credential value goes back to the sandbox.

Invariants:
- A response from a host a credential of the sandbox is bound to is scrubbed of every spelling of every
  value the gateway injected on this client connection (and every form the bound credentials have): status
  line headers, informational responses and body; trailers are dropped. Masks have the value's length, so
  framing (Content-Length) stays right; body scrubbing is streaming (a value split across chunks is caught).
- Hop-by-hop headers of a response never reach the sandbox; a 101 (upgrade) is never forwarded.
- A response from a host no credential is bound to is passed through unchanged (nothing could be in it).
"""

from __future__ import annotations

from collections.abc import Callable

import h11

from space.node.egress.credentials import Scrubber
from space.node.egress.http.messages import HOP_BY_HOP, Header
from space.node.egress.http.substitute import Substituted


class ConnectionSecrets:
    """What was injected on one client connection so far: a later response on a kept-alive connection is
    scrubbed of earlier requests' values too (the upstream may echo them late)."""

    def __init__(self) -> None:
        self.forms: set[bytes] = set()

    def scrubber(self, substituted: Substituted) -> Scrubber:
        """The scrubber for the response to `substituted` (inactive when no credential is bound)."""
        if not substituted.bound:
            return Scrubber([])
        self.forms |= substituted.secret_forms
        return Scrubber(self.forms)


class ResponseScrubber:
    """Scrubs one response, event by event, as it streams from the upstream to the sandbox."""

    def __init__(self, scrubber: Scrubber, on_location: Callable[[bytes], None]) -> None:
        """`on_location` sees the (scrubbed) Location of every redirect, to audit it."""
        self.scrubber = scrubber
        self.on_location = on_location

    @property
    def active(self) -> bool:
        return self.scrubber.active

    def informational(self, event: h11.InformationalResponse) -> h11.InformationalResponse | None:
        """The 1xx to forward, or None (a 101: upgrades are not forwarded, Upgrade was dropped)."""
        if event.status_code == 101:
            return None
        headers = [(n, self.scrubber.scrub(bytes(v))) for n, v in event.headers if n not in HOP_BY_HOP]
        return h11.InformationalResponse(status_code=event.status_code, headers=headers)

    def head(self, response: h11.Response) -> h11.Response:
        headers: list[Header] = []
        for name, value in response.headers:
            if name in HOP_BY_HOP:
                continue
            clean = self.scrubber.scrub(bytes(value))
            if name == b"location" and 300 <= response.status_code < 400:
                self.on_location(clean)
            headers.append((name, clean))
        return h11.Response(status_code=response.status_code, headers=headers, reason=response.reason)

    def body(self, data: bytes) -> bytes:
        """Scrubbed body bytes ready to send (the end of a chunk may be held back until the next one)."""
        return self.scrubber.feed(data)

    def end(self) -> bytes:
        """Body bytes held back until the end of the response."""
        return self.scrubber.flush()
