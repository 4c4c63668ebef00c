"""ClientHello parsing and the node CA (no sockets: TLS runs over memory BIOs)."""

from __future__ import annotations

import asyncio
import ssl
import stat
from pathlib import Path

import pytest

from space.node.egress.tls import CertificateAuthority, NotTls, read_client_hello
from tests.support.egress_net import client_hello, split_records, with_extension


def parse(data: bytes) -> object:
    async def run() -> object:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_client_hello(reader)

    return asyncio.run(run())


def test_sni_from_a_real_client_hello() -> None:
    raw = client_hello("api.example.com")
    hello = parse(raw)
    assert hello.server_name == "api.example.com"  # type: ignore[attr-defined]
    assert hello.has_ech is False  # type: ignore[attr-defined]
    assert hello.raw == raw  # type: ignore[attr-defined]


def test_client_hello_over_two_records() -> None:
    raw = split_records(client_hello("api.example.com"), 40)
    hello = parse(raw)
    assert hello.server_name == "api.example.com"  # type: ignore[attr-defined]
    assert hello.raw == raw  # type: ignore[attr-defined]


def test_ech_is_detected() -> None:
    hello = parse(with_extension(client_hello("public.example"), 0xFE0D, b"\x00" * 8))
    assert hello.has_ech is True  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03",  # truncated
        b"\x17\x03\x03\x00\x05hello",  # application data, not a handshake
        b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",  # a ServerHello
        b"",
    ],
)
def test_not_tls(data: bytes) -> None:
    with pytest.raises(NotTls):
        parse(data)


def test_truncated_hello_is_refused() -> None:
    raw = client_hello("api.example.com")
    with pytest.raises(NotTls):
        parse(raw[:-10])


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> None:
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        done = 0
        for side in (c, s):
            try:
                side.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done == 2:
            return
    raise AssertionError("handshake did not finish")


def test_ca_created_once_private_and_leaves_verify(tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    ca = CertificateAuthority(ca_dir)
    assert stat.S_IMODE((ca_dir / "ca.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE(ca_dir.stat().st_mode) == 0o700
    again = CertificateAuthority(ca_dir)
    assert again.certificate_pem == ca.certificate_pem
    trust = ssl.create_default_context(cadata=ca.certificate_pem.decode())
    _handshake(ca.server_context("api.example.com"), trust, "api.example.com")
    assert ca.cached_context("api.example.com") is ca.server_context("api.example.com")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(ca.server_context("api.example.com"), trust, "other.example.com")
    stranger = ssl.create_default_context()  # the system store does not know the node CA
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(ca.server_context("api.example.com"), stranger, "api.example.com")
