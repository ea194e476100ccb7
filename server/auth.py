"""API keys: `Authorization: Bearer KEY`, compared in constant time (decision 5)."""

from __future__ import annotations

import hmac
import ipaddress
import socket


class Unauthorized(Exception):
    pass


def check_bearer(header: str | None, api_key: str | None) -> None:
    """No key configured: the header is ignored. Otherwise it must be `Bearer <key>` (the configured key without
    surrounding whitespace, which a header value cannot carry)."""
    if api_key is None:
        return
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.strip().encode()):
        raise Unauthorized("missing or invalid API key: send Authorization: Bearer <key>")


def is_loopback(host: str) -> bool:
    """Whether binding `host` exposes the server only to this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except OSError:
            return False
