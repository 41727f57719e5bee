"""The rejection log: every rejection counted, log lines limited per source network and in all.

Pure: a fake clock and a list handler, no sockets (the same over real gRPC connections is
in tests/net/test_memory.py).
"""

from __future__ import annotations

import logging

import pytest

from swarmloco.net.endpoints import source_network
from swarmloco.net.rejections import Rejection, RejectionLog, host_named_by


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_log(**kwargs: object) -> tuple[RejectionLog, Lines, Clock]:
    logger = logging.getLogger(f"test.rejections.{id(kwargs)}")
    logger.propagate = False
    lines = Lines()
    logger.handlers[:] = [lines]
    clock = Clock()
    return RejectionLog(logger, clock=clock, **kwargs), lines, clock  # type: ignore[arg-type]


def test_source_networks_group_public_hosts_and_tell_local_addresses_apart():
    assert source_network("93.184.216.7") == source_network("93.184.216.250") == "93.184.216.0/24"
    assert source_network("93.184.217.7") != source_network("93.184.216.7")
    v6 = source_network("2a00:1450:1:2::1")
    assert v6 == source_network("2a00:1450:1:2:ffff::9") == "2a00:1450:1:2::/64"
    assert source_network("2a00:1450:1:3::1") != v6
    # One machine or one LAN: each address is a source of its own (tests use 127.0.0.N).
    assert source_network("127.0.0.5") == "127.0.0.5" != source_network("127.0.0.6")
    assert source_network("10.1.2.3") == "10.1.2.3"
    assert source_network("::1") == "::1"
    # IPv4 seen through a dual-stack socket counts as IPv4.
    assert source_network("::ffff:93.184.216.9") == "93.184.216.0/24"
    assert source_network("::ffff:127.0.0.5") == "127.0.0.5"
    assert source_network("x" * 500) == "name:" + "x" * 64  # not an address: its name, cut


def test_every_form_a_peer_is_named_by_yields_its_host():
    assert host_named_by("ipv4:93.184.216.7:51234") == "93.184.216.7"
    assert host_named_by("ipv6:[2001:db8::1]:51234") == "2001:db8::1"
    assert host_named_by("ab12cd34ef56@93.184.216.7:31337") == "93.184.216.7"
    assert host_named_by("93.184.216.7:31337") == "93.184.216.7"
    assert host_named_by("[2001:db8::1]:31337") == "2001:db8::1"
    assert host_named_by("93.184.216.7") == "93.184.216.7"
    assert host_named_by("ab" * 20) == "ab" * 20  # a peer id stays itself


def test_one_line_per_source_network_and_code_per_interval_while_counting_all():
    log, lines, clock = make_log(log_interval=10.0)
    bad = Rejection("malformed", "the request is not a valid PingRequest")
    # One host, a new connection (a new port) for every request: the old key (address and
    # port) logged each of them.
    for port in range(40000, 40100):
        log.record(bad, f"ipv4:93.184.216.7:{port}")
    # Its /24 neighbour is the same source network.
    for port in range(40000, 40050):
        log.record(bad, f"ipv4:93.184.216.99:{port}")
    assert log.counts["malformed"] == 150
    assert len(lines.lines) == 1 and "93.184.216.7" in lines.lines[0]
    # Another network, and another code from the first network, get a line each.
    log.record(bad, "ipv4:81.2.69.1:1")
    log.record(Rejection("bad-contact", "contact card is malformed"), "ipv4:93.184.216.7:2")
    assert len(lines.lines) == 3
    # After the interval the next line says how many were suppressed meanwhile.
    clock.now += 10.0
    log.record(bad, "ipv4:93.184.216.7:3")
    assert len(lines.lines) == 4
    assert "149 more like it suppressed" in lines.lines[-1]
    assert log.total == 153


def test_a_source_that_names_itself_is_limited_by_where_it_called_from():
    log, lines, _ = make_log()
    rejection = Rejection("quota", "record not stored")
    # A store request's sender names any endpoint it likes in its card; the transport saw
    # it call from one address.
    for i in range(200):
        log.record(rejection, f"{i:040x}@81.2.{i}.1:31337", source="93.184.216.7")
    assert log.counts["quota"] == 200
    assert len(lines.lines) == 1
    assert "@81.2.0.1:31337" in lines.lines[0]  # the line still names the peer


def test_many_source_networks_share_a_budget_of_lines():
    log, lines, clock = make_log(max_lines=5, max_tracked=64)
    bad = Rejection("malformed", "garbage")
    for i in range(1000):  # an IPv6 host with a /48: 65,536 networks of /64
        log.record(bad, f"ipv6:[2a00:1450:0:{i:x}::1]:443")
    assert log.counts["malformed"] == 1000
    assert len(lines.lines) == 5
    clock.now += 10.0
    log.record(bad, "ipv4:81.2.69.1:1")
    assert len(lines.lines) == 6
    assert "995 more from other sources not logged" in lines.lines[-1]
    # What it remembers per source stays bounded.
    assert log.tracked <= 64


def test_limits_must_make_sense():
    with pytest.raises(ValueError):
        make_log(max_lines=0)
    with pytest.raises(ValueError):
        make_log(max_tracked=0)
