"""``HOST:PORT`` endpoints: parsing, formatting, and which subnet a host belongs to.

IPv6 hosts are written in brackets (``[::1]:31337``). The subnet of a host is what the
routing table caps per bucket to resist eclipse attacks: the /24 of an IPv4 address, the
/64 of an IPv6 address, or the name itself for a host name. The source network of a caller
is what DHT storage quotas count toward: its subnet, or its own address where the subnet
caps exempt it.
"""

from __future__ import annotations

import ipaddress
import re

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
        return f"name:{host.lower()}"
    if not limit_private and (address.is_loopback or address.is_private or address.is_link_local):
        return None
    prefix = 24 if address.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


def network_of(host: str, *, limit_private: bool) -> str:
    """The source network a caller at ``host`` counts toward in quotas: its subnet, or,
    for an address :func:`subnet_of` exempts (loopback, private, link-local), the address
    alone. Keys cost nothing and addresses do, so a quota per network binds an attacker
    where one per key does not; an exempt address still counts by itself, so that one
    process on a LAN or on this machine cannot take the share of every other."""
    subnet = subnet_of(host, limit_private=limit_private)
    if subnet is not None:
        return subnet
    return str(_ip(host))


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` names (None for a host name). An IPv4 address seen through a
    dual-stack socket (``::ffff:a.b.c.d``) is that IPv4 address: otherwise every IPv4
    caller of a server bound to ``::`` would share one /64."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


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
