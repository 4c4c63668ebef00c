"""The web console: static files served by the control plane at `/console/` (docs/adr/0061-web-console.md).

Invariants:
- Only the files shipped in this package's `static/` directory are served, looked up by their exact
  relative path in a table made once at start-up: no path from a request ever reaches the filesystem, so
  `..`, encoded dots, absolute paths and directories are all simply unknown (404); there is no listing.
- The pages are public (they hold no data): every piece of data comes from the authenticated `/v1` API,
  called by the browser with the key in a header (never in a URL), so the key's role is enforced by the API.
- Every answer under `/console` carries a strict Content-Security-Policy (scripts only from this origin:
  no inline script, no eval; connections only to this origin; no framing) and headers that forbid
  framing, sniffing and referrers.
"""

from __future__ import annotations

import mimetypes
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response

PREFIX = "/console"

#: Styles may be inline because xterm.js sizes its terminal with <style> elements it makes at run time;
#: scripts may not (CSS cannot run code; docs/adr/0061-web-console.md).
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "font-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    # Revalidated on every load, so a new control plane's console is used at once.
    "Cache-Control": "no-cache",
}
_TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    media_type: str


def load_files() -> dict[str, StaticFile]:
    """Every file under static/, by its relative path with '/' separators (read once)."""
    found: dict[str, StaticFile] = {}
    root = resources.files(__name__).joinpath("static")

    def walk(node: resources.abc.Traversable, prefix: str) -> None:
        for child in node.iterdir():
            name = f"{prefix}{child.name}"
            if child.is_dir():
                walk(child, name + "/")
            elif child.is_file():
                suffix = "." + child.name.rsplit(".", 1)[-1] if "." in child.name else ""
                media = _TYPES.get(suffix) or mimetypes.guess_type(child.name)[0] or "text/plain"
                found[name] = StaticFile(child.read_bytes(), media)

    walk(root, "")
    return found


def mount(app: FastAPI) -> None:
    """Serve the console's files under /console/ (not in the OpenAPI document)."""
    files = load_files()

    async def index(request: Request) -> Response:
        return RedirectResponse(PREFIX + "/", status_code=308, headers=SECURITY_HEADERS)

    async def static(request: Request) -> Response:
        name = request.path_params["path"] or "index.html"
        found = files.get(name)
        if found is None:
            return Response("not found\n", status_code=404, media_type="text/plain", headers=SECURITY_HEADERS)
        media = found.media_type + ("; charset=utf-8" if found.media_type.startswith("text/") else "")
        return Response(found.body, media_type=media, headers=SECURITY_HEADERS)

    app.add_api_route(PREFIX, index, methods=["GET"], include_in_schema=False)
    app.add_api_route(PREFIX + "/{path:path}", static, methods=["GET", "HEAD"], include_in_schema=False)
