"""Where the service may send a request on a user's behalf (webhooks): no server-side request
forgery into the deployment's own network.

A user-given URL's host is resolved, and every address it resolves to must be a public one:
loopback, private, link-local (cloud metadata at 169.254.169.254), multicast, reserved,
unspecified and shared (CGNAT) addresses are refused unless the admin's
``ZOOPICK_WEBHOOK_ALLOW_NETWORKS`` contains them. The check runs when the URL is given (a 422
naming the field) and again at each delivery, and the delivery then connects to the very
address that was checked (:func:`pinned_request`), so a DNS answer that changes between the
check and the connection (DNS rebinding) cannot redirect it. Redirects are never followed.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

SCHEMES = ("http", "https")
MAX_URL_LENGTH = 2000


class Refused(ValueError):
    """The URL may not be called; the message says why."""


def networks(allow: Iterable[str]) -> list[Network]:
    return [ipaddress.ip_network(n, strict=False) for n in allow]


def _unmapped(addr: Address) -> Address:
    """``::ffff:127.0.0.1`` is 127.0.0.1: judge the IPv4 address inside."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def address_problem(addr: Address, allow: Sequence[Network]) -> str | None:
    """Why ``addr`` may not be called, or None."""
    addr = _unmapped(addr)
    if any(addr in net for net in allow):
        return None
    if addr.is_global and not addr.is_multicast:
        return None
    kinds = (
        ("loopback", addr.is_loopback),
        ("link-local", addr.is_link_local),
        ("multicast", addr.is_multicast),
        ("unspecified", addr.is_unspecified),
        ("private", addr.is_private),  # after the above, which Python counts as private too
        ("reserved", addr.is_reserved),
    )
    kind = next((name for name, hit in kinds if hit), "not public")
    return f"{addr} is a {kind} address, which the server's settings do not allow"


@dataclass(frozen=True)
class Target:
    """A checked URL and the address to connect to."""

    url: str
    host: str
    address: Address


def split(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an acceptable URL shape, else :class:`Refused`."""
    if len(url) > MAX_URL_LENGTH:
        raise Refused(f"longer than {MAX_URL_LENGTH} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise Refused(f"not a URL: {exc}") from None
    if parts.scheme not in SCHEMES:
        raise Refused("must start with http:// or https://")
    if not parts.hostname:
        raise Refused("has no host")
    if parts.username or parts.password:
        raise Refused("must not carry credentials (user:password@)")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def resolve(url: str, allow: Sequence[Network]) -> Target:
    """Resolve ``url``'s host and check every address it has (one bad address refuses the URL:
    which one a client would pick is not ours to guess); :class:`Refused` says why."""
    _, host, port = split(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise Refused(f"host {host!r} does not resolve: {exc}") from None
    addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
    if not addresses:
        raise Refused(f"host {host!r} has no address")
    for addr in addresses:
        problem = address_problem(addr, allow)
        if problem:
            raise Refused(problem)
    return Target(url=url, host=host, address=addresses[0])


def pinned_request(target: Target) -> tuple[str, dict[str, str], dict[str, str]]:
    """(URL with the checked address in place of the host, headers, httpx extensions): the
    connection goes to ``target.address`` whatever DNS says by then; the Host header and TLS'
    server name (SNI, certificate check) stay the original host's."""
    parts = urlsplit(target.url)
    ip = _unmapped(target.address)
    literal = f"[{ip}]" if ip.version == 6 else str(ip)
    netloc = literal if parts.port is None else f"{literal}:{parts.port}"
    url = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host_header = target.host if parts.port is None else f"{target.host}:{parts.port}"
    extensions = {"sni_hostname": target.host} if parts.scheme == "https" else {}
    return url, {"Host": host_header}, extensions
