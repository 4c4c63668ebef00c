"""A test upstream for the egress gateway: HTTP on --http-port and HTTPS on --https-port (certificate from a
test CA), run inside its own network namespace by tests/support/egress_net.py.

Endpoints: /echo (JSON of method, path, headers: reflects whatever it received, credentials included),
/redirect?to=URL (302 to URL, and the Authorization it received echoed in a response header),
/bytes?n=N (N bytes), anything else: 200 "ok". Every request is appended to --log as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

CHUNK = b"x" * (1 << 20)


def make_handler(name: str, log_path: str, lock: threading.Lock) -> type[BaseHTTPRequestHandler]:
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
    args = parser.parse_args()
    lock = threading.Lock()
    handler = make_handler(args.name, args.log, lock)
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
