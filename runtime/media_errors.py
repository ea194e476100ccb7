"""A media input the server will not take: each error names its place in the request ("images[1]") and maps to a
4xx (decision 1)."""

from __future__ import annotations

from ..models.errors import DecisionError, TooLarge, Unreadable


class MediaError(DecisionError):
    """A media input the server will not take; `where` names it ("images[0]")."""

    def __init__(self, where: str, message: str, param: str | None = None):
        super().__init__(f"media: {where}: {message}", param=param)


class MediaTooLarge(MediaError, TooLarge):
    pass


class MediaUnreadable(MediaError, Unreadable):
    """Well-formed but cannot be fetched or decoded (decision 1: a 4xx, where vLLM answers 5xx)."""

    def __init__(self, where: str, message: str):
        super().__init__(where, message, param="image_url")
