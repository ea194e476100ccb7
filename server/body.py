"""Request bodies off the wire: size cap, Content-Encoding (zstd, gzip), UTF-8 JSON, and values Python can render.

Every failure is a client error with a JSON body: 413 over a size cap (compressed or decompressed), 415 for an
encoding we do not read, 422 (FastAPI's shape) for bytes that are not a JSON document we can answer.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import zstandard

from ..models.errors import DecisionError, SchemaError, SchemaIssue, TooLarge, UnsupportedEncoding

ENCODINGS = ("identity", "gzip", "x-gzip", "zstd")
MAX_DEPTH = 256  # JSON nesting levels; deeper documents are refused before Python's recursion limits bite


class NotJson(DecisionError):
    """A body whose Content-Type is not JSON (FastAPI's own 400)."""


class BodyTooLarge(TooLarge):
    def __init__(self, limit: int, what: str = "request body"):
        super().__init__(f"{what} is larger than this server's limit of {limit} bytes (--max-body-bytes)")


class BodyTimeout(DecisionError):
    """The client did not send its body within the request's deadline (408)."""


class BodyEncoding(UnsupportedEncoding):
    def __init__(self, encoding: str):
        super().__init__(f"Content-Encoding {encoding!r} is not supported; use one of zstd, gzip, identity")


class Charge(Protocol):
    """What a body's memory charge offers its reader (server/body_memory.py, BodyCharge)."""

    def fits_alone(self, size: int) -> None: ...

    def at_least(self, size: int) -> None: ...


async def read_capped(chunks: AsyncIterator[bytes], declared: str | None, limit: int, charge: Charge) -> bytes:
    """The raw body, refusing more than `limit` bytes (by Content-Length first, then as it streams in). `charge` is
    told the bytes the body holds as they arrive; a declared length only has to fit its budget alone, since a
    client may declare much and send nothing."""
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise DecisionError("Content-Length is not a number") from None
        if size > limit:
            raise BodyTooLarge(limit)
        charge.fits_alone(size)
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        charge.at_least(size)
        parts.append(chunk)
    return b"".join(parts)


def _inflate_gzip(raw: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise DecisionError(f"gzip body could not be decompressed: {exc}") from exc
    if len(out) > limit or inflater.unconsumed_tail:
        raise BodyTooLarge(limit, "decompressed request body")
    if not inflater.eof:
        raise DecisionError("gzip body is truncated")
    if inflater.unused_data:
        # A second member or trailing bytes: read as one body they would smuggle data past the first member.
        raise DecisionError("gzip body has data after its end (a second member or trailing bytes)")
    return out


def _inflate_zstd(raw: bytes, limit: int) -> bytes:
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        out = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise DecisionError(f"zstd body could not be decompressed: {exc}") from exc
    if len(out) > limit:
        raise BodyTooLarge(limit, "decompressed request body")
    return out


def decode_content(raw: bytes, encoding_header: str | None, limit: int) -> bytes:
    """Undo the Content-Encoding (one or a comma-separated chain), each step capped at `limit` bytes."""
    encodings = [e.strip().lower() for e in (encoding_header or "").split(",") if e.strip()]
    for encoding in reversed(encodings):
        if encoding not in ENCODINGS:
            raise BodyEncoding(encoding)
        if encoding in ("gzip", "x-gzip"):
            raw = _inflate_gzip(raw, limit)
        elif encoding == "zstd":
            raw = _inflate_zstd(raw, limit)
    return raw


def _items(container: dict | list) -> Iterator[tuple[Any, Any]]:
    return iter(container.items()) if type(container) is dict else enumerate(container)


def _check_values(document: Any) -> None:
    """Refuse nesting deeper than MAX_DEPTH and strings that are not Unicode (lone surrogates from `\\ud800`).

    Depth first, in document order, with one iterator per open container: the check holds memory for the depth it is
    at, never an object per value or per container. Stacking values with their locations made three objects a
    value (a state of 3 million numbers: 7 s and about 480 MB); stacking containers with theirs made a location
    tuple as long as the depth for each (200,000 empty lists 250 levels down, a 600 KB body: 440 MB)."""
    if type(document) is str:
        _check_text(document, [])
    if type(document) is not dict and type(document) is not list:
        return
    keys: list[Any] = []  # the location of the container being read: keys[i] leads from level i to level i + 1
    open_items = [_items(document)]
    while open_items:
        for key, item in open_items[-1]:
            if type(key) is str:
                _check_text(key, keys, key)
            kind = type(item)
            if kind is str:
                _check_text(item, keys, key)
            elif (kind is dict or kind is list) and item:
                if len(open_items) == MAX_DEPTH:  # its values would be one level deeper
                    raise SchemaError([SchemaIssue(_safe((*keys, key)), f"JSON is nested more than {MAX_DEPTH} "
                                                   "levels deep", "json_invalid")])
                keys.append(key)
                open_items.append(_items(item))
                break
        else:
            open_items.pop()
            if keys:
                keys.pop()


_SURROGATE = re.compile("[\ud800-\udfff]")


def _safe(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """`loc` with its keys' own lone surrogates escaped, so the error itself can be written as JSON."""
    return tuple(k.encode("utf-8", "backslashreplace").decode() if isinstance(k, str) else k for k in loc)


def _check_text(text: str, keys: list[Any], key: Any = None) -> None:
    """`text`, found at `keys` (at `key` there, when given), holds no lone surrogate, which UTF-8 cannot encode."""
    # isascii reads a flag CPython keeps on the string: a 3.2 MB data URL is not scanned (the search took 6.8 ms).
    if text.isascii() or _SURROGATE.search(text) is None:
        return
    loc = tuple(keys) if key is None else (*keys, key)
    raise SchemaError([SchemaIssue(_safe(loc), "String is not valid Unicode: it holds a lone surrogate",
                                   "string_unicode")])


def parse_json(raw: bytes) -> Any:
    """UTF-8 JSON -> Python values as FastAPI reads them (NaN/Infinity allowed, last duplicate key wins)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError([SchemaIssue((exc.start,), "JSON decode error: invalid UTF-8", "json_invalid")]) from exc
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError([SchemaIssue((exc.pos,), f"JSON decode error: {exc.msg}", "json_invalid")]) from exc
    except RecursionError as exc:
        raise SchemaError([SchemaIssue((), f"JSON is nested more than {MAX_DEPTH} levels deep",
                                       "json_invalid")]) from exc
    except ValueError as exc:  # e.g. an integer longer than Python's int string conversion limit
        raise SchemaError([SchemaIssue((), f"JSON decode error: {exc}", "json_invalid")]) from exc
    _check_values(document)
    return document
