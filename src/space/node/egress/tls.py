"""The node's TLS interception authority and the TLS plumbing of the gateway.

Invariants:
- One CA per node, created once (EC P-256) and kept in `ca_dir` (directory 0700, key file 0600); a second
  start, or a racing one, loads the same CA (the key+certificate file is published with an atomic link).
- Leaf certificates are minted per host (DNS or IP SAN), signed by that CA, valid for a short time, cached in
  memory together with their server SSLContext; they are only ever presented to sandboxes, and only for
  hosts a credential is bound to (the gateway splices all other TLS untouched).
- Upstream TLS is always verified (certificate chain + host name) against the configured trust store.
- ClientHello parsing reads only what it needs (SNI, presence of ECH) and refuses malformed records.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import ssl
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from space.core import errors

CA_FILE = "ca.pem"  # private key + certificate (0600)
CA_CERT_FILE = "ca.crt"  # certificate only, for installing into sandboxes
LEAF_DAYS = 7
CA_YEARS = 10
MAX_LEAVES = 1024


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class CertificateAuthority:
    def __init__(self, ca_dir: Path) -> None:
        self.ca_dir = ca_dir
        self._key, self._cert = self._load_or_create()
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaf_key_pem = self._leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def certificate_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    @property
    def certificate(self) -> x509.Certificate:
        return self._cert

    def _load_or_create(self) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        self.ca_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.ca_dir, 0o700)
        path = self.ca_dir / CA_FILE
        if not path.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            name = x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "SPACE"),
                    x509.NameAttribute(NameOID.COMMON_NAME, f"SPACE egress CA {os.uname().nodename}"[:64]),
                ]
            )
            now = _now()
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(
                        digital_signature=True,
                        content_commitment=False,
                        key_encipherment=False,
                        data_encipherment=False,
                        key_agreement=False,
                        key_cert_sign=True,
                        crl_sign=True,
                        encipher_only=False,
                        decipher_only=False,
                    ),
                    critical=True,
                )
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256())
            )
            blob = key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ) + cert.public_bytes(serialization.Encoding.PEM)
            fd, tmp = tempfile.mkstemp(dir=self.ca_dir, prefix=".ca-")
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, blob)
                os.fsync(fd)
                os.close(fd)
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, path)  # fails if a concurrent start won: then load its CA
            finally:
                os.unlink(tmp)
        blob = path.read_bytes()
        try:
            loaded_key = serialization.load_pem_private_key(blob, password=None)
            loaded_cert = x509.load_pem_x509_certificate(blob)
        except ValueError as exc:
            raise errors.Internal(f"egress CA file {path} is corrupt") from exc
        if not isinstance(loaded_key, ec.EllipticCurvePrivateKey):
            raise errors.Internal(f"egress CA file {path} holds an unexpected key type")
        cert_path = self.ca_dir / CA_CERT_FILE
        cert_pem = loaded_cert.public_bytes(serialization.Encoding.PEM)
        if not cert_path.exists() or cert_path.read_bytes() != cert_pem:
            tmp_cert = cert_path.with_suffix(".tmp")
            tmp_cert.write_bytes(cert_pem)
            os.replace(tmp_cert, cert_path)
        return loaded_key, loaded_cert

    def leaf_pem(self, host: str) -> bytes:
        """A certificate chain (leaf + CA) for `host` (a normalized name or address)."""
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM) + self.certificate_pem

    def cached_context(self, host: str) -> ssl.SSLContext | None:
        with self._lock:
            context = self._contexts.get(host)
            if context is not None:
                self._contexts.move_to_end(host)
            return context

    def server_context(self, host: str) -> ssl.SSLContext:
        """The (cached) server-side context presenting a leaf for `host` to a sandbox."""
        with self._lock:
            context = self._contexts.get(host)
            if context is not None:
                self._contexts.move_to_end(host)
                return context
        chain = self.leaf_pem(host)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])
        # ssl can load a chain only from files: write it to a private temporary file and drop it at once.
        with tempfile.NamedTemporaryFile(dir=self.ca_dir, prefix=".leaf-", suffix=".pem") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(self._leaf_key_pem + chain)
            handle.flush()
            context.load_cert_chain(handle.name)
        with self._lock:
            self._contexts[host] = context
            while len(self._contexts) > MAX_LEAVES:
                self._contexts.popitem(last=False)
        return context


def upstream_context(trust_store: Path | None) -> ssl.SSLContext:
    """Client context for connections to upstreams: verified against `trust_store` (PEM file or directory)
    or the system store when None."""
    if trust_store is None:
        context = ssl.create_default_context()
    elif trust_store.is_dir():
        context = ssl.create_default_context(capath=str(trust_store))
    else:
        context = ssl.create_default_context(cafile=str(trust_store))
    context.set_alpn_protocols(["http/1.1"])
    return context


# ---------------------------------------------------------------------------------------------------------
# ClientHello


@dataclass(frozen=True)
class ClientHello:
    raw: bytes  # every byte read from the client so far (to be replayed upstream or into the TLS server)
    server_name: str | None
    has_ech: bool


HANDSHAKE = 22
MAX_HELLO = 64 * 1024


class NotTls(Exception):
    """The first bytes are not a TLS handshake."""


def _parse_hello_body(body: bytes) -> tuple[str | None, bool]:
    # body = ClientHello message without the 4-byte handshake header
    pos = 2 + 32  # legacy_version, random
    session_len = body[pos]
    pos += 1 + session_len
    suites_len = int.from_bytes(body[pos : pos + 2], "big")
    pos += 2 + suites_len
    comp_len = body[pos]
    pos += 1 + comp_len
    if pos == len(body):
        return None, False
    ext_total = int.from_bytes(body[pos : pos + 2], "big")
    pos += 2
    end = pos + ext_total
    if end > len(body):
        raise NotTls("truncated extensions")
    server_name: str | None = None
    has_ech = False
    while pos + 4 <= end:
        ext_type = int.from_bytes(body[pos : pos + 2], "big")
        ext_len = int.from_bytes(body[pos + 2 : pos + 4], "big")
        data = body[pos + 4 : pos + 4 + ext_len]
        if len(data) != ext_len:
            raise NotTls("truncated extension")
        pos += 4 + ext_len
        if ext_type == 0xFE0D:
            has_ech = True
        elif ext_type == 0 and ext_len >= 2:
            list_len = int.from_bytes(data[0:2], "big")
            entries = data[2 : 2 + list_len]
            epos = 0
            while epos + 3 <= len(entries):
                name_type = entries[epos]
                name_len = int.from_bytes(entries[epos + 1 : epos + 3], "big")
                name = entries[epos + 3 : epos + 3 + name_len]
                epos += 3 + name_len
                if name_type == 0:
                    if server_name is not None:
                        raise NotTls("two server names")
                    server_name = name.decode("latin-1")
    return server_name, has_ech


def _complete_hello(raw: bytearray) -> bytes | None:
    """The body of the ClientHello in the handshake records of `raw` once it is complete, None while more
    records are needed. Raises NotTls for anything that is not a ClientHello in handshake records."""
    pos = 0
    handshake = bytearray()
    while pos + 5 <= len(raw):
        if raw[pos] != HANDSHAKE or raw[pos + 1] != 3:
            raise NotTls("not a TLS handshake record")
        length = int.from_bytes(raw[pos + 3 : pos + 5], "big")
        if pos + 5 + length > len(raw):
            return None
        handshake += raw[pos + 5 : pos + 5 + length]
        pos += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 1:
                raise NotTls("first handshake message is not a ClientHello")
            need = int.from_bytes(handshake[1:4], "big")
            if len(handshake) >= 4 + need:
                return bytes(handshake[4 : 4 + need])
    return None


async def read_client_hello(reader: asyncio.StreamReader, first: bytes = b"") -> ClientHello:
    """Read the whole ClientHello (it may span several records) without answering anything."""
    raw = bytearray(first)
    while True:
        while len(raw) < 5:
            chunk = await reader.read(MAX_HELLO)
            if not chunk:
                raise NotTls("connection closed before a ClientHello")
            raw += chunk
        body = _complete_hello(raw)
        if body is not None:
            try:
                name, ech = _parse_hello_body(body)
            except IndexError as exc:
                raise NotTls("truncated ClientHello") from exc
            return ClientHello(bytes(raw), name, ech)
        if len(raw) > MAX_HELLO:
            raise NotTls("ClientHello too large")
        chunk = await reader.read(MAX_HELLO)
        if not chunk:
            raise NotTls("connection closed inside a ClientHello")
        raw += chunk


# ---------------------------------------------------------------------------------------------------------
# Byte streams: plain asyncio streams, and TLS terminated in memory (so bytes already read while peeking
# the ClientHello can be fed to the TLS server).


class PlainStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def read(self, size: int = 65536) -> bytes:
        return await self.reader.read(size)

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


class TlsServerStream:
    """Server side of TLS over an existing stream, with the bytes already read replayed first."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        context: ssl.SSLContext,
        initial: bytes,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._incoming.write(initial)
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)

    async def _flush(self) -> None:
        pending = self._outgoing.read()
        if pending:
            self.writer.write(pending)
            await self.writer.drain()

    async def _fill(self) -> bool:
        data = await self.reader.read(65536)
        if not data:
            self._incoming.write_eof()
            return False
        self._incoming.write(data)
        return True

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionError("client closed during the TLS handshake") from None
        await self._flush()

    async def read(self, size: int = 65536) -> bytes:
        while True:
            try:
                return self._tls.read(size)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    try:
                        return self._tls.read(size)
                    except (ssl.SSLError, ssl.SSLZeroReturnError):
                        return b""
            except ssl.SSLZeroReturnError:
                return b""

    async def write(self, data: bytes) -> None:
        self._tls.write(data)
        await self._flush()

    def close(self) -> None:
        with contextlib.suppress(ssl.SSLError):
            self._tls.unwrap()
        pending = self._outgoing.read()
        if pending and not self.writer.is_closing():
            self.writer.write(pending)
        self.writer.close()
