"""Fetching a request's media URLs, safe by default (spec 6.1; decisions 1 and 6).

http(s) and base64 `data:` URLs; `file://` only under an allowed directory; hosts that resolve to private,
loopback, link-local or otherwise non-public addresses are refused unless allowed (IPv6 forms that embed an IPv4
address are judged by that address), checked on the address actually connected to and again on every redirect;
optional exact-hostname allow-list; a download cap. Each http(s) fetch has an overall deadline (name resolution,
connect, headers and body together: --image-fetch-timeout, --video-fetch-timeout) within the request's, and stops at
once when its request is abandoned. A failure worth another try (HTTP 5xx, a connection refused or cut, a name
lookup that failed for now) is tried again after 1 s, then 4 s, as vLLM does, while the request has the time; a
fetch that ran out of its own time is not (docs/spec.md 6.1, "Ours"). Every failure is a 4xx
`MediaError` whose message names the URL's place in the request (`images[1]`); only the request's own deadline is a
503.
"""

from __future__ import annotations

import binascii
import http.client
import ipaddress
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, urljoin, urlsplit

import pybase64

from ..models.errors import TimedOut, Unavailable
from .deadline import Deadline
from .media_allowance import MediaAllowance
from .media_errors import MediaError, MediaTooLarge, MediaUnreadable  # noqa: F401 - callers import them from here too
from .media_proxy import MediaProxy, ProxySettings

USER_AGENT = "systemone-onnx"
MAX_REDIRECTS = 5
READ_CHUNK = 64 << 10
# IPv6 ranges that carry an IPv4 address in their last 32 bits (IPv4-translated SIIT, the NAT64 well-known prefix):
# on a NAT64/SIIT network they reach that IPv4 address, so they are judged by it, 64:ff9b:: itself by 0.0.0.0.
_EMBEDS_IPV4_LOW32 = tuple(ipaddress.ip_network(n) for n in ("::ffff:0:0:0/96", "64:ff9b::/96"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated; :: and ::1 are not among its IPv4 addresses
# Never a media server, whatever Python's table says: 192.0.0.0/24 is for protocol assignments (its anycast
# 192.0.0.9 and 192.0.0.10 count as global there), and the NAT64 local-use prefix 64:ff9b:1::/48 may embed an IPv4
# address at any of RFC 6052's offsets, which the network alone knows.
_NEVER_PUBLIC = tuple(ipaddress.ip_network(n) for n in ("192.0.0.0/24", "64:ff9b:1::/48"))


def system_resolver(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, as the operating system's resolver answers (it may block for long)."""
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


class LookupSlots:
    """At most `size` name lookups at once, those still running after their fetch gave up included: a resolver
    that stops answering holds `size` threads, not one per request."""

    def __init__(self, size: int = 16):
        self.size = size
        self._free = threading.BoundedSemaphore(size)

    def take(self, host: str) -> None:
        if not self._free.acquire(blocking=False):
            raise Unavailable(f"cannot resolve host {host!r} now: all {self.size} name lookups are still waiting "
                              "for the resolver; retry later", retry_after_s=5)

    def give_back(self) -> None:
        self._free.release()


@dataclass(frozen=True)
class FetchPolicy:
    allowed_local_path: Path | None = None
    allowed_domains: frozenset[str] | None = None
    allow_private_hosts: bool = False
    image_timeout_s: float = 5.0  # a whole image fetch (connect, headers, body), as vLLM's VLLM_IMAGE_FETCH_TIMEOUT
    video_timeout_s: float = 30.0  # a whole video fetch, as VLLM_VIDEO_FETCH_TIMEOUT
    max_bytes: int = 256 << 20
    attempts: int = 3  # tries of a URL whose failure is worth another (vLLM's VLLM_MEDIA_FETCH_MAX_RETRIES)
    retry_pause_s: float = 1.0  # before the second try; each later pause is four times the one before (vLLM's)
    proxies: ProxySettings = field(default_factory=ProxySettings)  # none unless given (the CLI reads the environment)
    resolver: Callable[[str, int], list[str]] = system_resolver  # host, port -> addresses
    lookups: LookupSlots = field(default_factory=LookupSlots, compare=False)  # the resolver's threads, bounded

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts: must be at least 1, got {self.attempts}")


class _Transient(MediaUnreadable):
    """A failed try that another may get past: HTTP 5xx, a connection refused or cut, a lookup failed for now."""

    def __init__(self, where: str, reason: str):
        super().__init__(where, reason)
        self.reason = reason


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped:
        return ip.ipv4_mapped
    if ip.sixtofour:
        return ip.sixtofour
    if ip.teredo:
        return ip.teredo[1]
    low32 = int(ip) & 0xFFFFFFFF
    if any(ip in network for network in _EMBEDS_IPV4_LOW32) or (ip in _IPV4_COMPATIBLE and low32 > 1):
        return ipaddress.IPv4Address(low32)
    return None


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if any(ip.version == network.version and ip in network for network in _NEVER_PUBLIC):
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.is_site_local:  # fec0::/10, deprecated (RFC 3879) but still routed inside some sites
            return False
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            return _public(str(embedded))
    return ip.is_global and not ip.is_multicast


def _split(url: str, where: str) -> SplitResult:
    """urlsplit, with the port and host checked (a bad bracketed host or port is the client's 400)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
        return parts
    except ValueError as exc:
        raise MediaError(where, f"Invalid URL: {exc}") from None


def _too_large(where: str, limit: int) -> MediaTooLarge:
    return MediaTooLarge(where, f"download is larger than the {limit}-byte limit (--max-media-bytes)")


def _read_capped(stream, limit: int, where: str) -> bytes:
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise _too_large(where, limit)
    return data


def _data_url(url: str, where: str, limit: int) -> bytes:
    if "," not in url:
        raise MediaError(where, f"Invalid data URL {url[:32]!r}: missing ',' separator.")
    header, payload = url.split(",", 1)
    if not header.lower().endswith(";base64"):
        raise MediaError(where, "Only base64 data URLs are supported for now.")
    if len(payload) > (limit * 4) // 3 + 4:
        raise MediaTooLarge(where, f"data URL is larger than the {limit}-byte limit (--max-media-bytes)")
    return base64_bytes(payload, where, "data URL")


def base64_bytes(payload: str, where: str, what: str) -> bytes:
    """Strict base64 as vLLM reads it (pybase64; docs/spec.md, 6.1's table of media errors): no character outside
    the alphabet, no padding past the last group (the standard library's strict mode accepts extra `=`). Its SIMD
    decoder reads the 3.2 MB data URL of a 1024x1024 PNG in 0.2 ms; the standard library's took 6.7 (two cores)."""
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(where, f"invalid base64 in {what}: {exc}") from None


def _local_file(url: str, where: str, policy: FetchPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError(where, "Cannot load local files without `--allowed-local-media-path`.")
    parts = _split(url, where)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(where, "file URLs must name a local path (file:///...)")
    root = policy.allowed_local_path.resolve()
    try:
        path = Path(parts.path).resolve()
        if not path.is_relative_to(root):
            raise MediaError(where, "The file path must be a subpath of `--allowed-local-media-path`.")
        if not path.is_file():
            raise MediaUnreadable(where, "no such file under `--allowed-local-media-path`")
        with open(path, "rb") as f:
            return _read_capped(f, policy.max_bytes, where)
    except ValueError:  # a NUL byte in the path
        raise MediaError(where, "the file path is not valid (it holds a NUL byte)") from None
    except OSError as exc:  # a name too long for the file system, a directory that cannot be read
        raise MediaError(where, f"the file path cannot be read: {exc.strerror or type(exc).__name__}") from None


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to an already vetted address, whatever the name resolves to by then (no DNS rebinding)."""

    def __init__(self, host: str, address: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = self._connected = socket.create_connection((self._address, self.port), self.timeout)

    def abort(self) -> None:
        """Wake a read blocked in another thread (close alone does not interrupt a blocked recv). The socket kept
        at connect: after an HTTP/1.0 or `Connection: close` response the connection drops `self.sock` while its
        response still reads from it."""
        if getattr(self, "_connected", None) is not None:
            self._connected.shutdown(socket.SHUT_RDWR)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """The same over TLS; through a proxy (`set_tunnel`), `host` and `address` are the proxy's and the TLS session is
    the URL host's, inside the proxy's CONNECT tunnel."""

    def __init__(self, host: str, address: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        self._connected = raw  # shut down under TLS, so a read blocked in the TLS layer wakes too
        self.sock = raw
        if self._tunnel_host:
            self._tunnel()
        # Python 3.11 keeps an IPv6 tunnel host in brackets (3.12 does not); TLS takes it bare.
        self.sock = self._context.wrap_socket(raw, server_hostname=(self._tunnel_host or self.host).strip("[]"))

    def abort(self) -> None:
        if getattr(self, "_connected", None) is not None:
            self._connected.shutdown(socket.SHUT_RDWR)


def _resolve(host: str, port: int, where: str, policy: FetchPolicy, fetch_deadline: Deadline) -> list[str]:
    """The resolver's answer within the fetch's deadline. A lookup cannot be interrupted, so it runs in a thread of
    its own and is waited for no longer than the deadline; a late one is left to end alone (the resolver's own
    timeout ends it), its answer dropped, and it holds one of the policy's lookup slots until then."""
    done, answer = threading.Event(), {}

    def lookup() -> None:
        try:
            answer["addresses"] = policy.resolver(host, port)
        except Exception as exc:  # noqa: BLE001 - handed to the fetch's thread below
            answer["error"] = exc
        finally:
            policy.lookups.give_back()
            done.set()

    policy.lookups.take(host)
    unregister = fetch_deadline.on_cancel(done.set)
    threading.Thread(target=lookup, name="systemone-resolve", daemon=True).start()
    try:
        while not done.is_set() and not fetch_deadline.expired():
            done.wait(min(fetch_deadline.remaining(), 1.0))
    finally:
        unregister()
    fetch_deadline.check()
    error = answer.get("error")
    if isinstance(error, (socket.gaierror, UnicodeError)):
        failure = _Transient if getattr(error, "errno", None) == socket.EAI_AGAIN else MediaUnreadable
        raise failure(where, f"Failed to fetch media from URL: cannot resolve host {host!r} ({error})") from None
    if error is not None:
        raise error
    return answer["addresses"]


def _vetted_address(host: str, port: int, where: str, policy: FetchPolicy, fetch_deadline: Deadline
                    ) -> str:
    addresses = _resolve(host, port, where, policy, fetch_deadline)
    if not addresses:
        raise MediaUnreadable(where, f"Failed to fetch media from URL: cannot resolve host {host!r}")
    if not policy.allow_private_hosts:
        refused = [a for a in addresses if not _public(a)]
        if refused:
            raise _private_host(where, host, f"resolves to a non-public address ({refused[0]})")
    return addresses[0]


def _private_host(where: str, host: str, why: str) -> MediaError:
    return MediaError(where, f"host {host!r} {why}; such hosts are refused unless --allow-private-media-hosts")


def _bracketed(host: str) -> str:
    """A host as a URL or CONNECT line writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _vet_proxied_host(host: str, where: str, policy: FetchPolicy) -> None:
    """What can be judged of a host the proxy resolves: an IP literal by its address (the legacy IPv4 forms too,
    `127.1` or `2130706433`, which a proxy's resolver may read as addresses), `localhost` by its name."""
    if policy.allow_private_hosts:
        return
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        raise _private_host(where, host, "is a loopback name")
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        try:
            address = socket.inet_ntoa(socket.inet_aton(host))
        except (OSError, UnicodeError, ValueError):
            return  # a name: the proxy's to resolve
    if not _public(address):
        raise _private_host(where, host, "is a non-public address")


def _connection(parts: SplitResult, host: str, port: int, where: str, policy: FetchPolicy, fetch_deadline: Deadline,
                proxy: MediaProxy | None) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """The connection for one hop, the request target and the headers to send. Directly: to the host's vetted
    address. Through a proxy: an http URL is asked of the proxy by its absolute form, an https one through a CONNECT
    tunnel. Each socket operation waits at most what is left of the fetch's deadline."""
    timeout = fetch_deadline.bound(fetch_deadline.seconds)
    target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
    headers = {"User-Agent": USER_AGENT, "Accept": "*/*"}
    if proxy is None:
        address = _vetted_address(host, port, where, policy, fetch_deadline)
        connection_class = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        return connection_class(host, address, port, timeout), target, headers
    _vet_proxied_host(host, where, policy)
    try:  # the operator's proxy: its address is not vetted, and not named to the client
        address = _resolve(proxy.host, proxy.port, where, policy, fetch_deadline)[0]
    except MediaUnreadable as exc:
        failure = _Transient if isinstance(exc, _Transient) else MediaUnreadable
        raise failure(where, "Failed to fetch media from URL: the server's proxy cannot be resolved") from None
    if parts.scheme == "https":
        connection = _PinnedHTTPSConnection(proxy.host, address, proxy.port, timeout)
        connection.set_tunnel(_bracketed(host), port, headers=proxy.headers())
        return connection, target, headers
    netloc = _bracketed(host) + (f":{port}" if port != 80 else "")
    absolute = f"http://{netloc}{target}"
    return _PinnedHTTPConnection(proxy.host, address, proxy.port, timeout), absolute, headers | proxy.headers()


def _read_body(response: http.client.HTTPResponse, limit: int, where: str,
               allowance: MediaAllowance | None = None) -> bytes:
    """The body in chunks as they come (read1), so a fetch cut off by its deadline returns at once. A declared
    length over either cap is refused before the body is read; otherwise no read asks for more than one byte past
    what the URL's cap and the request's budget still allow."""
    length = response.getheader("Content-Length")
    declared = int(length) if length and length.isdigit() else None
    if declared is not None:
        if declared > limit:
            raise _too_large(where, limit)
        if allowance is not None:
            allowance.take_bytes(declared, where, keep=False)
    # One buffer grown in place: past 1 MiB glibc maps it apart and unmaps it when it is freed, where a list of
    # 64 KiB chunks was scattered over the heap and stayed resident (40 downloads refused at 256 MiB left the
    # server at 5.3 GB).
    body, taken = bytearray(), 0
    try:
        while True:
            room = limit - len(body) if allowance is None else min(limit - len(body), allowance.bytes_left())
            chunk = response.read1(min(READ_CHUNK, max(room, 0) + 1))
            if not chunk:
                break
            if len(body) + len(chunk) > limit:
                raise _too_large(where, limit)
            if allowance is not None:
                allowance.take_bytes(len(chunk), where)
                taken += len(chunk)
            body += chunk
        if declared is not None and len(body) < declared:  # http.client ends such a body quietly
            raise _Transient(where, f"Failed to fetch media from URL: the connection closed after {len(body):,} "
                                    f"of {declared:,} bytes")
    except BaseException:
        # Freed now, not when the error is: the error's traceback keeps this frame, and so the buffer, for as
        # long as the request holds the error.
        body.clear()
        if allowance is not None:  # a body cut short is not downloaded: a retry's bytes count once
            allowance.give_back_bytes(taken)
        raise
    return bytes(body)


def _get(url: str, where: str, policy: FetchPolicy, fetch_deadline: Deadline,
         allowance: MediaAllowance | None = None) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        parts = _split(url, where)
        host = parts.hostname
        if not host:
            raise MediaUnreadable(where, "Failed to fetch media from URL: Invalid URL")
        if policy.allowed_domains is not None and host not in policy.allowed_domains:
            raise MediaError(where, f"The URL must be from one of the allowed domains: "
                                    f"{sorted(policy.allowed_domains)}. Input URL domain: {host}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        proxy = policy.proxies.for_url(parts.scheme, host)
        via = " (through the server's proxy)" if proxy else ""  # not its address: clients read this
        connection, target, headers = _connection(parts, host, port, where, policy, fetch_deadline, proxy)
        # The deadline's cancel (its timer, or the request abandoned) shuts the socket down, so a server that drips
        # bytes cannot hold on.
        unregister = fetch_deadline.on_cancel(connection.abort)
        try:
            connection.request("GET", target, headers=headers)
            response = connection.getresponse()
            if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                try:
                    url = urljoin(url, response.getheader("Location"))
                except ValueError as exc:
                    raise MediaError(where, f"redirected to an invalid URL: {exc}") from None
                if _split(url, where).scheme not in ("http", "https"):
                    raise MediaError(where, "redirected to a URL that is not http(s)")
                continue
            if response.status >= 400:
                failure = _Transient if response.status >= 500 else MediaUnreadable  # 408, 429: not tried again
                raise failure(where, f"Failed to fetch media from URL: HTTP {response.status} error{via}")
            data = _read_body(response, policy.max_bytes, where, allowance)
            fetch_deadline.check()  # a body cut short by the deadline is not an answer
            return data
        except _Transient:
            fetch_deadline.check()  # a body cut short by the deadline: its time is up, not worth another try
            raise
        except (OSError, http.client.HTTPException) as exc:
            fetch_deadline.check()
            # A certificate that does not verify, or a socket's own timeout, will be the same on the next try.
            # So will a proxy's refusal of the tunnel, unless it is its 5xx.
            failure = (MediaUnreadable if isinstance(exc, (ssl.SSLCertVerificationError, TimeoutError))
                       or _refused_tunnel(exc) else _Transient)
            raise failure(where, f"Failed to fetch media from URL: {type(exc).__name__}: {exc}{via}") from None
        finally:
            unregister()
            connection.close()
    raise MediaUnreadable(where, f"Failed to fetch media from URL: more than {MAX_REDIRECTS} redirects")


def _refused_tunnel(exc: Exception) -> bool:
    """http.client's error for a CONNECT the proxy answered with a status other than 200 below 500."""
    words = str(exc).split()
    return (str(exc).startswith("Tunnel connection failed: ") and len(words) > 3 and words[3].isdigit()
            and int(words[3]) < 500)


def _pause(seconds: float, deadline: Deadline) -> None:
    """Wait `seconds`, or until the request is abandoned (then `TimedOut`)."""
    woken = threading.Event()
    unregister = deadline.on_cancel(woken.set)
    try:
        woken.wait(seconds)
    finally:
        unregister()
    deadline.check()


def _http(url: str, where: str, total_s: float, flag: str, policy: FetchPolicy, deadline: Deadline,
          allowance: MediaAllowance | None = None) -> bytes:
    """GET, tried again after a `_Transient` failure while tries are left and the request's deadline is past the
    pause. A try that runs out of its time is not tried again: each try has the whole `total_s`, and another would
    hold a media worker that long again."""
    attempt = 1
    while True:
        try:
            return _try(url, where, total_s, flag, policy, deadline, allowance)
        except _Transient as failure:
            pause = policy.retry_pause_s * 4 ** (attempt - 1)
            if attempt == policy.attempts or deadline.remaining() <= pause:
                if attempt == 1:
                    raise
                raise MediaUnreadable(where, f"{failure.reason} ({attempt} tries, --media-fetch-attempts)"
                                      ) from None
        _pause(pause, deadline)
        attempt += 1


def _try(url: str, where: str, total_s: float, flag: str, policy: FetchPolicy, deadline: Deadline,
         allowance: MediaAllowance | None = None) -> bytes:
    """GET within `total_s` (connect, redirects, headers, body), or less if the request's deadline is nearer."""
    deadline.check()
    fetch_deadline = Deadline(min(total_s, deadline.remaining()))
    unlink = deadline.on_cancel(fetch_deadline.cancel)
    timer = threading.Timer(fetch_deadline.seconds, fetch_deadline.cancel)
    timer.daemon = True
    timer.start()
    try:
        return _get(url, where, policy, fetch_deadline, allowance)
    except TimedOut:
        deadline.check()  # the request's own deadline: 503
        raise MediaUnreadable(where, f"Failed to fetch media from URL: not done within {total_s:g} s ({flag})"
                              ) from None
    finally:
        timer.cancel()
        unlink()


def fetch(url: str, where: str, kind: str, policy: FetchPolicy, deadline: Deadline | None = None,
          allowance: MediaAllowance | None = None) -> bytes:
    """The bytes behind one media URL of the request (`where` names it, e.g. "images[0]"), within the request's
    `deadline` (none: only the fetch's own) and its download budget (`allowance`, a MediaAllowance)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("data", "file"):
        data = _data_url(url, where, policy.max_bytes) if scheme == "data" else _local_file(url, where, policy)
        if allowance is not None:
            allowance.take_bytes(len(data), where)
        return data
    if scheme in ("http", "https"):
        total, flag = ((policy.video_timeout_s, "--video-fetch-timeout") if kind == "video"
                       else (policy.image_timeout_s, "--image-fetch-timeout"))
        return _http(url, where, total, flag, policy, deadline or Deadline(), allowance)
    raise MediaError(where, "The URL must be either a HTTP, data or file URL.")
