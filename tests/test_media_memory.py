"""Memory bounded per request (docs/operations.md): image bombs are refused from their
headers before a pixel is decoded, or decoded within the request's pixel budget; video frames are bounded in size
and number. Each bomb runs in a subprocess whose RSS is sampled and capped, so a failure cannot take the machine
down. Memory read for a download that is then refused goes back to the system."""

from __future__ import annotations

import base64
import io
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from PIL import Image

from systemone.local_server import free_port, rss_mb, serve_command, start_server
from tests import memory_probe

NOUL = {"q": {"type": "noul", "instructions": "Is it urgent?"}}
LIMIT_MB = 1500  # the probe ends itself past this; the documented bound is 1 GB a request
BOMB_SIDE = 13_000  # 169 megapixels: under vLLM's 178,956,970 per image, over the 70,000,000 of a request


def saved(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def probe(artifact, tmp_path, body) -> dict:
    return memory_probe.probe(artifact, body, tmp_path, LIMIT_MB)


def as_url(tmp_path, name: str, data: bytes) -> str:
    (tmp_path / name).write_bytes(data)
    return f"file://{tmp_path / name}"


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> dict[str, bytes]:
    """Small files that decode to 169 (PNG, TIFF G4, GIF) and 100 (WebP, at its 16,383 limit: 10,000²) megapixels."""
    one_bit = Image.new("1", (BOMB_SIDE, BOMB_SIDE))
    out = {"bomb.png": saved(one_bit, "PNG"), "bomb.tiff": saved(one_bit, "TIFF", compression="group4")}
    del one_bit
    out["bomb.gif"] = saved(Image.new("P", (BOMB_SIDE, BOMB_SIDE)), "GIF")
    out["bomb.webp"] = saved(Image.new("L", (10_000, 10_000)), "WEBP", lossless=True)
    return out


@pytest.mark.parametrize("name", ["bomb.png", "bomb.tiff", "bomb.gif", "bomb.webp"])
@pytest.mark.parametrize("family", ["d3", "d1"])
def test_an_image_bomb_is_refused_from_its_header(request, tmp_path, bombs, name, family):
    artifact = request.getfixturevalue(f"{family}_artifact")
    assert len(bombs[name]) < 2 << 20
    out = probe(artifact, tmp_path, {"state": "x", "images": [as_url(tmp_path, name, bombs[name])],
                                     "questions": NOUL})
    assert out.get("status") == 413, out
    assert "images[0]" in out["message"] and "--max-request-pixels" in out["message"]
    assert out["seconds"] < 1.0 and out["peak_increase_mb"] < 100, out


def test_images_within_the_per_image_limit_share_one_request_budget(d3_artifact, tmp_path):
    """Four distinct 8,000 x 8,000 PNGs (64 megapixels each): one fits the request's budget, the next does not;
    the request's peak stays under the documented 1 GB."""
    urls = [as_url(tmp_path, f"big{i}.png", saved(Image.new("1", (8000, 8000), i % 2), "PNG")) for i in range(4)]
    out = probe(d3_artifact, tmp_path, {"state": "x", "images": urls, "questions": NOUL})
    assert out.get("status") == 413 and "--max-request-pixels" in out["message"], out
    assert out["peak_increase_mb"] < 1024, out


def test_a_huge_video_frame_is_refused_from_the_container(d3_artifact, tmp_path):
    import cv2
    import numpy as np

    path = tmp_path / "huge.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 2, (4000, 4000))
    for i in range(8):
        writer.write(np.full((4000, 4000, 3), i * 20, np.uint8))
    writer.release()
    out = probe(d3_artifact, tmp_path, {"state": "x", "videos": [f"file://{path}"], "questions": NOUL})
    assert out.get("status") == 413 and "--max-video-frame-pixels" in out["message"], out
    assert out["seconds"] < 1.0, out


def test_a_jpeg_frame_video_has_a_bounded_number_of_frames(d3_artifact, tmp_path):
    frame = base64.b64encode(saved(Image.new("RGB", (64, 64), (10, 20, 30)), "JPEG")).decode()
    url = "data:video/jpeg;base64," + ",".join([frame] * 800)
    out = probe(d3_artifact, tmp_path, {"state": "x", "videos": [url], "questions": NOUL})
    assert out.get("status") == 413 and "800 frames" in out["message"] and "--max-jpeg-video-frames" in out["message"]
    assert out["seconds"] < 1.0, out


class Endless(BaseHTTPRequestHandler):
    """An image of 300 MiB with no declared length (an HTTP/1.0 body ends when the connection closes)."""

    protocol_version = "HTTP/1.0"

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        block = b"\0" * (1 << 20)
        try:
            for _ in range(300):
                self.wfile.write(block)
        except OSError:  # the fetch stopped at its cap
            pass

    def log_message(self, *args):
        pass


def test_memory_is_given_back_after_refused_downloads(d3_artifact):
    """Issue 50 item 8: 40 requests whose downloads were refused (413) left the server at 4.55 GB, for good: the
    bytes read came in 64 KiB chunks scattered over the heap, and the refusal's traceback kept them until the
    request ended. Here 16 downloads refused at a 32 MiB cap, 8 at once (256 MiB read at a time): 2 s later the
    server's RSS is within 100 MB of where it began (it kept about 270 MB before)."""
    media = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    media.daemon_threads = True
    threading.Thread(target=media.serve_forever, daemon=True).start()
    body = {"state": "x", "images": [f"http://127.0.0.1:{media.server_address[1]}/big.png"], "questions": NOUL}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(serve_command(d3_artifact, port, "--allow-private-media-hosts", "--no-media-proxy",
                                        "--max-media-bytes", str(32 << 20)),
                          base, 120, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert httpx.post(base + "/v1/systemone", json={"state": "x", "questions": NOUL}, timeout=60).status_code == 200
        start = rss_mb(server.pid)
        with ThreadPoolExecutor(8) as clients:
            codes = list(clients.map(lambda _: httpx.post(base + "/v1/systemone", json=body, timeout=60).status_code,
                                     range(16)))
        time.sleep(2)
        kept = rss_mb(server.pid) - start
    finally:
        server.terminate()
        server.wait(timeout=60)
        media.shutdown()
    assert codes == [413] * 16, codes
    assert kept < 100, kept
