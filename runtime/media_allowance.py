"""What one request's media may take in all, and its running account: decoded pixels (checked from each image's
header, and each video's frame size times its sampled frames, before anything is decoded) and downloaded bytes.
Per-item limits alone let one request hold 16 images of 178 megapixels, or 16 downloads of 256 MiB. The media being
loaded for all requests together have a server-wide budget too (`ServerMedia`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..models.errors import Unavailable
from .media_errors import MediaTooLarge


@dataclass(frozen=True)
class MediaBudget:
    # 70 megapixels: an image of 8,000 x 8,000, or 32 sampled 1080p frames. A decoded pixel costs about 11 bytes at
    # its peak (the decoder's buffer, RGBA for transparency, RGB, the array), so under 1 GB a request.
    pixels: int = 70_000_000
    download_bytes: int = 256 << 20  # every URL of the request together (each also under --max-media-bytes)
    video_frame_pixels: int = 3840 * 2160  # one frame at most 4K UHD, read from the container before decoding
    jpeg_video_frames: int = 64  # `data:video/jpeg` frames (spec 4.10 does not sample them): twice the 32 sampled
    # Pixels decoded to reach one video's sampled frames (skipped frames are decoded too, see d3/frame_plan.py):
    # about 4,800 1080p or 1,200 4K frames, and seconds of decoding (docs/operations.md, "Bounds under hostile load").
    video_decode_pixels: int = 10_000_000_000
    # What the media being loaded for all requests together may take at once: two requests' worth, so concurrent
    # requests cannot multiply the per-request bound (8 requests of one 8300x8300 WebP each reached 8.6 GB).
    server_pixels: int = 140_000_000
    server_download_bytes: int = 512 << 20


MEDIA_WORKERS = 8  # threads of each of the media pool's two lanes (runtime/media_pool.py)


@dataclass(frozen=True)
class MediaLimits:
    """Most images and videos one request may carry (vLLM's --limit-mm-per-prompt)."""

    images: int = 16
    videos: int = 4


class MediaAllowance:
    """One request's account against its `MediaBudget`; its media load concurrently, so it is locked."""

    def __init__(self, budget: MediaBudget):
        self.budget = budget
        self._lock = threading.Lock()
        self.pixels = 0
        self.download_bytes = 0

    def take_pixels(self, count: int, where: str, what: str) -> None:
        with self._lock:
            if self.pixels + count > self.budget.pixels:
                raise MediaTooLarge(where, f"{what} ({count:,} pixels) would exceed the {self.budget.pixels:,}-pixel "
                                           "budget of this request (--max-request-pixels)")
            self.pixels += count

    def bytes_left(self) -> int:
        with self._lock:
            return self.budget.download_bytes - self.download_bytes

    def take_bytes(self, count: int, where: str, keep: bool = True) -> None:
        """Count `count` downloaded bytes (`keep=False`: only check that they would fit, as a declared length)."""
        with self._lock:
            if self.download_bytes + count > self.budget.download_bytes:
                raise MediaTooLarge(where, f"downloads would exceed the {self.budget.download_bytes:,}-byte budget "
                                           "of this request (--max-request-media-bytes)")
            if keep:
                self.download_bytes += count

    def give_back_bytes(self, count: int) -> None:
        """Uncount bytes taken for a body that was then cut short (its URL may be tried again)."""
        with self._lock:
            self.download_bytes -= count


class MediaBusy(Unavailable):
    """The server's media budget is held by other requests' media being loaded (503 + Retry-After)."""


class ServerMedia:
    """What the media being loaded for every request together hold: decoded pixels (from the moment an item's
    header is read until its job ends) and downloaded bytes (as they arrive, until the job ends). An item that would
    take either past the server's budget fails its request with a 503 + Retry-After at once, before it decodes or
    reads more; it does not wait (a waiting job would hold a media thread)."""

    def __init__(self, budget: MediaBudget, retry_after_s: int = 1):
        self.budget, self.retry_after_s = budget, retry_after_s
        self._lock = threading.Lock()
        self.pixels = 0
        self.download_bytes = 0

    def take(self, pixels: int, download_bytes: int, where: str) -> None:
        with self._lock:
            if self.pixels + pixels > self.budget.server_pixels:
                raise MediaBusy(f"{where}: the media of requests being loaded hold {self.pixels:,} decoded pixels; "
                                f"this one's {pixels:,} would pass the server's {self.budget.server_pixels:,} "
                                "(--max-server-media-pixels); retry later", self.retry_after_s)
            if self.download_bytes + download_bytes > self.budget.server_download_bytes:
                raise MediaBusy(f"{where}: the media of requests being loaded hold {self.download_bytes:,} "
                                f"downloaded bytes; more would pass the server's {self.budget.server_download_bytes:,}"
                                " (--max-server-media-bytes); retry later", self.retry_after_s)
            self.pixels += pixels
            self.download_bytes += download_bytes

    def give_back(self, pixels: int, download_bytes: int) -> None:
        with self._lock:
            self.pixels -= pixels
            self.download_bytes -= download_bytes


class JobAllowance(MediaAllowance):
    """One media item's job: its takes go to its request's account and to the server's (`ServerMedia`), and what
    it took of the server's is given back when the job ends (`close`)."""

    def __init__(self, request: MediaAllowance, server: ServerMedia):
        super().__init__(request.budget)
        self.request, self.server = request, server

    def take_pixels(self, count: int, where: str, what: str) -> None:
        self.request.take_pixels(count, where, what)
        self.server.take(count, 0, where)
        with self._lock:
            self.pixels += count

    def bytes_left(self) -> int:
        return self.request.bytes_left()

    def take_bytes(self, count: int, where: str, keep: bool = True) -> None:
        self.request.take_bytes(count, where, keep)
        if keep:
            self.server.take(0, count, where)
            with self._lock:
                self.download_bytes += count

    def give_back_bytes(self, count: int) -> None:
        self.request.give_back_bytes(count)
        self.server.give_back(0, count)
        with self._lock:
            self.download_bytes -= count

    def close(self) -> None:
        """The job has ended: its decoded pixels and downloads are given back to the server's budget."""
        with self._lock:
            pixels, download_bytes, self.pixels, self.download_bytes = self.pixels, self.download_bytes, 0, 0
        self.server.give_back(pixels, download_bytes)
