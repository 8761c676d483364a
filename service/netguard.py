"""Where the service may send a request on a user's behalf (webhooks): no server-side request
forgery into the deployment's own network.

A user-given URL's host is resolved, and every address it resolves to must be a public one:
loopback, private, link-local (cloud metadata at 169.254.169.254), multicast, reserved,
unspecified and shared (CGNAT) addresses, and every other block of IANA's IPv4 and IPv6
special-purpose address registries (:data:`SPECIAL_PURPOSE`: documentation, benchmarking,
protocol assignments, anycast services...), are refused unless the admin's
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


CARRIERS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "64:ff9b::/96",  # NAT64's well-known prefix (RFC 6052): a DNS64 network's way to IPv4
        "::ffff:0:0:0/96",  # IPv4-translated (SIIT, RFC 6145)
        "::/96",  # IPv4-compatible (deprecated, still routed by some stacks)
    )
)
"""IPv6 prefixes whose last 32 bits are an IPv4 address that a gateway on the way may reach:
such an address is judged by the IPv4 address it carries (``64:ff9b::7f00:1`` is
127.0.0.1 behind NAT64). 6to4 (``2002::/16``) carries its IPv4 address in bits 16-47."""


def _carried(addr: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (see :data:`CARRIERS`), or None."""
    if not isinstance(addr, ipaddress.IPv6Address) or addr.is_loopback or addr.is_unspecified:
        return None  # ::1 and :: are judged as what they are
    if addr.sixtofour is not None:
        return addr.sixtofour
    if any(addr in net for net in CARRIERS):
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


SPECIAL_PURPOSE: tuple[tuple[Network, str], ...] = tuple(
    sorted(
        (
            (ipaddress.ip_network(net), name)
            for net, name in (
                # IANA IPv4 Special-Purpose Address Registry (iana-ipv4-special-registry), and
                # the multicast space (its own registry). Python's ipaddress calls some of these
                # global (3.11: 192.0.0.8, 192.88.99.0/24, the AS112 and AMT blocks): the table,
                # not is_global, decides.
                ("0.0.0.0/8", "'this network'"),
                ("10.0.0.0/8", "private"),
                ("100.64.0.0/10", "shared (carrier-grade NAT)"),
                ("127.0.0.0/8", "loopback"),
                ("169.254.0.0/16", "link-local"),
                ("172.16.0.0/12", "private"),
                ("192.0.0.0/24", "IETF protocol assignment"),
                ("192.0.2.0/24", "documentation"),
                ("192.31.196.0/24", "AS112 anycast"),
                ("192.52.193.0/24", "AMT anycast"),
                ("192.88.99.0/24", "6to4 relay anycast (deprecated)"),
                ("192.168.0.0/16", "private"),
                ("192.175.48.0/24", "AS112 anycast"),
                ("198.18.0.0/15", "benchmarking"),
                ("198.51.100.0/24", "documentation"),
                ("203.0.113.0/24", "documentation"),
                ("224.0.0.0/4", "multicast"),
                ("240.0.0.0/4", "reserved"),
                ("255.255.255.255/32", "broadcast"),
                # IANA IPv6 Special-Purpose Address Registry (iana-ipv6-special-registry), and the
                # multicast space. The carriers (::ffff:0:0/96, 64:ff9b::/96, 2002::/16...) are
                # judged by the IPv4 address inside before this table is read.
                ("::/128", "unspecified"),
                ("::1/128", "loopback"),
                ("::ffff:0:0/96", "IPv4-mapped"),
                ("64:ff9b::/96", "NAT64"),
                # local-use NAT64 (RFC 8215): into the deployment's own IPv4 space, the IPv4
                # address at a position the operator chose, so refused as a whole
                ("64:ff9b:1::/48", "local-use NAT64"),
                ("100::/64", "discard-only"),
                ("100:0:0:1::/64", "dummy"),
                ("2001::/23", "IETF protocol assignment"),
                ("2001::/32", "Teredo"),
                ("2001:2::/48", "benchmarking"),
                ("2001:db8::/32", "documentation"),
                ("2002::/16", "6to4"),
                ("2620:4f:8000::/48", "AS112 anycast"),
                ("3fff::/20", "documentation"),
                ("5f00::/16", "segment routing (SRv6)"),
                ("fc00::/7", "unique-local (private)"),
                ("fe80::/10", "link-local"),
                ("fec0::/10", "site-local (deprecated)"),
                ("ff00::/8", "multicast"),
            )
        ),
        key=lambda entry: -entry[0].prefixlen,  # the most specific block names an address
    )
)
"""IANA's special-purpose blocks (IPv4 and IPv6; RFC 6890 and its updates) with what each is:
none is a webhook receiver's public address, whatever the registry's "globally reachable"
column says of a few anycast services (PCP, TURN, AS112, AMT)."""

GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
"""The only IPv6 space IANA allocates for global unicast; the rest is reserved (RFC 4291)."""


def _article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiouAEIOU" else f"a {name}"


def _kind(addr: Address) -> str | None:
    """What kind of non-public address ``addr`` is, as a phrase ("a loopback address
    (127.0.0.0/8)"), or None for a public one."""
    special = next(((net, name) for net, name in SPECIAL_PURPOSE if addr in net), None)
    if special is not None:
        net, name = special
        return f"{_article(name)} address ({net})"
    if isinstance(addr, ipaddress.IPv6Address) and addr not in GLOBAL_UNICAST:
        return f"a reserved address (outside {GLOBAL_UNICAST}, IPv6's global unicast space)"
    if addr.is_global and not addr.is_multicast:
        return None
    # what the table does not list but Python's ipaddress knows as non-public
    kinds = (
        ("loopback", addr.is_loopback),
        ("link-local", addr.is_link_local),
        ("multicast", addr.is_multicast),
        ("unspecified", addr.is_unspecified),
        ("private", addr.is_private),  # after the above, which Python counts as private too
        ("reserved", addr.is_reserved),
    )
    name = next((name for name, hit in kinds if hit), "non-public")
    return f"{_article(name)} address"


def address_problem(addr: Address, allow: Sequence[Network]) -> str | None:
    """Why ``addr`` may not be called, or None."""
    addr = _unmapped(addr)
    if any(addr in net for net in allow):
        return None
    refused = "which the server's settings do not allow"
    inner = _carried(addr)
    if inner is not None:
        if any(inner in net for net in allow):
            return None
        kind = _kind(inner)
        return None if kind is None else f"{addr} carries {inner}, {kind}, {refused}"
    kind = _kind(addr)
    return None if kind is None else f"{addr} is {kind}, {refused}"


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
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url):
        # a URL has neither (RFC 3986); percent-encode them. Let through, a NUL reaches the
        # database (PostgreSQL's text refuses it) and a newline the request line
        raise Refused("contains a space or a control character (percent-encode it)")
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
    if port == 0:
        raise Refused("port 0 cannot be connected to (ports are 1 to 65535)")
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
