"""What a sandbox's egress tests run inside it and how they read the answers: urllib requests (through the
proxy from the environment unless "direct") and name lookups, each as one JSON line; shared by the gVisor
and microVM egress e2e tests."""

from __future__ import annotations

import json
from typing import Any

from space.node.agent.agent import SandboxHandle

METADATA = "169.254.169.254"

# Runs inside the sandbox: each request with urllib (proxy from the environment unless "direct"), results as
# one JSON line. Header values may name environment variables as {NAME} (the placeholder lives there).
FETCH = r"""
import json, os, sys, urllib.error, urllib.request
out = []
for r in json.loads(sys.argv[1]):
    opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if r.get("direct") else []))
    headers = {k: v.format(**os.environ) for k, v in r.get("headers", {}).items()}
    try:
        with opener.open(urllib.request.Request(r["url"], headers=headers), timeout=8) as resp:
            out.append({"status": resp.status, "body": resp.read().decode("latin-1"),
                        "headers": [[k, v] for k, v in resp.getheaders()]})
    except urllib.error.HTTPError as e:
        out.append({"status": e.code, "body": e.read().decode("latin-1"),
                    "headers": [[k, v] for k, v in e.headers.items()]})
    except Exception as e:
        out.append({"error": type(e).__name__ + ": " + str(e)})
print(json.dumps(out))
"""

RESOLVE = r"""
import json, socket, sys
out = {}
for name in json.loads(sys.argv[1]):
    try:
        out[name] = sorted({a[4][0] for a in socket.getaddrinfo(name, 443, socket.AF_INET)})
    except OSError as e:
        out[name] = "error: " + str(e)
print(json.dumps(out))
"""


async def fetch(handle: SandboxHandle, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = await handle.session.exec(["python3", "-c", FETCH, json.dumps(requests)], timeout=120)
    assert r.exit_code == 0, r.stderr
    results: list[dict[str, Any]] = json.loads(r.stdout)
    return results


async def resolve(handle: SandboxHandle, names: list[str]) -> dict[str, Any]:
    r = await handle.session.exec(["python3", "-c", RESOLVE, json.dumps(names)], timeout=60)
    assert r.exit_code == 0, r.stderr
    result: dict[str, Any] = json.loads(r.stdout)
    return result


def refused(result: dict[str, Any]) -> bool:
    """The request got nowhere: an error before any response, or the gateway's 403."""
    return "error" in result or result.get("status") == 403


def echo(result: dict[str, Any]) -> dict[str, Any]:
    assert result.get("status") == 200, result
    body: dict[str, Any] = json.loads(result["body"])
    return body
