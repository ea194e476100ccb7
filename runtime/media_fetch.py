"""Fetching a request's media URLs, safe by default (spec 6.1; decisions 1 and 6).

http(s) and base64 `data:` URLs; `file://` only under an allowed directory; hosts that resolve to private,
loopback, link-local or otherwise non-public addresses are refused unless allowed, checked on the address actually
connected to and again on every redirect; optional exact-hostname allow-list; timeouts; a download cap. Every
failure is a 4xx `MediaError` whose message names the URL's place in the request (`images[1]`).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import socket
import ssl
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urljoin, urlsplit

from ..models.errors import DecisionError, TooLarge, Unreadable

K = TypeVar("K")
T = TypeVar("T")
USER_AGENT = "systemone-onnx"
MAX_REDIRECTS = 5


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


@dataclass(frozen=True)
class FetchPolicy:
    allowed_local_path: Path | None = None
    allowed_domains: frozenset[str] | None = None
    allow_private_hosts: bool = False
    image_timeout_s: float = 5.0
    video_timeout_s: float = 30.0
    max_bytes: int = 256 << 20


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _read_capped(stream, limit: int, where: str, declared: int | None = None) -> bytes:
    if declared is not None and declared > limit:
        raise MediaTooLarge(where, f"download is larger than the {limit}-byte limit (--max-media-bytes)")
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise MediaTooLarge(where, f"download is larger than the {limit}-byte limit (--max-media-bytes)")
    return data


def _data_url(url: str, where: str, limit: int) -> bytes:
    if "," not in url:
        raise MediaError(where, f"Invalid data URL {url[:32]!r}: missing ',' separator.")
    header, payload = url.split(",", 1)
    if not header.lower().endswith(";base64"):
        raise MediaError(where, "Only base64 data URLs are supported for now.")
    if len(payload) > (limit * 4) // 3 + 4:
        raise MediaTooLarge(where, f"data URL is larger than the {limit}-byte limit (--max-media-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(where, f"invalid base64 in data URL: {exc}") from None


def _local_file(url: str, where: str, policy: FetchPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError(where, "Cannot load local files without `--allowed-local-media-path`.")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(where, "file URLs must name a local path (file:///...)")
    root = policy.allowed_local_path.resolve()
    path = Path(parts.path).resolve()
    if not path.is_relative_to(root):
        raise MediaError(where, "The file path must be a subpath of `--allowed-local-media-path`.")
    if not path.is_file():
        raise MediaUnreadable(where, "no such file under `--allowed-local-media-path`")
    with open(path, "rb") as f:
        return _read_capped(f, policy.max_bytes, where)


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to an already vetted address, whatever the name resolves to by then (no DNS rebinding)."""

    def __init__(self, host: str, address: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, address: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)


def _vetted_address(host: str, port: int, where: str, policy: FetchPolicy) -> str:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise MediaUnreadable(where, f"Failed to fetch media from URL: cannot resolve host {host!r} ({exc})"
                              ) from None
    addresses = [info[4][0] for info in infos]
    if not policy.allow_private_hosts:
        refused = [a for a in addresses if not _public(a)]
        if refused:
            raise MediaError(where, f"host {host!r} resolves to a non-public address ({refused[0]}); such hosts are "
                                    "refused unless --allow-private-media-hosts")
    return addresses[0]


def _http(url: str, where: str, timeout: float, policy: FetchPolicy) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        host = parts.hostname
        if not host:
            raise MediaUnreadable(where, "Failed to fetch media from URL: Invalid URL")
        if policy.allowed_domains is not None and host not in policy.allowed_domains:
            raise MediaError(where, f"The URL must be from one of the allowed domains: "
                                    f"{sorted(policy.allowed_domains)}. Input URL domain: {host}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise MediaUnreadable(where, "Failed to fetch media from URL: Invalid URL") from None
        address = _vetted_address(host, port, where, policy)
        connection_class = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        connection = connection_class(host, address, port, timeout)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        try:
            connection.request("GET", target, headers={"User-Agent": USER_AGENT, "Accept": "*/*"})
            response = connection.getresponse()
            if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                url = urljoin(url, response.getheader("Location"))
                if urlsplit(url).scheme not in ("http", "https"):
                    raise MediaError(where, "redirected to a URL that is not http(s)")
                continue
            if response.status >= 400:
                raise MediaUnreadable(where, f"Failed to fetch media from URL: HTTP {response.status} error")
            length = response.getheader("Content-Length")
            declared = int(length) if length and length.isdigit() else None
            return _read_capped(response, policy.max_bytes, where, declared)
        except (OSError, http.client.HTTPException) as exc:
            raise MediaUnreadable(where, f"Failed to fetch media from URL: {type(exc).__name__}: {exc}") from None
        finally:
            connection.close()
    raise MediaUnreadable(where, f"Failed to fetch media from URL: more than {MAX_REDIRECTS} redirects")


def fetch(url: str, where: str, kind: str, policy: FetchPolicy) -> bytes:
    """The bytes behind one media URL of the request (`where` names it, e.g. "images[0]")."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, where, policy.max_bytes)
    if scheme == "file":
        return _local_file(url, where, policy)
    if scheme in ("http", "https"):
        timeout = policy.video_timeout_s if kind == "video" else policy.image_timeout_s
        return _http(url, where, timeout, policy)
    raise MediaError(where, "The URL must be either a HTTP, data or file URL.")


def load_each_once(jobs: Sequence[tuple[K, str]], read: Callable[[K, str], T], workers: int = 8) -> dict[K, T]:
    """Each distinct key of `jobs` ((key, where) in request order) read once, concurrently, named by the first
    place it stands (decision 6: the same URL twice is fetched and decoded once)."""
    first: dict[K, str] = {}
    for key, where in jobs:
        first.setdefault(key, where)
    with ThreadPoolExecutor(max_workers=min(workers, max(1, len(first)))) as pool:
        return dict(zip(first, pool.map(lambda key: read(key, first[key]), first)))
