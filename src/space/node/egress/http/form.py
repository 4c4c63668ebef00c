"""Login-form bodies: finding a `login` credential's placeholders in the fields of a form submission and
writing the real values in their place (ADR 0063). Pure functions on bytes (no I/O).

Invariants:
- Only `application/x-www-form-urlencoded` and `multipart/form-data` bodies are looked at; anything else is
  returned unchanged.
- A value is written only into a field whose (decoded) name is one of the wanted names AND whose whole
  (decoded) value is exactly that field's placeholder; a placeholder anywhere else (another field, part of a
  value, a file part, a header of a part) is left as it is and reported as misplaced.
- Everything but the replaced values is kept byte for byte (field order, the spelling of other fields,
  part headers), and a replaced value is re-encoded for its container: `quote_plus` in a urlencoded body,
  raw UTF-8 in a multipart part (refused if the value would contain the boundary, so framing never breaks).
- The caller bounds the body's size (MAX_FORM_BODY) before calling; this module never sees an unbounded
  body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import quote_plus, unquote_to_bytes

MAX_FORM_BODY: Final = 64 * 1024  # a login form is small; a bigger body streams through untouched

URLENCODED: Final = b"application/x-www-form-urlencoded"
MULTIPART: Final = b"multipart/form-data"


@dataclass
class FormResult:
    body: bytes
    replaced: set[str] = field(default_factory=set)  # field names written with a real value
    misplaced: bool = False  # a placeholder was seen outside the wanted fields


def form_type(content_type: bytes | None) -> tuple[bytes, bytes | None] | None:
    """(media type, multipart boundary) for a form body's Content-Type; None for anything else."""
    if not content_type:
        return None
    media, *params = [p.strip() for p in content_type.split(b";")]
    media = media.lower()
    if media == URLENCODED:
        return media, None
    if media != MULTIPART:
        return None
    for param in params:
        key, _, value = param.partition(b"=")
        if key.strip().lower() == b"boundary":
            boundary = value.strip().strip(b'"')
            if 1 <= len(boundary) <= 70:
                return media, boundary
    return None


def _form_unquote(raw: bytes) -> bytes:
    return unquote_to_bytes(raw.replace(b"+", b" "))


def substitute_form(
    body: bytes, content_type: bytes | None, wanted: Mapping[str, tuple[str, str]]
) -> FormResult:
    """`wanted`: field name -> (placeholder, value). The body with each wanted field whose value is its
    placeholder given the value instead (module invariants)."""
    kind = form_type(content_type)
    if kind is None:
        return FormResult(body, misplaced=_any_placeholder(body, wanted))
    media, boundary = kind
    if media == URLENCODED:
        return _urlencoded(body, wanted)
    assert boundary is not None
    return _multipart(body, boundary, wanted)


def _any_placeholder(data: bytes, wanted: Mapping[str, tuple[str, str]]) -> bool:
    if not data:
        return False
    decoded = _form_unquote(data)
    return any(p.encode() in data or p.encode() in decoded for p, _v in wanted.values())


def _urlencoded(body: bytes, wanted: Mapping[str, tuple[str, str]]) -> FormResult:
    result = FormResult(body)
    pairs = body.split(b"&")
    out: list[bytes] = []
    for pair in pairs:
        raw_name, sep, raw_value = pair.partition(b"=")
        name = _form_unquote(raw_name).decode("utf-8", "replace")
        value = _form_unquote(raw_value)
        target = wanted.get(name)
        if sep and target is not None and value == target[0].encode():
            out.append(raw_name + b"=" + quote_plus(target[1]).encode())
            result.replaced.add(name)
            continue
        if _any_placeholder(pair, wanted):
            result.misplaced = True
        out.append(pair)
    result.body = b"&".join(out)
    return result


def _part_name(head: bytes) -> tuple[str | None, bool]:
    """(the form-data field name, whether the part is a file) of a part's header block."""
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() != b"content-disposition":
            continue
        name: str | None = None
        is_file = False
        for param in value.split(b";")[1:]:
            pkey, _, pvalue = param.strip().partition(b"=")
            pkey = pkey.strip().lower()
            if pkey == b"name":
                name = pvalue.strip().strip(b'"').decode("utf-8", "replace")
            elif pkey in (b"filename", b"filename*"):
                is_file = True
        return name, is_file
    return None, False


def _multipart(body: bytes, boundary: bytes, wanted: Mapping[str, tuple[str, str]]) -> FormResult:
    result = FormResult(body)
    delimiter = b"--" + boundary
    pieces = body.split(delimiter)
    # pieces[0] is the preamble, the last starts with "--" (the close delimiter) and holds the epilogue
    out = [pieces[0]]
    for piece in pieces[1:]:
        if piece.startswith(b"--") or not piece.startswith(b"\r\n"):
            out.append(piece)
            if _any_placeholder(piece, wanted):
                result.misplaced = True
            continue
        head, sep, rest = piece[2:].partition(b"\r\n\r\n")
        content = rest[:-2] if rest.endswith(b"\r\n") else rest
        trailer = rest[len(content) :]
        name, is_file = _part_name(head)
        target = wanted.get(name) if name is not None and not is_file else None
        if sep and target is not None and content == target[0].encode():
            value = target[1].encode()
            if delimiter not in value and b"\r\n--" not in value:
                out.append(b"\r\n" + head + sep + value + trailer)
                result.replaced.add(name or "")
                continue
        if _any_placeholder(piece, wanted):
            result.misplaced = True
        out.append(piece)
    result.body = delimiter.join(out)
    return result
