"""What a sandbox must contain to use its node's egress gateway: the proxy environment, the node's CA in
its trust store, and DNS pointing at the gateway.

Invariants:
- The environment does not depend on the node (the same inner gateway address and fixed ports
  everywhere), so what is set at create stays right after a restore or fork on another node.
- The node's CA differs per node: the sandbox's bundle holds exactly one SPACE block (between the
  markers), the current node's; everything else in the bundle is kept.
- Files are written in an order that makes a check cheap: the CA file last, so this node's CA there
  means its block in the bundle is in place too.
- Chromium does not read the system bundle (it has its own root store), and it sends an encrypted
  ClientHello (ECH, at least as GREASE), which the gateway refuses since it would hide the server name: a
  sandbox with Chromium (/etc/chromium, the `browser` template) also gets a managed policy that trusts
  the node's CA and turns ECH off, written with the bundle and before the CA file (ADR 0066).
"""

from __future__ import annotations

import base64
import json
import os
import ssl

from space.core import errors
from space.node.agent.guest import GuestSession

#: In the sandbox: the system bundle (the node's CA appended between markers) and the CA alone.
CA_BUNDLE_PATH = "/etc/ssl/certs/ca-certificates.crt"
CA_FILE_PATH = "/usr/local/share/ca-certificates/space-egress-ca.crt"
RESOLV_CONF_PATH = "/etc/resolv.conf"
#: Chromium's configuration directory (its package's) and the managed policy SPACE writes beside it.
CHROMIUM_DIR = "/etc/chromium"
CHROMIUM_POLICY_PATH = f"{CHROMIUM_DIR}/policies/managed/space-egress.json"
CA_BEGIN = b"# BEGIN SPACE node egress CA (rewritten by the node on every start and restore)\n"
CA_END = b"# END SPACE node egress CA\n"


def sandbox_env(proxy_url: str) -> dict[str, str]:
    """Environment every sandbox of a node gets (the same on every node with the default ports)."""
    return {
        "HTTP_PROXY": proxy_url, "HTTPS_PROXY": proxy_url, "http_proxy": proxy_url, "https_proxy": proxy_url,
        "NO_PROXY": "", "no_proxy": "",
        "SSL_CERT_FILE": CA_BUNDLE_PATH, "REQUESTS_CA_BUNDLE": CA_BUNDLE_PATH,
        "CURL_CA_BUNDLE": CA_BUNDLE_PATH, "NODE_EXTRA_CA_CERTS": CA_FILE_PATH,
    }  # fmt: skip


async def install_files(session: GuestSession, ca: bytes, nameserver: str) -> None:
    """The node's CA `ca` into the sandbox's trust store (replacing another node's), DNS to `nameserver`."""
    try:
        installed = await session.read_file(CA_FILE_PATH)
    except errors.SpaceError:
        installed = b""
    # Fast path (a restart or restore on the node that wrote them): both files are written together,
    # the CA file last, so this node's CA there means its block in the bundle is in place too.
    if installed != ca:
        try:
            current = await session.read_file(CA_BUNDLE_PATH)
        except errors.SpaceError:
            current = b""
        wanted = with_node_ca(current, ca)
        if wanted != current:
            await session.write_file(CA_BUNDLE_PATH, wanted, mode=0o644)
        if await _has_chromium(session):
            await session.mkdir(os.path.dirname(CHROMIUM_POLICY_PATH), parents=True)
            await session.write_file(CHROMIUM_POLICY_PATH, chromium_egress_policy(ca), mode=0o644)
        await session.mkdir(os.path.dirname(CA_FILE_PATH), parents=True)
        await session.write_file(CA_FILE_PATH, ca, mode=0o644)
    await session.write_file(RESOLV_CONF_PATH, f"nameserver {nameserver}\n".encode(), mode=0o644)


async def _has_chromium(session: GuestSession) -> bool:
    try:
        await session.stat(CHROMIUM_DIR)
    except errors.SpaceError:
        return False
    return True


def chromium_egress_policy(ca_pem: bytes) -> bytes:
    """Chromium's managed policy for the gateway: trust the node's CA (`CACertificates`, base64 DER; Chromium
    reads its own root store, not the system bundle, so every connection the gateway intercepts, a bound
    credential's host, would fail), and no encrypted ClientHello (Chromium sends ECH GREASE by default,
    which the gateway cannot tell from real ECH and refuses: every HTTPS connection would fail)."""
    der = ssl.PEM_cert_to_DER_cert(ca_pem.decode("ascii"))
    policy = {"CACertificates": [base64.b64encode(der).decode("ascii")], "EncryptedClientHelloEnabled": False}
    return json.dumps(policy).encode() + b"\n"


def with_node_ca(bundle: bytes, ca_pem: bytes) -> bytes:
    """`bundle` with exactly one SPACE block, holding `ca_pem` (a previous node's block is dropped)."""
    kept = bundle
    while CA_BEGIN in kept:
        head, _, rest = kept.partition(CA_BEGIN)
        _, found, tail = rest.partition(CA_END)
        kept = head + (tail if found else b"")
    if kept and not kept.endswith(b"\n"):
        kept += b"\n"
    return kept + CA_BEGIN + ca_pem.rstrip(b"\n") + b"\n" + CA_END
