"""Safe media fetching (spec 6.1; decisions 1 and 6): every failure is a 4xx that names
the URL's place in the request; private hosts, local files and oversized downloads are refused by default."""

from __future__ import annotations

import base64
import http.client
import threading
import time

import pytest

from systemone.models.errors import TimedOut
from systemone.runtime import media_fetch
from systemone.runtime.deadline import Deadline
from systemone.runtime.media_allowance import MediaAllowance, MediaBudget
from systemone.runtime.media_decode import decode_image
from systemone.runtime.media_fetch import FetchPolicy, MediaError, fetch
from systemone.runtime.media_proxy import ProxySettings
from systemone.server.errors import http_status
from tests.media_helpers import TLS_CERTIFICATE, CountingServer, ForwardProxy, png_file, test_images

PNG = test_images()["tiny-50x50.png"]


def refused(url, policy=FetchPolicy(), status=400, kind="image"):
    with pytest.raises(MediaError) as info:
        fetch(url, "images[2]", kind, policy)
    assert http_status(info.value)[0] == status, info.value.message
    assert info.value.message.startswith("media: images[2]: ")
    return info.value.message


def test_base64_data_urls_are_read():
    assert fetch("data:image/png;base64," + base64.b64encode(PNG).decode(), "images[0]", "image", FetchPolicy()) == PNG
    assert fetch("DATA:whatever;BASE64," + base64.b64encode(b"x").decode(), "i", "image", FetchPolicy()) == b"x"


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64AAAA", "Invalid data URL 'data:image/png;base64AAAA': missing ',' separator."),
    ("data:image/png,AAAA", "Only base64 data URLs are supported for now."),
    ("data:image/png;base64,@@@", "invalid base64 in data URL"),
    ("data:image/png;base64,QUJD\nRA==", "invalid base64 in data URL"),  # strict: no line breaks
    ("data:image/png;base64,QUJD====", "invalid base64 in data URL"),  # nor padding past the last group
    ("ftp://x/y.png", "The URL must be either a HTTP, data or file URL."),
    ("/etc/passwd", "The URL must be either a HTTP, data or file URL."),
    ("file:///etc/passwd", "Cannot load local files without `--allowed-local-media-path`."),
])
def test_malformed_and_unsupported_urls_are_400_not_5xx(url, message):
    """decision 1: vLLM's 501 (non-base64 data URL) and 500 (file:// without a path) become 400."""
    assert message in refused(url)


def test_local_files_only_under_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    policy = FetchPolicy(allowed_local_path=allowed)
    assert fetch(f"file://{allowed}/a.png", "images[0]", "image", policy) == PNG
    assert "must be a subpath" in refused(f"file://{allowed}/../secret.png", policy)
    assert "no such file" in refused(f"file://{allowed}/missing.png", policy, status=422)


def test_loopback_and_private_hosts_are_refused_by_default():
    server = CountingServer({"a.png": PNG})
    with server.running():
        assert "non-public address (127.0.0.1)" in refused(f"{server.url}/a.png")
        assert fetch(f"{server.url}/a.png", "i", "image", FetchPolicy(allow_private_hosts=True)) == PNG
    assert server.gets == {"a.png": 1}  # the refused one never connected
    for host in ("10.0.0.1", "169.254.169.254", "[::1]", "192.168.1.1", "0.0.0.0"):
        assert "non-public address" in refused(f"http://{host}/x.png")


def test_redirects_are_checked_again(monkeypatch):
    """A public host that redirects to a private one is refused at the redirect."""
    monkeypatch.setattr(media_fetch, "_public", lambda address: address == "127.0.0.1")
    target = CountingServer({"a.png": PNG})
    with target.running():
        port = target.url.rsplit(":", 1)[1]
        redirector = CountingServer({}, {"go": f"http://127.0.0.2:{port}/a.png"})
        with redirector.running():
            assert "non-public address (127.0.0.2)" in refused(f"{redirector.url}/go")
    assert target.gets == {}


def test_allowed_domains_are_exact_and_rechecked_on_redirect():
    server = CountingServer({"a.png": PNG}, {"go": "http://localhost:1/a.png"})
    policy = FetchPolicy(allowed_domains=frozenset({"127.0.0.1"}), allow_private_hosts=True)
    with server.running():
        assert fetch(f"{server.url}/a.png", "i", "image", policy) == PNG
        assert "Input URL domain: localhost" in refused(f"{server.url}/go", policy)
    assert "allowed domains" in refused("http://example.com/a.png", policy)


def test_http_errors_and_unreachable_hosts_are_422():
    server = CountingServer({})
    policy = FetchPolicy(allow_private_hosts=True, retry_pause_s=0.01)
    with server.running():
        assert "HTTP 404 error" in refused(f"{server.url}/missing.png", policy, status=422)
    assert "Failed to fetch media" in refused(server.url + "/gone.png", policy, status=422)
    assert "cannot resolve host" in refused("http://no-such-host.invalid/a.png", policy, status=422)


# -- a failure worth another try (spec 6.1; docs/spec.md 6.1, "Ours") -------------------------------------------------
def retrying(attempts: int = 3, pause_s: float = 0.05, **more) -> FetchPolicy:
    return FetchPolicy(allow_private_hosts=True, attempts=attempts, retry_pause_s=pause_s, **more)


@pytest.mark.parametrize("failures", [[503, 500], ["drop", "drop"], ["short", 502]])
def test_a_5xx_or_a_connection_cut_is_tried_again_after_pauses_growing_fourfold(failures):
    server = CountingServer({"a.png": PNG}, failures={"a.png": failures})
    with server.running():
        start = time.monotonic()
        assert fetch(f"{server.url}/a.png", "images[0]", "image", retrying()) == PNG
        seconds = time.monotonic() - start
    assert server.gets["a.png"] == 3
    assert seconds >= 0.05 + 0.2


def test_a_url_that_keeps_failing_is_a_422_naming_its_tries():
    server = CountingServer({"a.png": PNG}, failures={"a.png": [500] * 5})
    with server.running():
        message = refused(f"{server.url}/a.png", retrying(pause_s=0.01), status=422)
    assert message == ("media: images[2]: Failed to fetch media from URL: HTTP 500 error "
                       "(3 tries, --media-fetch-attempts)")
    assert server.gets["a.png"] == 3


@pytest.mark.parametrize("status", [404, 408, 429])
def test_other_4xx_and_vllms_two_exceptions_408_and_429_are_not_tried_again(status):
    server = CountingServer({"a.png": PNG}, failures={"a.png": [status]})
    with server.running():
        assert refused(f"{server.url}/a.png", retrying(), status=422).endswith(f"HTTP {status} error")
    assert server.gets["a.png"] == 1


def test_a_try_that_runs_out_of_its_time_is_not_repeated():
    """Each try has the whole --image-fetch-timeout: another would hold a media worker that long again."""
    server = CountingServer({"a.png": PNG}, failures={"a.png": ["stall"]})
    with server.running():
        message = refused(f"{server.url}/a.png", retrying(image_timeout_s=0.3), status=422)
    assert message.endswith("not done within 0.3 s (--image-fetch-timeout)") and server.gets["a.png"] == 1


def test_one_try_when_attempts_is_one():
    server = CountingServer({"a.png": PNG}, failures={"a.png": [503]})
    with server.running():
        assert refused(f"{server.url}/a.png", retrying(attempts=1), status=422).endswith("HTTP 503 error")
    assert server.gets["a.png"] == 1
    with pytest.raises(ValueError, match="attempts: must be at least 1, got 0"):
        FetchPolicy(attempts=0)


def test_no_pause_runs_past_the_requests_deadline():
    """A pause of 1 s with 0.5 s left: the failure is answered at once (422), not the request's timeout (503)."""
    server = CountingServer({"a.png": PNG}, failures={"a.png": [503] * 3})
    with server.running():
        start = time.monotonic()
        with pytest.raises(MediaError) as info:
            fetch(f"{server.url}/a.png", "images[0]", "image", retrying(pause_s=1.0), Deadline(0.5))
        assert time.monotonic() - start < 0.4
    assert http_status(info.value)[0] == 422 and info.value.message.endswith("HTTP 503 error")
    assert server.gets["a.png"] == 1


def test_an_abandoned_request_ends_its_pause_at_once():
    server = CountingServer({"a.png": PNG}, failures={"a.png": [503]})
    deadline = Deadline(60)
    with server.running():
        threading.Timer(0.3, deadline.cancel).start()
        start = time.monotonic()
        with pytest.raises(TimedOut):
            fetch(f"{server.url}/a.png", "images[0]", "image", retrying(pause_s=10.0), deadline)
        assert time.monotonic() - start < 1.5
    assert server.gets["a.png"] == 1


def test_a_body_cut_short_is_tried_again_and_counts_once_against_the_download_budget():
    body = bytes(range(256)) * 1000
    server = CountingServer({"a.bin": body}, failures={"a.bin": ["short"]})
    allowance = MediaAllowance(MediaBudget(download_bytes=len(body) + 10))
    with server.running():
        assert fetch(f"{server.url}/a.bin", "images[0]", "image", retrying(), allowance=allowance) == body
    assert server.gets["a.bin"] == 2 and allowance.download_bytes == len(body)


def test_a_body_cut_short_is_never_taken_as_whole():
    body = bytes(range(256)) * 1000
    server = CountingServer({"a.bin": body}, failures={"a.bin": ["short"]})
    with server.running():
        message = refused(f"{server.url}/a.bin", retrying(attempts=1), status=422)
    assert message.endswith("the connection closed after 128,000 of 256,000 bytes")


def test_downloads_over_the_cap_are_413(tmp_path):
    server = CountingServer({"big.png": PNG})
    policy = FetchPolicy(allow_private_hosts=True, max_bytes=100)
    with server.running():
        assert "100-byte limit" in refused(f"{server.url}/big.png", policy, status=413)
    assert "100-byte limit" in refused("data:image/png;base64," + base64.b64encode(PNG).decode(), policy, status=413)


def test_giant_dimensions_are_refused_before_decoding():
    """A PNG header claiming 30000 x 30000 pixels: refused from the header, no pixel is decoded."""
    import struct
    import zlib

    png = png_file([(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)),
                    (b"IDAT", zlib.compress(b"\x00" * 100)), (b"IEND", b"")])
    with pytest.raises(MediaError, match="Image dimensions 30000x30000 .* exceed the maximum of 178956970 pixels"):
        decode_image(png, "images[0]")


# -- hostile URLs and paths: each a 4xx naming its place, never a 500 --------------------------------
@pytest.mark.parametrize("url", ["http://[::1", "http://[zz]/", "http://[::1/a.png", "https://host:99999/a.png",
                                 "http://host:port/a.png"])
def test_malformed_hosts_and_ports_are_400(url):
    assert "Invalid URL" in refused(url)


@pytest.mark.parametrize("location", ["http://[::1", "http://[zz]/"])
def test_a_redirect_to_a_malformed_url_is_400(location):
    server = CountingServer({}, {"go": location})
    with server.running():
        assert "invalid url" in refused(f"{server.url}/go", FetchPolicy(allow_private_hosts=True)).lower()


@pytest.mark.parametrize("name, message", [("a\x00.png", "NUL byte"), ("a" * 5000 + ".png", "cannot be read"),
                                           ("[::1/", "Invalid URL")])
def test_hostile_local_paths_are_400(tmp_path, name, message):
    policy = FetchPolicy(allowed_local_path=tmp_path)
    url = "file://[::1/" if name == "[::1/" else f"file://{tmp_path}/{name}"
    assert message in refused(url, policy)


@pytest.mark.parametrize("host", ["[::7f00:1]", "[::ffff:0:7f00:1]", "[2002:7f00:1::1]", "[64:ff9b::7f00:1]",
                                  "[64:ff9b:1::a00:1]", "[::ffff:7f00:1]", "[2001:0:4136:e378:8000:63bf:80ff:fffe]",
                                  "[fec0::1]", "[fed0::1]"])
def test_ipv6_forms_that_embed_a_private_ipv4_and_site_local_are_refused(host):
    """NAT64, 6to4, Teredo, IPv4-compatible and -translated addresses reach the IPv4 address they carry."""
    assert "non-public address" in refused(f"http://{host}/x.png")


@pytest.mark.parametrize("host", ["[64:ff9b::]", "[64:ff9b::0.0.0.0]", "[::ffff:0:0:0]", "[64:ff9b:1:7f00:1::]",
                                  "[64:ff9b:1:808:8:0:800::]", "192.0.0.9", "192.0.0.10", "192.0.0.170",
                                  "[::ffff:192.0.0.9]", "[64:ff9b::192.0.0.10]"])
def test_the_nat64_prefixes_gaps_and_192_0_0_0_24_are_refused(host):
    """Issue 50 item 10: 64:ff9b:: (0.0.0.0 through NAT64), the NAT64 local-use prefix with its IPv4 address at
    another RFC 6052 offset, and 192.0.0.0/24's anycast addresses (global in Python's table) were let through."""
    assert "non-public address" in refused(f"http://{host}/x.png")


def test_ipv6_forms_that_embed_a_public_ipv4_are_judged_by_it():
    assert media_fetch._public("64:ff9b::808:808") and media_fetch._public("2002:808:808::1")
    assert media_fetch._public("2606:4700:4700::1111")


# -- the request's download budget (docs/operations.md: bounds under hostile load) --------------------------
@pytest.mark.parametrize("declare_length", [True, False])
def test_a_requests_urls_together_stay_under_its_download_budget(monkeypatch, declare_length):
    """Four 300,000-byte files under a 1,000,000-byte request budget: three load, the fourth is a 413 naming the
    budget and its flag, and no more bytes than the budget are read from the sockets."""
    read = []
    real_read1 = http.client.HTTPResponse.read1
    monkeypatch.setattr(http.client.HTTPResponse, "read1", lambda self, n=-1: read.append(real_read1(self, n))
                        or read[-1])
    server = CountingServer({f"{i}.bin": bytes([i]) * 300_000 for i in range(4)}, declare_length=declare_length)
    allowance = MediaAllowance(MediaBudget(download_bytes=1_000_000))
    policy = FetchPolicy(allow_private_hosts=True)
    with server.running():
        for i in range(3):
            assert fetch(f"{server.url}/{i}.bin", f"images[{i}]", "image", policy, allowance=allowance) == bytes(
                [i]) * 300_000
        with pytest.raises(MediaError) as info:
            fetch(f"{server.url}/3.bin", "images[3]", "image", policy, allowance=allowance)
    assert http_status(info.value)[0] == 413
    assert info.value.message == ("media: images[3]: downloads would exceed the 1,000,000-byte budget of this "
                                  "request (--max-request-media-bytes)")
    if declare_length:  # refused from its Content-Length: not a byte of its body is read
        assert sum(map(len, read)) == allowance.download_bytes == 900_000
    else:  # read up to the budget, and one byte past it to know the body goes on
        assert sum(map(len, read)) <= 1_000_001 and allowance.download_bytes <= 1_000_000


# -- name resolution under the fetch's deadline ----------------------------------------------------------------
def slow_resolver(seconds: float):
    def resolve(host: str, port: int) -> list[str]:
        time.sleep(seconds)
        return ["127.0.0.1"]
    return resolve


def test_a_resolver_that_hangs_is_cut_off_by_the_fetch_deadline():
    """A lookup that takes 3 s, under a 0.3 s image fetch timeout: a 422 naming the flag, in well under 3 s."""
    policy = FetchPolicy(allow_private_hosts=True, image_timeout_s=0.3, resolver=slow_resolver(3.0))
    start = time.monotonic()
    message = refused("http://slow-dns.example/a.png", policy, status=422)
    assert time.monotonic() - start < 1.0
    assert message.endswith("not done within 0.3 s (--image-fetch-timeout)")


def test_a_resolver_that_hangs_is_cut_off_by_the_requests_deadline():
    policy = FetchPolicy(allow_private_hosts=True, resolver=slow_resolver(3.0))
    start = time.monotonic()
    with pytest.raises(TimedOut, match="--request-timeout"):
        fetch("http://slow-dns.example/a.png", "images[0]", "image", policy, Deadline(0.3))
    assert time.monotonic() - start < 1.0


def test_an_abandoned_request_stops_waiting_for_its_lookup():
    policy = FetchPolicy(allow_private_hosts=True, resolver=slow_resolver(3.0))
    deadline = Deadline(10.0)
    threading.Timer(0.2, deadline.cancel).start()
    start = time.monotonic()
    with pytest.raises(TimedOut):
        fetch("http://slow-dns.example/a.png", "images[0]", "image", policy, deadline)
    assert time.monotonic() - start < 1.0


def test_lookups_left_running_are_bounded_and_past_the_bound_a_fetch_gets_a_503():
    """A resolver that stops answering: each fetch gives up at its deadline but its lookup goes on (it cannot be
    interrupted); with every slot held by such lookups, the next fetch is refused at once, and the slots come back
    as the lookups end."""
    from systemone.models.errors import Unavailable
    from systemone.runtime.media_fetch import LookupSlots

    answer = threading.Event()

    def stuck(host: str, port: int) -> list[str]:
        answer.wait(10)
        return ["127.0.0.1"]

    policy = FetchPolicy(allow_private_hosts=True, image_timeout_s=0.2, resolver=stuck, lookups=LookupSlots(2))
    for i in range(2):
        refused(f"http://stuck-dns.example/{i}.png", policy, status=422)
    start = time.monotonic()
    with pytest.raises(Unavailable, match="all 2 name lookups are still waiting for the resolver") as info:
        fetch("http://stuck-dns.example/2.png", "images[0]", "image", policy)
    assert time.monotonic() - start < 0.1 and http_status(info.value)[0] == 503
    answer.set()  # the resolver answers again: the two lookups end and give their slots back
    server = CountingServer({"a.png": PNG})
    with server.running():
        url = server.url.replace("127.0.0.1", "media.example") + "/a.png"
        deadline = time.monotonic() + 5
        while True:
            try:
                assert fetch(url, "i", "image", policy) == PNG
                break
            except Unavailable:
                assert time.monotonic() < deadline, "the lookups' slots never came back"
                time.sleep(0.01)


def test_the_resolvers_answer_is_vetted_and_connected_to():
    server = CountingServer({"a.png": PNG})
    with server.running():
        named = server.url.replace("127.0.0.1", "media.example")
        assert "non-public address (127.0.0.1)" in refused(f"{named}/a.png", FetchPolicy(resolver=slow_resolver(0)))
        assert fetch(f"{named}/a.png", "i", "image", FetchPolicy(allow_private_hosts=True,
                                                                  resolver=slow_resolver(0.1))) == PNG
    assert server.gets == {"a.png": 1}


# -- through the environment's proxy (runtime/media_proxy.py) --------------------------------------------------------
def proxy_policy(proxy: ForwardProxy, environ: dict[str, str] | None = None, **more) -> FetchPolicy:
    """Both schemes through `proxy`; a resolver that knows only the proxy's address, so a name the client tried to
    resolve itself would fail."""
    def resolve(host: str, port: int) -> list[str]:
        assert host == "127.0.0.1", f"the client resolved {host!r} itself"
        return [host]
    environ = environ or {"http_proxy": proxy.address, "HTTPS_PROXY": f"http://{proxy.address}"}
    return FetchPolicy(proxies=ProxySettings.from_environment(environ), resolver=resolve, **more)


def test_an_http_url_is_asked_of_the_proxy_which_resolves_its_host():
    origin = CountingServer({"a.png": PNG})
    port = origin.server.server_address[1]
    with origin.running(), ForwardProxy({"media.example": "127.0.0.1"}).running() as proxy:
        assert fetch(f"http://media.example:{port}/a.png?v=1", "images[0]", "image", proxy_policy(proxy)) == PNG
    assert proxy.seen == [(f"GET http://media.example:{port}/a.png?v=1 HTTP/1.1", None)]


def test_an_https_url_goes_through_a_connect_tunnel_and_its_certificate_is_checked(monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(TLS_CERTIFICATE))  # the test's own authority for media.example
    origin = CountingServer({"a.png": PNG}, tls=True)
    port = origin.server.server_address[1]
    with origin.running(), ForwardProxy({"media.example": "127.0.0.1", "other.example": "127.0.0.1"}
                                        ).running() as proxy:
        assert fetch(f"https://media.example:{port}/a.png", "images[0]", "image", proxy_policy(proxy)) == PNG
        message = refused(f"https://other.example:{port}/a.png", proxy_policy(proxy), status=422)
    assert [line for line, _ in proxy.seen] == [f"CONNECT media.example:{port} HTTP/1.0",
                                                f"CONNECT other.example:{port} HTTP/1.0"]
    assert "SSLCertVerificationError" in message and "(through the server's proxy)" in message
    assert origin.gets["a.png"] == 1


def test_the_proxy_urls_credentials_are_sent_and_never_shown():
    origin = CountingServer({"a.png": PNG})
    port = origin.server.server_address[1]
    expected = "Basic " + base64.b64encode(b"user:s3cret").decode()
    with origin.running(), ForwardProxy({"media.example": "127.0.0.1"}, password="s3cret").running() as proxy:
        good = proxy_policy(proxy, {"all_proxy": f"http://user:s3cret@{proxy.address}"})
        assert fetch(f"http://media.example:{port}/a.png", "images[0]", "image", good) == PNG
        wrong = proxy_policy(proxy, {"all_proxy": f"http://user:wrong@{proxy.address}"}, retry_pause_s=0.01)
        messages = [refused(f"{scheme}://media.example:{port}/a.png", wrong, status=422) for scheme in ("http", "https")]
        assert "s3cret" not in repr(good) and "wrong" not in str(wrong.proxies.http)
    assert proxy.seen[0] == (f"GET http://media.example:{port}/a.png HTTP/1.1", expected)
    assert messages[0].endswith("HTTP 407 error (through the server's proxy)")
    assert "Tunnel connection failed: 407" in messages[1]
    assert len(proxy.seen) == 3  # a 407 is not tried again
    assert not any("wrong" in m or proxy.address in m for m in messages)


def test_no_proxy_hosts_are_fetched_directly_and_vetted_as_ever():
    with ForwardProxy().running() as proxy:
        policy = FetchPolicy(proxies=ProxySettings.from_environment({"http_proxy": proxy.address,
                                                                     "NO_PROXY": "internal.example,.corp"}),
                             resolver=slow_resolver(0))
        assert "non-public address (127.0.0.1)" in refused("http://internal.example/a.png", policy)
        assert "non-public address (127.0.0.1)" in refused("http://images.corp/a.png", policy)
    assert proxy.seen == []


@pytest.mark.parametrize("host, message", [("127.0.0.1", "non-public address"), ("[::1]", "non-public address"),
                                           ("10.0.0.8", "non-public address"), ("localhost", "loopback name"),
                                           ("api.localhost", "loopback name"), ("127.1", "non-public address"),
                                           ("2130706433", "non-public address"),
                                           ("0x7f000001", "non-public address")])
def test_private_ip_literals_and_localhost_are_refused_before_the_proxy(host, message):
    with ForwardProxy().running() as proxy:
        assert message in refused(f"http://{host}:8080/a.png", proxy_policy(proxy))
    assert proxy.seen == []


def test_proxy_settings_are_read_as_curl_reads_them():
    settings = ProxySettings.from_environment({"HTTP_PROXY": "upper:1", "http_proxy": "lower:2",
                                               "ALL_PROXY": "http://all:3", "no_proxy": "a.example"})
    assert (str(settings.http), str(settings.https)) == ("http://lower:2", "http://all:3")
    assert settings.for_url("http", "a.example") is None and settings.for_url("http", "b.a.example") is None
    assert str(settings.for_url("http", "b.example")) == "http://lower:2"
    assert settings.describe() == ("media fetches through http://lower:2 (http URLs); http://all:3 (https URLs), not "
                                   "for a.example")
    assert ProxySettings.from_environment({}).describe() is None
    with pytest.raises(ValueError, match=r"all_proxy: a socks5:// proxy is not supported .* --no-media-proxy"):
        ProxySettings.from_environment({"all_proxy": "socks5://proxy:1080"})
