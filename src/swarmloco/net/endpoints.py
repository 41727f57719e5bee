"""``HOST:PORT`` endpoints: parsing, formatting, and which subnet a host belongs to.

IPv6 hosts are written in brackets (``[::1]:31337``). The subnet of a host is what the
routing table caps per bucket to resist eclipse attacks: the /24 of an IPv4 address, the
/64 of an IPv6 address, or the name itself for a host name. The *source network* of a
caller is what limits on one source count (log lines, connections): the same subnets,
except that a loopback or private address is a source of its own.
"""

from __future__ import annotations

import ipaddress
import re

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
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return f"name:{host.lower()}"
    if not limit_private and (address.is_loopback or address.is_private or address.is_link_local):
        return None
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


def source_network(host: str) -> str:
    """The network a caller at ``host`` (an IP address) counts toward, for limits on what
    one source may cost: the /24 of a public IPv4 address, the /64 of a public IPv6
    address (one host usually holds a whole /64), and the address itself when it is
    loopback, private or link-local (on one machine or one LAN every address is a source
    of its own, and tests tell 127.0.0.N apart). An IPv4 address seen through an IPv6
    socket (``::ffff:a.b.c.d``) counts as that IPv4 address. Anything that is not an
    address counts as itself, cut to 64 characters."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host[:64]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback or address.is_private or address.is_link_local:
        return str(address)
    prefix = 24 if address.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


def host_of_grpc_peer(peer: str) -> str:
    """The IP of a grpc ``context.peer()`` string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
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
