"""A corpus of 200+ corrupt or hostile media inputs against a live server (decisions 1, 6):
truncated files, wrong magic bytes, bomb-like headers, malformed data URLs, private hosts, redirects to
127.0.0.1, zero-frame and one-frame videos. Zero 5xx, every body JSON, and the server keeps answering."""

from __future__ import annotations

import base64
import random
import struct
import zlib
from collections import Counter

import httpx
import pytest
from PIL import Image

from systemone.runtime import media_fetch
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from tests.live_server import live_server
from tests.media_helpers import CountingServer, data_url, encoded, png_chunk, test_images, write_video

from tests.vision_fixtures import fixture_image


def png_header(width: int, height: int, idat: bytes = b"\x00" * 64, crc_ok: bool = True) -> bytes:
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0), crc_ok)
            + png_chunk(b"IDAT", zlib.compress(idat)) + png_chunk(b"IEND", b""))


def corpus(server_url: str, redirect_url: str) -> list[str]:
    rng = random.Random(4)
    image = Image.fromarray(fixture_image("vga-640x480"))
    valid = {fmt: encoded(image, fmt) for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")}
    urls = []
    for data in valid.values():  # truncated at 12 points each: 72
        for fraction in (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 0.97, 0.995):
            urls.append(data_url(data[: int(len(data) * fraction)]))
    for data in valid.values():  # wrong magic bytes: 18
        for magic in (b"\x00" * 8, b"GIF89a\x00\x00", b"%PDF-1.7"):
            urls.append(data_url(magic + data[8:]))
    for _ in range(60):  # random bytes
        urls.append(data_url(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))))
    for w, h in ((30000, 30000), (100000, 2), (2, 100000), (65535, 65535), (1, 1 << 30), (0, 10), (10, 0)):
        urls.append(data_url(png_header(w, h)))  # bomb-like or empty headers
    urls.append(data_url(png_header(12000, 12000, idat=b"\x00" * 10)))  # under the limit, pixels missing
    urls.append(data_url(png_header(64, 64, crc_ok=False)))
    urls.append(data_url(b"GIF89a" + struct.pack("<HH", 65535, 65535) + b"\x00" * 20))
    urls.append(data_url(b"BM" + b"\x00" * 16 + struct.pack("<ii", 1 << 20, 1 << 20) + b"\x00" * 30))
    for _ in range(20):  # mangled data URLs
        raw = base64.b64encode(valid["PNG"][:200]).decode()
        cut = rng.randrange(len(raw))
        urls.append(rng.choice([f"data:image/png;base64,{raw[:cut]}!{raw[cut:]}", f"data:image/png,{raw}",
                                f"data:image/png;base64{raw}", "data:", "data:,", f"data:;base64,{raw[:cut]}",
                                f"data:image/png;base64,{raw}" + "=" * rng.randrange(1, 5)]))
    urls += ["ftp://example.com/a.png", "gopher://x", "javascript:alert(1)", "", " ", "http://", "https://:0/",
             "http://[::1]:1/a.png", "http://127.0.0.1:1/a.png", "http://10.1.2.3/a.png", "http://169.254.169.254/",
             "http://0x7f000001/a.png", "http://2130706433/a.png", "http://localhost/a.png", "file:///etc/passwd",
             "file://remote-host/share/a.png", "file:relative.png", "http://no-such-host.invalid/a.png",
             "http://example.com:99999/a.png", "http://a b/c.png"]
    urls += [f"{redirect_url}/to-loopback", f"{redirect_url}/loop", f"{server_url}/missing.png",
             f"{server_url}/not-an-image.png", f"{server_url}/truncated.png"]
    urls += [data_url(valid["PNG"], "video/mp4"), data_url(valid["PNG"], "text/plain")]  # MIME is ignored: valid
    return urls


def video_corpus(tmp_path) -> list[str]:
    """Videos that cannot be read: zero frames, one frame, truncated, not a video, bad JPEG-frame URLs."""
    import cv2

    empty = tmp_path / "empty.mp4"
    writer = cv2.VideoWriter(str(empty), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (64, 64))
    writer.release()
    one = write_video(tmp_path / "one.mp4", frames=1, fps=10.0, width=64, height=64)
    good = write_video(tmp_path / "good.mp4", frames=20, fps=10.0, width=64, height=64)
    jpeg = base64.b64encode(encoded(Image.fromarray(fixture_image("tiny-50x50")), "JPEG")).decode()
    urls = [data_url(empty.read_bytes() if empty.exists() else b"", "video/mp4"), data_url(one, "video/mp4"),
            data_url(b"", "video/mp4"), data_url(b"\x00" * 1000, "video/mp4"), data_url(test_images()["tiny-50x50.png"],
                                                                                    "video/mp4")]
    urls += [data_url(good[: int(len(good) * f)], "video/mp4") for f in (0.05, 0.2, 0.5, 0.8)]
    urls += ["data:video/jpeg;base64,", f"data:video/jpeg;base64,{jpeg},!!!", f"data:video/jpeg;base64,{jpeg}",
             "data:video/jpeg;base64,AAAA,BBBB"]
    return urls


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_hostile_media_corpus(family, request, monkeypatch, tmp_path):
    """Every input ends in a 4xx naming its place (or a 200 for what decodes); d1 takes the images only."""
    # The corpus server plays a public host (so the redirect to 127.0.0.1 is what gets refused).
    monkeypatch.setattr(media_fetch, "_public", lambda address: address == "127.0.0.2")
    files = {"not-an-image.png": b"<html>nope</html>", "truncated.png": test_images()["tiny-50x50.png"][:300]}
    server = CountingServer(files, host="127.0.0.2")
    service = DecisionService(Artifact.load(request.getfixturevalue(f"{family}_artifact")),
                              EngineOptions(device="cpu"))
    statuses: Counter[int] = Counter()
    with server.running():
        port = server.url.rsplit(":", 1)[1]
        public_url = server.url
        server.redirects.update({"to-loopback": f"http://127.0.0.1:{port}/truncated.png",
                                 "loop": f"http://127.0.0.2:{port}/loop"})
        inputs = [("images", url) for url in corpus(public_url, public_url)]
        if family == "d3":
            inputs += [("videos", url) for url in video_corpus(tmp_path)]
        with live_server(service) as base, httpx.Client(base_url=base, timeout=120) as client:
            for field, url in inputs:
                response = client.post("/v1/systemone", json={"state": "x", field: [url],
                                                              "questions": {"q": {"type": "noul"}}})
                statuses[response.status_code] += 1
                body = response.json()
                assert response.status_code < 500, (url[:80], body)
                if response.status_code != 200:
                    assert body["error"]["message"].startswith(f"media: {field}[0]: "), body
            good = client.post("/v1/systemone", json={"state": "x", "questions": {"q": {"type": "noul"}}})
    print(f"\nmedia corpus: {len(inputs)} inputs, statuses {dict(sorted(statuses.items()))}")
    assert len(inputs) >= 200
    assert statuses[200] >= 2  # the two valid PNGs sent under another MIME type (and what Pillow still reads)
    assert good.status_code == 200
    assert server.gets["to-loopback"] == 1 and server.gets["truncated.png"] == 1  # the redirect was not followed
