"""A request's media, taken once (decision 6): each distinct URL fetched, decoded and preprocessed once
(concurrently), then run through the vision graph once, whatever the number of questions.

Loading (fetch, decode, preprocess; in the media pool, runtime/media_pool.py) and encoding (the vision graph) are
two steps: every media error is found while loading, before the request takes an inference slot; encoding runs in
the slot. A family's encoder says
which media a request carries, how one is loaded and how its rows come out of the vision graph.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from ..models.request import DecisionRequest
from .deadline import Deadline
from .media_allowance import MediaAllowance
from .media_fetch import FetchPolicy
from .pixel_workers import PixelWorkers
from .session import GraphSession

Item = TypeVar("Item")


@dataclass(frozen=True)
class LoadedMedia(Generic[Item]):
    """A request's media after loading: the keys in request order and one preprocessed item per distinct key."""

    keys: list[Hashable]
    items: dict[Hashable, Item]

    def in_order(self) -> list[Item]:
        return [self.items[key] for key in self.keys]


class MediaEncoder(ABC, Generic[Item]):
    def __init__(self, session: GraphSession, policy: FetchPolicy):
        self.session = session
        self.policy = policy

    @abstractmethod
    def jobs(self, request: DecisionRequest) -> list[tuple[Hashable, str]]:
        """(key, where) of every media input in prompt order; `where` names it in errors ("images[0]")."""

    def url(self, key: Hashable) -> str:
        """The URL a job's key loads (a key is its URL unless the family's encoder says otherwise)."""
        return key if isinstance(key, str) else ""

    def remote(self, key: Hashable) -> bool:
        """Whether a job fetches over the network (http or https), and so may wait on another server."""
        return self.url(key).split(":", 1)[0].strip().lower() in ("http", "https")

    @abstractmethod
    def load_one(self, key: Hashable, where: str, deadline: Deadline, allowance: MediaAllowance,
                 workers: PixelWorkers) -> Item:
        """Fetch, decode and preprocess one input within the request's `deadline` and media budget
        (`allowance`), its pixel work in `workers`; a `DecisionError` naming `where` when it cannot be read
        (runtime/media_pool.py runs it)."""

    @abstractmethod
    def rows(self, item: Item, run_options: Any) -> np.ndarray:
        """The vision graph's rows [n, hidden] of one preprocessed input."""

    def rows_many(self, items: list[Item], run_options: Any) -> list[np.ndarray]:
        """The rows of several inputs (of one request or of several), in order; an encoder whose graph can take
        several inputs in one run shares runs among them, others run them one by one."""
        return [self.rows(item, run_options) for item in items]

    def encode(self, media: LoadedMedia[Item], run_options: Any = None) -> np.ndarray:
        """Rows of every input in prompt order [rows, hidden] float32; each distinct input runs once."""
        return self.encode_many([media], run_options)[0]

    def encode_many(self, medias: list[LoadedMedia[Item]], run_options: Any = None) -> list[np.ndarray]:
        """`encode` for several requests' media at once (the media lane's batch), their vision runs shared where
        `rows_many` shares them."""
        keys = [(m, key) for m, media in enumerate(medias) for key in media.items]
        rows = dict(zip(keys, self.rows_many([medias[m].items[key] for m, key in keys], run_options), strict=True))
        return [np.concatenate([rows[m, key] for key in media.keys]).astype(np.float32, copy=False)  # one copy
                for m, media in enumerate(medias)]
