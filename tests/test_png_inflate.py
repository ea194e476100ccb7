"""A PNG's data inflated by libdeflate before Pillow decodes it (runtime/png_inflate.py): the same pixels and the
same errors as Pillow's own decode, for every PNG, and the PNGs it does not fit go to Pillow as they came."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from systemone.runtime import media_decode, png_inflate
from systemone.runtime.media_decode import decode_image
from systemone.runtime.media_fetch import MediaError
from systemone.runtime.png_inflate import stored_png
from systemone.server.errors import sanitize
from tests.media_helpers import encoded, png_file


def chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    found, at = [], 8
    while at < len(png):
        (size,) = struct.unpack(">I", png[at:at + 4])
        found.append((png[at + 4:at + 8], png[at + 8:at + 8 + size]))
        at += 12 + size
    return found


def pillow_decode(data: bytes, monkeypatch: pytest.MonkeyPatch) -> np.ndarray | str:
    """decode_image as it was before libdeflate: Pillow inflating the data itself (or its error's message)."""
    with monkeypatch.context() as patch:
        patch.setattr(media_decode, "stored_png", lambda data: None)
        return decoded(data)


def decoded(data: bytes) -> np.ndarray | str:
    """The pixels, or the error's message as a client reads it: Pillow names the buffer by its memory address, which
    differs between two reads of the same bytes and which the server drops (spec 1.4)."""
    try:
        return decode_image(data, "images[0]")
    except MediaError as error:
        return sanitize(error.message)


# Noise, as photos are to a PNG encoder: it inflates less than MAX_INFLATION-fold.
rng = np.random.default_rng(0)
NOISE = rng.integers(0, 256, (37, 53, 4), dtype=np.uint8)
IMAGES = {
    "rgb noise": Image.fromarray(NOISE[..., :3]),
    "rgba": Image.fromarray(NOISE),
    "grey": Image.fromarray(NOISE[..., 0]),
    "grey + alpha": Image.fromarray(NOISE[..., :2].copy(), "LA"),
    "16-bit grey": Image.fromarray(NOISE[..., :2].copy().view(np.uint16)[..., 0]),
    "1-bit": Image.fromarray(NOISE[..., 0] > 128),
    "palette with a transparent entry": Image.fromarray(NOISE[..., 0] % 16).convert("P"),
    "wide": Image.fromarray(rng.integers(0, 256, (2, 1400, 3), dtype=np.uint8)),
}


@pytest.mark.parametrize("name", IMAGES)
def test_every_colour_type_and_depth_decodes_to_pillows_pixels(name, monkeypatch):
    options = {"transparency": 3} if name.startswith("palette") else {}
    png = encoded(IMAGES[name], "PNG", **options)
    stored = stored_png(png)
    assert stored is not None
    before, after = Image.open(io.BytesIO(png)), Image.open(io.BytesIO(stored))
    assert (after.mode, after.size, after.info) == (before.mode, before.size, before.info)
    assert np.array_equal(np.asarray(after), np.asarray(before))
    assert np.array_equal(decoded(png), pillow_decode(png, monkeypatch))


# Every colour type and bit depth the PNG specification allows, some of which Pillow cannot write (16-bit RGB).
DEPTHS = [(0, d) for d in (1, 2, 4, 8, 16)] + [(2, 8), (2, 16), (4, 8), (4, 16), (6, 8), (6, 16)] + \
    [(3, d) for d in (1, 2, 4, 8)]


@pytest.mark.parametrize("colour, depth", DEPTHS)
def test_rows_of_every_filter_colour_type_and_depth_decode_as_pillow_decodes_them(colour, depth, monkeypatch):
    width, height = 23, 9
    row = 1 + (width * {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour] * depth + 7) // 8
    rows = bytearray(np.random.default_rng(colour * 100 + depth).integers(0, 256, row * height, dtype=np.uint8))
    rows[::row] = bytes(i % 5 for i in range(height))  # each of the five filters
    palette = [(b"PLTE", bytes(range(256)) * 3)] if colour == 3 else []
    png = png_file([(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)), *palette,
                     (b"IDAT", zlib.compress(bytes(rows))), (b"IEND", b"")])
    assert stored_png(png) is not None
    ours = decoded(png)
    assert isinstance(ours, np.ndarray) and ours.shape == (height, width, 3)
    assert np.array_equal(ours, pillow_decode(png, monkeypatch))


def test_the_data_is_stored_uncompressed_and_the_other_chunks_kept_in_place():
    image = IMAGES["rgb noise"]
    png = encoded(image, "PNG", compress_level=9, pnginfo=None, exif=image.getexif(), dpi=(72, 72))
    # Split the data over several IDATs and add a text chunk after them, as encoders do.
    parts = chunks(png)
    data = b"".join(body for kind, body in parts if kind == b"IDAT")
    head = [(kind, body) for kind, body in parts if kind not in (b"IDAT", b"IEND")]
    pieces = [(b"IDAT", data[at:at + 1000]) for at in range(0, len(data), 1000)]
    png = png_file(head + pieces + [(b"tEXt", b"Comment\x00after the data"), (b"IEND", b"")])
    stored = chunks(stored_png(png))
    assert [kind for kind, _ in stored] == [kind for kind, _ in head] + [b"IDAT", b"tEXt", b"IEND"]
    idat = stored[len(head)][1]
    assert zlib.decompress(idat) == zlib.decompress(data)
    assert len(idat) > len(zlib.decompress(data))  # stored blocks: the bytes and their headers
    assert Image.open(io.BytesIO(png_file(stored))).info == Image.open(io.BytesIO(png)).info


def test_an_exif_orientation_after_the_data_is_still_applied(monkeypatch):
    image = Image.fromarray(NOISE[..., :3])
    exif = image.getexif()
    exif[0x0112] = 6  # rotated: the decode turns it upright
    parts = chunks(encoded(image, "PNG"))
    png = png_file([p for p in parts if p[0] != b"IEND"] + [(b"eXIf", exif.tobytes()), (b"IEND", b"")])
    assert stored_png(png) is not None
    upright = decoded(png)
    assert upright.shape == (53, 37, 3)
    assert np.array_equal(upright, pillow_decode(png, monkeypatch))


def interlaced() -> bytes:
    header = struct.pack(">IIBBBBB", 4, 4, 8, 0, 0, 0, 1)
    # Adam7's seven passes of a 4x4 grey image: rows of 1, 1, 1, 2, 2, 2 and 2 pixels, each with its filter byte.
    passes = [(1, 1), (1, 1), (1, 1), (2, 1), (1, 2), (2, 2), (2, 4)]
    rows = b"".join((b"\x00" + bytes(range(w))) * h for h, w in passes)
    return png_file([(b"IHDR", header), (b"IDAT", zlib.compress(rows)), (b"IEND", b"")])


def animated() -> bytes:
    frames = [Image.fromarray(NOISE[..., :3]), Image.fromarray(255 - NOISE[..., :3])]
    buffer = io.BytesIO()
    frames[0].save(buffer, "PNG", save_all=True, append_images=frames[1:])
    return buffer.getvalue()


def truncated() -> bytes:
    parts = chunks(encoded(IMAGES["rgb noise"], "PNG"))
    return png_file([(k, b[:len(b) // 2] if k == b"IDAT" else b) for k, b in parts])


def interleaved() -> bytes:
    parts = chunks(encoded(IMAGES["rgb noise"], "PNG"))
    data = b"".join(body for kind, body in parts if kind == b"IDAT")
    return png_file([parts[0], (b"IDAT", data[:500]), (b"tEXt", b"a\x00b"), (b"IDAT", data[500:]), parts[-1]])


@pytest.mark.parametrize("make", [interlaced, animated, truncated, interleaved])
def test_pngs_it_does_not_fit_go_to_pillow_as_they_came(make, monkeypatch):
    png = make()
    assert stored_png(png) is None
    same = decoded(png), pillow_decode(png, monkeypatch)
    assert (same[0] == same[1]) if isinstance(same[0], str) else np.array_equal(*same)


def test_data_that_inflates_many_times_over_is_left_to_pillow(monkeypatch):
    flat = np.full((200, 300, 3), 240, np.uint8)
    flat[::20] = 30
    png = encoded(Image.fromarray(flat), "PNG")
    assert stored_png(png) is None
    assert np.array_equal(decoded(png), pillow_decode(png, monkeypatch))
    monkeypatch.setattr(png_inflate, "MAX_INFLATION", 10 ** 6)
    assert stored_png(png) is not None


def test_images_above_the_bound_are_left_to_pillow(monkeypatch):
    png = encoded(IMAGES["rgb noise"], "PNG")
    assert stored_png(png) is not None
    monkeypatch.setattr(png_inflate, "MAX_INFLATED_BYTES", 37 * (1 + 53 * 3) - 1)
    assert stored_png(png) is None


@pytest.mark.parametrize("data", [b"", b"\x89PNG\r\n\x1a\n", b"GIF89a" + bytes(20), b"\x89PNG\r\n\x1a\n" + bytes(30)])
def test_what_is_not_a_whole_png_is_not_touched(data):
    assert stored_png(data) is None


def test_damaged_pngs_answer_as_pillow_answers_them(monkeypatch):
    """Any byte of the file may be wrong, in the data or around it (the chunks' lengths, types, CRCs, the text after
    the data): decoded with libdeflate first or by Pillow alone, the same pixels or the same error."""
    parts = chunks(encoded(Image.fromarray(NOISE[:12, :16, :3]), "PNG", dpi=(72, 72)))
    png = png_file(parts[:-1] + [(b"tEXt", b"Comment\x00after"), parts[-1]])
    start = png.index(b"IDAT") + 4
    outside = [at for at in range(8, len(png)) if not start <= at < start + len(parts[-2][1])]
    rng, through = np.random.default_rng(1), 0
    for _ in range(400):
        damaged = bytearray(png)
        for at in rng.choice(outside if rng.random() < 0.5 else range(8, len(png)), rng.integers(1, 4)):
            damaged[at] = rng.integers(0, 256)
        if rng.random() < 0.2:
            damaged = damaged[:rng.integers(8, len(png))]
        through += stored_png(bytes(damaged)) is not None
        ours, pillows = decoded(bytes(damaged)), pillow_decode(bytes(damaged), monkeypatch)
        assert type(ours) is type(pillows)
        assert (ours == pillows) if isinstance(ours, str) else np.array_equal(ours, pillows)
    assert through > 50  # many damaged files went through libdeflate
