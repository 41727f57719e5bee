"""The view in Prometheus text format (``/metrics``).

Metrics are produced from the current view at scrape time by a custom collector in the
dashboard's own registry (never the process-global one), so a peer that left simply stops
appearing: no stale label sets to forget. Per-peer series are labelled with the peer's short
id and its (cleaned) name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

ViewSource = Callable[[], Mapping[str, Any]]

_PEER_LABELS = ("peer", "name")
# (metric suffix, view field, help)
_PEER_GAUGES = (
    ("online", "online", "1 when the peer's status record is fresh"),
    ("round", "round", "Round of the peer's global state"),
    ("step", "step", "Inner steps the peer has taken"),
    ("tokens", "tokens", "Tokens the peer says it trained on"),
    ("tokens_per_second", "tokens_per_s", "The peer's training rate (0 when offline)"),
    ("token_share", "share", "The peer's share of the tokens of all known peers"),
    ("loss", "loss", "The peer's last training loss"),
    ("eval_loss", "eval_loss", "Eval loss of the peer's global model at its last round"),
    ("uptime_seconds", "uptime_s", "Seconds since the peer started"),
    ("rounds_applied", "rounds_applied", "Rounds the peer applied"),
    ("rounds_aborted", "rounds_aborted", "Rounds the peer aborted"),
    ("downloads", "downloads", "State downloads the peer made"),
)


class ViewCollector(Collector):
    """Yields the swarm's gauges from ``source()`` (the collector's current view)."""

    def __init__(self, source: ViewSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        view = self._source()
        yield _swarm_info(view["swarm"])
        yield from _read_gauges(view)
        yield from _swarm_gauges(view)
        rounds = view.get("rounds") or []
        yield from _last_round_gauges(rounds[-1] if rounds else {})
        yield from _peer_families(view.get("peers") or [])


def _swarm_info(swarm: Mapping[str, Any]) -> InfoMetricFamily:
    """Which swarm this is: its id as the label, its name, task and preset as info."""
    info = InfoMetricFamily(
        "swarmloco_swarm", "The swarm the dashboard reads", labels=("swarm_id",)
    )
    info.add_metric(
        [swarm["id"]],
        {
            "name": swarm.get("name") or "",
            "task": swarm.get("task") or "",
            "preset": swarm.get("preset") or "",
        },
    )
    return info


def _read_gauges(view: Mapping[str, Any]) -> Iterator[Metric]:
    """Whether the dashboard's own reading of the DHT works, and how old it is."""
    yield _gauge(
        "swarmloco_dashboard_read_ok",
        "1 when the last poll of the DHT worked",
        0 if view.get("error") else 1,
    )
    yield _gauge(
        "swarmloco_dashboard_read_age_seconds",
        "Seconds since the records shown were read",
        view.get("read_age_s"),
    )


def _swarm_gauges(view: Mapping[str, Any]) -> Iterator[Metric]:
    """The swarm as a whole: its peers, rate, round, losses and agreement."""
    yield _gauge(
        "swarmloco_peers_online",
        "Counted peers with a fresh status record",
        view["peers_online"],
    )
    yield _gauge("swarmloco_peers_known", "Counted peers with a status record", view["peers_known"])
    yield _gauge(
        "swarmloco_peers_uncounted",
        "Keys with a status record that no trusted peer averaged with (not counted)",
        view.get("peers_uncounted", 0),
    )
    yield _gauge(
        "swarmloco_swarm_tokens_per_second",
        "Sum of the training rates of the online peers",
        view["tokens_per_s"],
    )
    yield _gauge("swarmloco_round", "The swarm's current round", view.get("round"))
    yield _gauge(
        "swarmloco_swarm_loss", "Median training loss of the online peers", view.get("loss")
    )
    yield _gauge(
        "swarmloco_swarm_eval_loss",
        "Median eval loss of the online peers",
        view.get("eval_loss"),
    )
    agreement = view.get("agreement") or {}
    yield _gauge(
        "swarmloco_round_agreement_ratio",
        "Share of the current round's digests that equal the majority digest",
        agreement.get("share") if agreement.get("published") else None,
    )


def _last_round_gauges(last: Mapping[str, Any]) -> Iterator[Metric]:
    """The latest round's time, traffic, compression and failures (none before one)."""
    yield _gauge(
        "swarmloco_last_round_seconds",
        "Median duration of the latest round",
        last.get("seconds"),
    )
    yield _gauge(
        "swarmloco_last_round_bytes_sent",
        "Median bytes one peer sent in the latest round",
        last.get("bytes_sent"),
    )
    yield _gauge(
        "swarmloco_last_round_compression_ratio",
        "fp32 payload bytes over bytes sent in the latest round",
        last.get("compression"),
    )
    yield _gauge(
        "swarmloco_last_round_failures",
        "Peers whose latest round aborted",
        last.get("failures"),
    )


def _peer_families(peers: list[Mapping[str, Any]]) -> Iterator[Metric]:
    """One family per peer gauge, a series per peer that has the value."""
    for suffix, field, help_text in _PEER_GAUGES:
        family = GaugeMetricFamily(f"swarmloco_peer_{suffix}", help_text, labels=_PEER_LABELS)
        for peer in peers:
            value = peer.get(field)
            if value is None:
                continue
            family.add_metric([peer["short_id"], peer["name"]], float(value))
        yield family


def _gauge(name: str, help_text: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text)
    if value is not None:
        family.add_metric([], float(value))
    return family


def make_registry(source: ViewSource) -> CollectorRegistry:
    """A registry of its own holding the swarm's gauges (the global one is never touched)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ViewCollector(source))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
