"""A PNG's image data inflated by libdeflate before Pillow decodes it.

Pillow inflates a PNG's IDAT stream with zlib, and for a photo or noise that is most of its decode: the bench's
1024x1024 PNG took 23.6 ms on two cores, 18.9 of them zlib's inflate, which libdeflate does in 8.2
(`scripts/png_decode_timing.py`; docs/decisions/media-decode.md). So `stored_png` inflates the stream with libdeflate
and hands Pillow the same PNG with that data stored (deflate's uncompressed blocks): Pillow then only copies and
unfilters the same bytes, so the pixels are the same. Every other chunk is kept as it came, in its place. The
inflate lets go of the GIL, as zlib's does: a media worker decodes beside the engine thread.

A PNG this does not fit is decoded as it came: interlaced or animated images, data that does not inflate to exactly
the size the header implies (a truncated or corrupt stream keeps Pillow's own error), data that inflates more than
`MAX_INFLATION`-fold, and images above `MAX_INFLATED_BYTES`, whose inflated data and its stored copy are both held
for a moment beside the decode."""

from __future__ import annotations

import struct

import deflate

SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A 4K screenshot in RGBA (33 MB) fits; the transient is at most twice this, beside Pillow's own buffers.
MAX_INFLATED_BYTES = 48 << 20
# Data that inflates more than 32-fold (flat panels: screenshots, diagrams) is quick to inflate either way, and
# Pillow reading it back stored costs more than libdeflate saves: a 1920x1080 screenshot of 12 KB took Pillow 13.8
# ms, and its stored form 12.9 ms and about 2 more to make. Photos and noise inflate 1.05- to 3-fold.
MAX_INFLATION = 32
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type: grey, RGB, palette, grey + alpha, RGBA
_STORED_BLOCK = 65535  # the most bytes one stored deflate block holds


def _chunks(data: bytes) -> list[tuple[bytes, int, int]] | None:
    """(type, start of the chunk, end past its CRC) of every chunk up to IEND; None if they do not parse."""
    found, at = [], len(SIGNATURE)
    while at + 12 <= len(data):
        size, kind = struct.unpack_from(">I4s", data, at)
        end = at + 12 + size
        if end > len(data):
            return None
        found.append((kind, at, end))
        if kind == b"IEND":
            return found
        at = end
    return None


def _inflated_size(header: bytes) -> int | None:
    """The bytes a non-interlaced image's filtered rows take (a filter byte each), from its IHDR."""
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    channels = _CHANNELS.get(colour)
    if channels is None or interlace != 0 or depth not in (1, 2, 4, 8, 16):
        return None
    return height * (1 + (width * channels * depth + 7) // 8)


def _idat_chunk(raw: bytes) -> list[bytes | memoryview]:
    """One IDAT chunk holding `raw` as a zlib stream of stored blocks (no compression), in parts that share
    `raw`'s memory until they are joined."""
    view, body = memoryview(raw), [b"\x78\x01"]
    for at in range(0, len(raw), _STORED_BLOCK):
        block = view[at:at + _STORED_BLOCK]
        body += [struct.pack("<BHH", at + _STORED_BLOCK >= len(raw), len(block), 0xFFFF ^ len(block)), block]
    body.append(struct.pack(">I", deflate.adler32(raw)))
    crc = deflate.crc32(b"IDAT")
    for part in body:
        crc = deflate.crc32(part, crc)
    return [struct.pack(">I", sum(len(part) for part in body)), b"IDAT", *body, struct.pack(">I", crc)]


def stored_png(data: bytes) -> bytes | None:
    """`data`, a PNG, with its image data inflated and stored uncompressed in one IDAT chunk; None where it does not
    apply (see the module's note), for Pillow to decode `data` itself."""
    chunks = _chunks(data) if data.startswith(SIGNATURE) else None
    if not chunks or chunks[0][0] != b"IHDR" or chunks[0][2] - chunks[0][1] != 25:
        return None
    idat = [index for index, (kind, _, _) in enumerate(chunks) if kind == b"IDAT"]
    # The specification wants the IDATs consecutive; a file that puts other chunks between them is left to Pillow.
    if not idat or idat[-1] - idat[0] + 1 != len(idat) or any(kind == b"acTL" for kind, _, _ in chunks):
        return None
    expected = _inflated_size(data[chunks[0][1] + 8:chunks[0][1] + 21])
    deflated = sum(chunks[i][2] - chunks[i][1] - 12 for i in idat)
    if expected is None or expected > MAX_INFLATED_BYTES or deflated * MAX_INFLATION < expected:
        return None
    view = memoryview(data)
    try:
        raw = deflate.zlib_decompress(b"".join(view[chunks[i][1] + 8:chunks[i][2] - 4] for i in idat), expected)
    except deflate.DeflateError:
        return None
    if len(raw) != expected:
        return None
    return b"".join((view[:chunks[idat[0]][1]], *_idat_chunk(raw), view[chunks[idat[-1]][2]:]))
