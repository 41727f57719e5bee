"""``HOST:PORT`` endpoints: parsing, formatting, and which network a host belongs to.

IPv6 hosts are written in brackets (``[::1]:31337``). The subnet of a host is what the
routing table caps per bucket to resist eclipse attacks: the /24 of an IPv4 address, the
/64 of an IPv6 address, or the domain of a host name (:func:`name_network`). The source network of a
caller (:func:`source_network`) is the same grouping, except that loopback and private
addresses count one by one (unless limited): keys cost nothing and addresses do, so it is
what a server's and a donor's slots, DHT storage quotas, log lines, dashboard connections
and the networks holding a digest are counted per.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse

MAX_ENDPOINT_CHARS = 262
"""The longest ``HOST:PORT`` accepted from the network: a 255-character host name (the
most DNS allows), brackets and a port."""

_ENDPOINT = re.compile(
    r"(?:\[(?P<v6>[0-9a-fA-F:.%]+)\]|(?P<host>[^\s:\[\]/]+)):(?P<port>[0-9]{1,5})"
)


def parse_endpoint(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (or ``[V6]:PORT``); ValueError with an example if malformed."""
    match = _ENDPOINT.fullmatch(text.strip())
    port = int(match.group("port")) if match else 0
    if match is None or not 0 < port < 65536:
        raise ValueError(
            f"{text!r} is not a HOST:PORT address (e.g. 203.0.113.7:31337 or [2001:db8::1]:31337)"
        )
    return (match.group("v6") or match.group("host")), port


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_unspecified(host: str) -> bool:
    """Whether ``host`` is a wildcard bind address (0.0.0.0, ::) that nobody can dial."""
    return host in ("", "0.0.0.0", "::", "[::]")


def subnet_of(host: str, *, limit_private: bool) -> str | None:
    """The group a host counts toward in a routing bucket, or None when it is exempt.

    Loopback, private and link-local addresses are exempt unless ``limit_private``: a swarm
    on one LAN or one machine would otherwise be capped at two peers per bucket.
    """
    address = _ip(host)
    if address is None:
        return name_network(host)
    if not limit_private and _is_local(address):
        return None
    return _prefix(address)


def source_network(host: str, *, limit_private: bool = False) -> str:
    """The network a caller at ``host`` counts toward in a server's or a donor's limits,
    in DHT storage quotas, and among the holders of a digest.

    The /24 of a public IPv4 address and the /64 of a public IPv6 address (one host is
    commonly given a whole /64, so counting its addresses one by one would give it
    billions of slots). Loopback, private and link-local addresses count one by one,
    unless ``limit_private`` (then by their /24 or /64 too): they are the operator's own
    machines, and a test tells networks apart by binding 127.0.0.N. An IPv4 address seen
    through a dual-stack socket (``::ffff:203.0.113.7``) counts as that IPv4 address, not
    as part of one /64 shared by every IPv4 caller.
    """
    address = _ip(host)
    if address is None:
        return name_network(host)
    if _is_local(address) and not limit_private:
        return str(address)
    return _prefix(address)


def name_network(host: str) -> str:
    """The network a host *name* counts toward: its domain, the last two of its labels
    (``a1.evil.example`` and ``a2.evil.example`` are one network, ``evil.example``). The
    owner of a domain makes as many names under it as it likes, pointing wherever it likes
    (a wildcard record, or a service such as nip.io that maps every name to an address),
    so only the domain costs anything; names under a shared domain (a dynamic-DNS
    service's) count together. A name of one label (a container's on its Docker network,
    one in /etc/hosts) counts by itself: only the operator's own resolver answers for it."""
    labels = host.lower().rstrip(".").split(".")
    return "name:" + ".".join(labels[-2:])[:64]


def endpoint_network(endpoint: str) -> str:
    """The :func:`source_network` of a ``HOST:PORT`` endpoint's host (one that does not
    parse counts as a network of its own)."""
    try:
        return source_network(parse_endpoint(endpoint)[0])
    except ValueError:
        return f"endpoint:{endpoint[:300]}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(canonical_host(host)).is_loopback
    except ValueError:
        return False


def canonical_host(host: str) -> str:
    """``host`` written one way for comparisons: an IP address in its canonical form (an
    IPv4-mapped IPv6 address as IPv4), a name in lower case."""
    address = _ip(host)
    return host.lower() if address is None else str(address)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_local(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return address.is_loopback or address.is_private or address.is_link_local


def _prefix(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    prefix = 24 if address.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


def is_ip_address(text: str) -> bool:
    """Whether ``text`` is an IPv4 or IPv6 address (no brackets, no port)."""
    if len(text) > 64:  # the longest IPv6 address with a zone is well under this
        return False
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


def host_of_grpc_peer(peer: str) -> str:
    """The IP of a grpc ``context.peer()`` string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``).

    gRPC percent-encodes the brackets of an IPv6 peer (``ipv6:%5B::1%5D:5``), and a zone
    id's ``%`` (``%25eth0``): both are decoded, so the host is the address itself.
    """
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return urllib.parse.unquote(rest.rsplit(":", 1)[0]).strip("[]")
    return ""


def guess_host() -> str:
    """This machine's address on its default route, or 127.0.0.1 when it has none.

    Connecting a UDP socket sends no packet; it only asks the kernel which source address
    it would use. Behind NAT this is the private address: operators of public nodes pass
    the public one explicitly.
    """
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed to anyone
            host: str = probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
    return host if not is_unspecified(host) else "127.0.0.1"
