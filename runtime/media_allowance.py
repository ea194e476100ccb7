"""What one request's media may take in all, and its running account: decoded pixels (checked from each image's
header, and each video's frame size times its sampled frames, before anything is decoded) and downloaded bytes.
Per-item limits alone let one request hold 16 images of 178 megapixels, or 16 downloads of 256 MiB."""

from __future__ import annotations

import threading
from dataclasses import dataclass

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
    # about 4,800 1080p or 1,200 4K frames, and seconds of decoding (README: bounds under hostile load).
    video_decode_pixels: int = 10_000_000_000


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
