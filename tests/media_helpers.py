"""Test media: deterministic images in several encodings, data URLs, a loopback HTTP(S) server that counts GETs, a
forward proxy, and a media encoder whose one job is held until stopped."""

from __future__ import annotations

import base64
import functools
import http.client
import io
import select
import socket
import ssl
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

from tests.vision_fixtures import fixture_image
from systemone.runtime.media_encoder import MediaEncoder
from systemone.runtime.media_errors import MediaError


def encoded(image: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes, crc_ok: bool = True) -> bytes:
    """One PNG chunk: its length, type, data and CRC (0 where `crc_ok` is False)."""
    crc = zlib.crc32(kind + data) if crc_ok else 0
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png_file(chunks: list[tuple[bytes, bytes]]) -> bytes:
    """A PNG of (type, data) chunks, in order, after the signature."""
    return b"\x89PNG\r\n\x1a\n" + b"".join(png_chunk(kind, data) for kind, data in chunks)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def exif_rotated_jpeg() -> bytes:
    """A 64x128 (w x h) JPEG whose EXIF orientation 6 says: rotate to 128x64."""
    image = Image.fromarray(fixture_image("tall-300x1200")).resize((64, 128))
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(image, "JPEG", exif=exif.tobytes(), quality=95)


def rgba_png() -> bytes:
    rgba = np.zeros((96, 160, 4), dtype=np.uint8)
    rgba[..., :3] = fixture_image("square-100")[:96, :100].mean().astype(np.uint8)
    rgba[:, 80:, 3] = 255  # left half fully transparent -> white after compositing
    return encoded(Image.fromarray(rgba, "RGBA"), "PNG")


def palette_png() -> bytes:
    image = Image.fromarray(fixture_image("vga-640x480")).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    image.info["transparency"] = 0
    return encoded(image, "PNG", transparency=0)


def test_images() -> dict[str, bytes]:
    """At least 8 images: 50x50 to 4000x3000, extreme aspect ratios, RGBA, palette, EXIF-rotated."""
    return dict(_encoded_test_images())


@functools.cache  # 4 s to encode, and several test modules read them
def _encoded_test_images() -> dict[str, bytes]:
    def png(name):
        return encoded(Image.fromarray(fixture_image(name)), "PNG")

    return {
        "tiny-50x50.png": png("tiny-50x50"),
        "vga-640x480.jpg": encoded(Image.fromarray(fixture_image("vga-640x480")), "JPEG", quality=90),
        "wide-1920x1080.png": png("wide-1920x1080"),
        "photo-4000x3000.jpg": encoded(Image.fromarray(fixture_image("photo-4000x3000")), "JPEG", quality=85),
        "strip-2000x40.png": png("strip-2000x40"),
        "tall-300x1200.webp": encoded(Image.fromarray(fixture_image("tall-300x1200")), "WEBP", lossless=True),
        "rgba-160x96.png": rgba_png(),
        "palette-640x480.png": palette_png(),
        "exif-rotated.jpg": exif_rotated_jpeg(),
    }


test_images.__test__ = False  # a helper, not a test


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[None]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


class CountingServer:
    """Serves `files` on 127.0.0.1, counts GETs per path; `redirects` maps a path to a Location; `declare_length`
    False sends bodies without a Content-Length. `failures` maps a path to what its first GETs get, one each: a
    status (an empty body), "drop" (the connection closed, no response), "short" (half the body, then closed) or
    "stall" (nothing for a second)."""

    def __init__(self, files: dict[str, bytes], redirects: dict[str, str] | None = None, host: str = "127.0.0.1",
                 declare_length: bool = True, failures: dict[str, list[int | str]] | None = None,
                 tls: bool = False):
        self.files, self.redirects, self.gets = files, redirects or {}, Counter()
        self.failures = {path: list(each) for path, each in (failures or {}).items()}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                path = self.path.lstrip("/")
                outer.gets[path] += 1
                failure = outer.failures[path].pop(0) if outer.failures.get(path) else None
                if failure in ("drop", "stall"):
                    if failure == "stall":
                        time.sleep(1.0)
                    self.close_connection = True
                elif failure == "short":
                    body = outer.files[path]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[:len(body) // 2])
                    self.close_connection = True
                elif failure is not None:
                    self.send_response(failure)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path in outer.redirects:
                    self.send_response(302)
                    self.send_header("Location", outer.redirects[path])
                    self.end_headers()
                elif path in outer.files:
                    body = outer.files[path]
                    self.send_response(200)
                    if declare_length:  # else the body ends when the connection closes (HTTP/1.0)
                        self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self.send_response(404)
                    self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        if tls:  # as media.example, with the certificate TLS_CERTIFICATE holds
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(TLS_DIR / "media.example.crt", TLS_DIR / "media.example.key")
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://{host}:{self.server.server_address[1]}"

    @contextmanager
    def running(self):
        with serving(self.server):
            yield self


TLS_DIR = Path(__file__).parent / "fixtures" / "tls"
TLS_CERTIFICATE = TLS_DIR / "media.example.crt"  # self-signed for media.example, valid to 2126: SSL_CERT_FILE in tests


class ForwardProxy:
    """An HTTP proxy on loopback: GET by absolute URL (relayed with its status and body) and CONNECT tunnels. Each
    request's first line and Proxy-Authorization are kept in `seen`; `hosts` maps names to the addresses it connects
    to (it resolves them, not the client); `password` set: anything else is a 407."""

    def __init__(self, hosts: dict[str, str] | None = None, password: str | None = None):
        self.hosts, self.password, self.seen = hosts or {}, password, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _admitted(self) -> bool:
                outer.seen.append((self.requestline, self.headers.get("Proxy-Authorization")))
                expected = "Basic " + base64.b64encode(f"user:{outer.password}".encode()).decode()
                if outer.password is not None and self.headers.get("Proxy-Authorization") != expected:
                    self.send_response(407)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return False
                return True

            def do_GET(self):  # noqa: N802
                if not self._admitted():
                    return
                parts = urlsplit(self.path)
                upstream = http.client.HTTPConnection(outer.hosts.get(parts.hostname, parts.hostname), parts.port,
                                                      timeout=5)
                upstream.request("GET", parts.path or "/", headers={"Host": parts.netloc})
                response = upstream.getresponse()
                body = response.read()
                self.send_response(response.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                upstream.close()

            def do_CONNECT(self):  # noqa: N802
                if not self._admitted():
                    return
                host, port = self.path.rsplit(":", 1)
                with socket.create_connection((outer.hosts.get(host, host), int(port)), timeout=5) as upstream:
                    self.send_response(200, "Connection established")
                    self.end_headers()
                    sockets = [self.connection, upstream]
                    while True:
                        readable, _, _ = select.select(sockets, [], [], 5)
                        if not readable:
                            break
                        for sock in readable:
                            data = sock.recv(65536)
                            if not data:
                                self.close_connection = True
                                return
                            (upstream if sock is self.connection else self.connection).sendall(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"

    @contextmanager
    def running(self):
        with serving(self.server):
            yield self


def write_video(path, frames: int, fps: float, width: int, height: int, codec: str = "mp4v") -> bytes:
    """A file whose frame i shows i as a gray level band (OpenCV's writer, mp4v: a keyframe every 12 frames;
    MJPG: every frame one), returned as bytes."""
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*codec), fps, (width, height))
    base = fixture_image("photo-4000x3000")[:height, :width]
    for i in range(frames):
        frame = base.copy()
        frame[: height // 8] = (i * 7) % 256
        writer.write(np.ascontiguousarray(frame[..., ::-1]))
    writer.release()
    return path.read_bytes()


def with_one_keyframe(mp4: bytes) -> bytes:
    """The same MP4 with its sync-sample table (moov/trak/mdia/minf/stbl/stss) cut to its first entry: demuxers then
    see one keyframe, at frame 0, as in a long-GOP stream, while the frames still decode from the start. (OpenCV's
    writer cannot be asked for a long GOP: it ignores the key-interval setting.) Only the table's count changes; the
    entries after it stay inside the box, which readers skip to its end."""
    data = bytearray(mp4)

    def boxes(start: int, end: int):
        while start + 8 <= end:
            size, kind = int.from_bytes(data[start:start + 4], "big"), bytes(data[start + 4:start + 8])
            yield start, start + size, kind
            start += size

    def find(path: list[bytes], start: int, end: int) -> int:
        for box_start, box_end, kind in boxes(start, end):
            if kind == path[0]:
                return box_start if len(path) == 1 else find(path[1:], box_start + 8, box_end)
        raise ValueError(f"no {path[0]!r} box")

    stss = find([b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stss"], 0, len(data))
    assert int.from_bytes(data[stss + 12:stss + 16], "big") > 1, "the stream has one keyframe already"
    data[stss + 12:stss + 16] = (1).to_bytes(4, "big")  # after size, type, version and flags
    return bytes(data)


def gradient_png(width: int, height: int, seed: int = 0) -> bytes:
    """A deterministic RGB gradient with a little noise, PNG-encoded (resizes of it show every filter detail)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    rgb = np.clip(rgb + rng.integers(-6, 7, rgb.shape), 0, 255).astype(np.uint8)
    return encoded(Image.fromarray(rgb), "PNG")


class HeldMedia(MediaEncoder[str]):
    """One image whose job runs `seconds` or until the request stops it, then gives its key or fails with `error`."""

    def __init__(self, seconds: float, error: str | None = None):
        super().__init__(session=None, policy=None)  # type: ignore[arg-type]  # never fetches nor runs a graph
        self.seconds, self.error = seconds, error
        self.started, self.stopped = threading.Event(), threading.Event()

    def jobs(self, request: Any) -> list[tuple[str, str]]:
        return [("photo", "images[0]")]

    def load_one(self, key, where, deadline, allowance, workers) -> str:
        deadline.on_cancel(self.stopped.set)
        self.started.set()
        if self.stopped.wait(self.seconds):
            raise deadline.error()
        if self.error:
            raise MediaError(where, self.error)
        return key

    def rows(self, item, run_options):
        raise NotImplementedError
