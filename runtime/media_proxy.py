"""The HTTP proxy media fetches go through, read from the environment as vLLM's fetcher (aiohttp's trust_env),
curl and requests read it: `http_proxy` / `https_proxy` (or upper case; lower case first), `all_proxy` for both,
`no_proxy` for hosts fetched directly. Only http:// proxies: an https:// URL goes through one by CONNECT.

Behind a proxy the proxy resolves a URL's host and connects to it, so the server cannot see the address a name
reaches: it still refuses hosts given as private or loopback IP literals and `localhost` names unless private hosts
are allowed; `--allowed-media-domains` is the way to bound the rest (docs/spec.md 6.1).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit
from urllib.request import proxy_bypass_environment


@dataclass(frozen=True)
class MediaProxy:
    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)  # Proxy-Authorization from the URL's user:password

    @classmethod
    def parse(cls, url: str, name: str) -> MediaProxy:
        """`http://[user:password@]host[:port]` (no scheme: http, as curl reads it); `name` is the variable it came
        from, for errors."""
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme.lower() != "http":
            raise ValueError(f"{name}: a {parts.scheme}:// proxy is not supported for media fetches, only http:// "
                             "(or pass --no-media-proxy)")
        try:
            port = parts.port or 80
        except ValueError:
            raise ValueError(f"{name}: the proxy's port is not a number from 0 to 65535") from None
        if not parts.hostname:
            raise ValueError(f"{name}: the proxy URL names no host")
        authorization = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            authorization = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        return cls(parts.hostname, port, authorization)

    def headers(self) -> dict[str, str]:
        return {"Proxy-Authorization": self.authorization} if self.authorization else {}

    def __str__(self) -> str:  # never the credentials: it goes into errors and the start-up line
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class ProxySettings:
    """Which proxy an http or https URL goes through, if any."""

    http: MediaProxy | None = None
    https: MediaProxy | None = None
    no_proxy: str = ""  # the `no_proxy` list, as urllib matches it (suffixes, `*`, ports)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> ProxySettings:
        def read(name: str) -> tuple[str, str] | None:
            for key in (name.lower(), name.upper()):
                if environ.get(key, "").strip():
                    return key, environ[key].strip()
            return None

        fallback = read("all_proxy")
        proxies = {}
        for scheme in ("http", "https"):
            found = read(f"{scheme}_proxy") or fallback
            proxies[scheme] = MediaProxy.parse(found[1], found[0]) if found else None
        no_proxy = read("no_proxy")
        return cls(proxies["http"], proxies["https"], no_proxy[1] if no_proxy else "")

    def for_url(self, scheme: str, host: str) -> MediaProxy | None:
        proxy = self.https if scheme == "https" else self.http
        if proxy is None or (self.no_proxy and proxy_bypass_environment(host, {"no": self.no_proxy})):
            return None
        return proxy

    def describe(self) -> str | None:
        """The start-up line's text, or None without a proxy."""
        if self.http is None and self.https is None:
            return None
        if self.http == self.https:
            used = f"media fetches through {self.http} (http and https URLs)"
        else:
            used = "media fetches through " + "; ".join(
                f"{proxy} ({scheme} URLs)" for scheme, proxy in (("http", self.http), ("https", self.https)) if proxy)
        return used + (f", not for {self.no_proxy}" if self.no_proxy else "")
