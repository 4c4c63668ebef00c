"""The codecs of envd's RPCs: connectrpc's own (proto JSON, as E2B's SDK speaks, and binary), with a request
message that cannot be decoded answered as `invalid_argument` (connectrpc's default is `unknown`, a 500).

Invariants:
- Encoding is the library's, unchanged; only the failure of a decode is re-typed, with the library's reason
  cut to MAX_REASON characters (it may quote the client's bytes).
"""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError

MAX_REASON = 200


class CheckedCodec:
    """`inner`, with decode failures as INVALID_ARGUMENT."""

    def __init__(self, inner: Codec[Any, Any]) -> None:
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:  # the library's parsers raise several kinds for malformed input
            reason = str(exc)[:MAX_REASON]
            raise ConnectError(Code.INVALID_ARGUMENT, f"malformed request message: {reason}") from exc


def envd_codecs() -> list[Codec[Any, Any]]:
    return [CheckedCodec(proto_json_codec()), CheckedCodec(proto_binary_codec())]
