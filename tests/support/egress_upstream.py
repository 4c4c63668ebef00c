"""A test upstream for the egress gateway: HTTP on --http-port and HTTPS on --https-port (certificate from a
test CA), run inside its own network namespace by tests/support/egress_net.py.

Endpoints: /echo (JSON of method, path, headers: reflects whatever it received, credentials included),
/redirect?to=URL (302 to URL, and the Authorization it received echoed in a response header),
/bytes?n=N (N bytes), /login (a sign-in page: a form POSTed to /session, or to ?action=URL, with inputs named
`user` and `pass`, or ?user=NAME&pass=NAME), /session (200 "Signed in" when the submitted form's values hold
one of the --accounts file's [username, password] pairs, else 401), anything else: 200 "ok". Every
request is appended to --log as one JSON line.
"""

from __future__ import annotations

import argparse
import html
import json
import secrets
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

CHUNK = b"x" * (1 << 20)


def login_page(query: dict[str, list[str]]) -> bytes:
    def attribute(key: str, default: str) -> str:
        return html.escape(query.get(key, [default])[0], quote=True)

    return (
        "<!doctype html><title>Sign in</title><h1>Sign in</h1>"
        f'<form method="post" action="{attribute("action", "/session")}">'
        f'<input name="{attribute("user", "user")}" autocomplete="username">'
        f'<input type="password" name="{attribute("pass", "pass")}" autocomplete="current-password">'
        "<button>Sign in</button></form>"
    ).encode()


def signed_in(body: str, accounts_path: str | None) -> bool:
    """Whether the submitted form's values hold one of the accounts' (username, password) pairs."""
    if not accounts_path:
        return False
    with open(accounts_path) as handle:
        accounts = json.load(handle)
    values = {value for values in parse_qs(body, keep_blank_values=True).values() for value in values}
    return any(user in values and password in values for user, password in accounts)


def make_handler(
    name: str, log_path: str, lock: threading.Lock, accounts: str | None = None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _record(self) -> dict[str, object]:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            entry = {
                "server": name,
                "tls": isinstance(self.connection, ssl.SSLSocket),
                "method": self.command,
                "path": self.path,
                "headers": [[k, v] for k, v in self.headers.items()],
                "body": body.decode("latin-1"),
            }
            with lock, open(log_path, "a") as handle:
                handle.write(json.dumps(entry) + "\n")
            return entry

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _handle(self) -> None:
            entry = self._record()
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            if url.path == "/echo":
                self._send(200, json.dumps(entry).encode(), {"content-type": "application/json"})
            elif url.path == "/redirect":
                self._send(
                    302,
                    b"moved",
                    {
                        "location": query.get("to", ["/"])[0],
                        "x-echo-auth": self.headers.get("authorization", ""),
                    },
                )
            elif url.path == "/reflect-redirect":
                self._send(302, b"moved", {"location": "http://evil.test/?got=" + self.path})
            elif url.path == "/login":
                self._send(200, login_page(query), {"content-type": "text/html; charset=utf-8"})
            elif url.path == "/session" and self.command == "POST":
                if signed_in(str(entry["body"]), accounts):
                    page = b"<!doctype html><title>Signed in</title><h1>Welcome back</h1>"
                    cookie = f"session={secrets.token_hex(16)}; Secure; HttpOnly; Path=/"
                    self._send(200, page, {"content-type": "text/html", "set-cookie": cookie})
                else:
                    page = b"<!doctype html><title>Sign-in failed</title><h1>Wrong username or password</h1>"
                    self._send(401, page, {"content-type": "text/html"})
            elif url.path == "/bytes":
                total = int(query.get("n", ["0"])[0])
                self.send_response(200)
                self.send_header("content-length", str(total))
                self.end_headers()
                left = total
                while left > 0:
                    piece = CHUNK[: min(left, len(CHUNK))]
                    self.wfile.write(piece)
                    left -= len(piece)
            else:
                self._send(200, f"ok {name}\n".encode())

        do_GET = do_POST = do_PUT = do_HEAD = _handle

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--bind", default="0.0.0.0")
    parser.add_argument("--http-port", type=int, default=80)
    parser.add_argument("--https-port", type=int, default=443)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--accounts", default=None, help="JSON [[username, password], ...] for /session")
    args = parser.parse_args()
    lock = threading.Lock()
    handler = make_handler(args.name, args.log, lock, args.accounts)
    plain = ThreadingHTTPServer((args.bind, args.http_port), handler)
    secure = ThreadingHTTPServer((args.bind, args.https_port), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.cert)
    secure.socket = context.wrap_socket(secure.socket, server_side=True)
    for server in (plain, secure):
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
