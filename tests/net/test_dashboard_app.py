"""The dashboard app over HTTP, reading real DHT nodes on loopback that publish real records."""

import asyncio
import base64
import hashlib
import logging
import re
import time
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from netutil import closed_port, loopback_network
from prometheus_client.parser import text_string_to_metric_families

from swarmloco.core.agreement import DIGEST_BYTES
from swarmloco.core.manifest import SwarmManifest
from swarmloco.dashboard.app import HttpConfig, make_app, serve
from swarmloco.dashboard.collector import Collector, CollectorConfig
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import digest_key, partners_key, progress_key, status_key
from swarmloco.net.rejections import RejectionLog
from swarmloco.net.server import ServerConfig
from swarmloco.net.swarm import announce_peer, publish_manifest
from swarmloco.pipeline.load import Vouching, publish_load

pytestmark = pytest.mark.timeout(60)

MANIFEST = SwarmManifest(
    task="gpt-bytes",
    model={"preset": "tiny", "params": 812_544},
    data={},
    # 400 steps of the swarm, a round every 10: 40 rounds.
    hparams={"run": {"sync_every": 10, "fragments": 1, "total_steps": 400}},
    name="loopback run",
)
SWARM = MANIFEST.swarm_id
AGREED, OTHER = b"\x11" * DIGEST_BYTES, b"\x22" * DIGEST_BYTES


def status_value(name: str, *, round: int, tokens: int, loss: float) -> dict[str, Any]:
    now = time.time()
    return {
        "name": name,
        "state": "training",
        "round": round,
        "step": tokens // 1024,
        "tokens": tokens,
        "tokens_per_s": 2048.0,
        "loss": loss,
        "device": "cpu",
        "version": "0.1.0",
        "started_at": now - 60.0,
        "rounds_applied": round,
        "rounds_aborted": 1,
        "downloads": 0,
        "last_error": "",
        "rounds": [
            {
                "round": round,
                "group": 3,
                "seconds": 1.5,
                "bytes_sent": 1_000_000,
                "bytes_received": 1_000_000,
                "payload_bytes": 4_000_000,
                "ok": True,
                "at": now - 5.0,
            }
        ],
        "at": now,
    }


async def publish(node: NetNode, name: str, *, round: int, tokens: int, digest: bytes) -> None:
    """What a training peer publishes (runtime/peer.py), through the real DHT API."""
    await announce_peer(node.dht, SWARM, role="trainer")
    await node.dht.store(
        status_key(SWARM), status_value(name, round=round, tokens=tokens, loss=2.0), ttl=120
    )
    await node.dht.store(
        progress_key(SWARM),
        {"round": round + 1, "tokens": 4096, "tokens_per_s": 2048.0, "at": time.time()},
        ttl=120,
    )
    await node.dht.store(
        digest_key(SWARM, round),
        {"digest": digest, "endpoint": node.endpoint, "at": time.time()},
        ttl=600,
    )


@asynccontextmanager
async def dashboard(entry: str, *, manifest: SwarmManifest = MANIFEST, **config: Any):
    """A client-mode reader joined through ``entry``, its collector, and the app on port 0."""
    reader = NetNode(identity=Identity.generate(), config=NodeConfig(server=None, peers=(entry,)))
    async with reader:
        collector = Collector(
            dht=reader.dht,
            swarm_id=manifest.swarm_id,
            manifest=manifest,
            rejoin=(entry,),
            config=CollectorConfig(**config),
            vouching=Vouching(reader.who_serves, reader.identity.peer_id_hex),
        )
        app = make_app(lambda: collector.view)
        async with serve(app, host="127.0.0.1", port=0) as url, aiohttp.ClientSession() as http:
            yield collector, url, http


@asynccontextmanager
async def swarm_of_three(*, stranger: Identity | None = None):
    """Three peers that averaged together (each names the other two as partners), and, if
    given, a ``stranger`` key that claims round 999,999 and a billion tokens a second and
    names the three as its partners."""
    async with loopback_network(3) as nodes:
        await publish_manifest(nodes[0].dht, MANIFEST)
        ids = [n.identity.peer_id_hex for n in nodes]
        for i, node in enumerate(nodes):
            digest = OTHER if i == 2 else AGREED
            await publish(node, f"peer-{i}", round=4, tokens=(i + 1) * 100_000, digest=digest)
            named = {"peers": [p for p in ids if p != ids[i]], "round": 4, "at": time.time()}
            await node.dht.store(partners_key(SWARM), named, ttl=120)
        if stranger is not None:
            config = NodeConfig(server=None, peers=(nodes[0].endpoint,))
            async with NetNode(identity=stranger, config=config) as liar:
                claim = status_value("fast-gpu", round=999_999, tokens=10**12, loss=-1e9)
                claim["tokens_per_s"] = 1e9
                await liar.dht.store(status_key(SWARM), claim, ttl=120)
                named = {"peers": ids, "round": 999_999, "at": time.time()}
                await liar.dht.store(partners_key(SWARM), named, ttl=120)
        yield nodes


PIPELINED = SwarmManifest(
    task="gpt-bytes",
    model={"preset": "tiny", "pipeline": {"stages": [{}, {}], "encoding": "int8"}},
    data={},
    hparams={},
    name="pipelined run",
)


@asynccontextmanager
async def pipelined_swarm():
    """A pipelined run's stage peers as their ``stage-load`` records say (pipeline/load.py):
    two at stage 0 (100 and 110 sequences a second, at rounds 3 and 4), one at stage 1 (30,
    round 5: each stage averages in rounds of its own; it refused 2 calls and skipped a
    step; 2 drivers' sessions are open with it, and it dropped 3 micro-batches of drivers
    gone)."""
    async with loopback_network(3) as nodes:
        await publish_manifest(nodes[0].dht, PIPELINED)
        said = zip(nodes, (0, 0, 1), (100.0, 110.0, 30.0), (3, 4, 5), strict=True)
        for node, stage, rate, round_ in said:
            load = {"rate": rate, "queue": 2, "free": 6, "round": round_}
            if stage == 1:
                load |= {"refused": 2, "skipped": 1, "drivers": 2, "orphaned": 3}
            elif rate == 110.0:  # a driver whose audits found out a replica
                load |= {"distrusted": 1}
            await publish_load(
                node.dht, PIPELINED.swarm_id, stage=stage, endpoint=node.endpoint, load=load
            )
        yield nodes


async def test_a_pipelined_runs_state_shows_its_stages():
    async with (
        pipelined_swarm() as nodes,
        dashboard(nodes[0].endpoint, manifest=PIPELINED) as (collector, url, http),
    ):
        for _ in range(2):  # (a move is seen between two readings)
            await collector.poll()
        async with http.get(url + "api/v1/state") as response:
            view = await response.json()
    pipeline = view["pipeline"]
    assert [(r["peers"], r["throughput"], r["queue"]) for r in pipeline["stages"]] == [
        (2, 210.0, 4),
        (1, 30.0, 2),
    ]
    assert pipeline["limiting"] == 1 and pipeline["throughput"] == 30.0
    assert [r["round"] for r in pipeline["stages"]] == [4, 5]
    assert [(r["refused"], r["skipped"]) for r in pipeline["stages"]] == [(0, 0), (2, 1)]
    assert [r["distrusted"] for r in pipeline["stages"]] == [1, 0]
    assert [(r["drivers"], r["orphaned"]) for r in pipeline["stages"]] == [(0, 0), (2, 3)]
    assert pipeline["moves"] == 0 and view["warnings"] == []


async def test_a_pipelined_run_on_a_dataset_shows_the_epoch_its_stage_0_readers_say():
    """The stage-0 peers of a pipelined run on a pinned dataset say its epoch in their
    stage's status records (its swarm's, not the run's): the run's view reads them, from
    the peers whose ``stage-load`` servers vouch for them."""
    from swarmloco.core.runspec import RunSpec
    from swarmloco.pipeline.manifest import pipeline_manifest, stage_manifest
    from swarmloco.pipeline.stages import gpt_stages
    from swarmloco.train.spec import GPTConfig

    gpt = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
    run = pipeline_manifest(
        RunSpec(sync_every=4, delay=1), gpt_stages(gpt, 2, seed=0),
        creator=Identity.generate().public_key.hex(), task="gpt-bytes", identity_work=0,
        data={"source": "dataset", "dataset": "ab" * 20},
    )  # fmt: skip
    readers = stage_manifest(run, 0).swarm_id
    async with loopback_network(3) as nodes:
        await publish_manifest(nodes[0].dht, run)
        for node, landed in zip(nodes[:2], (100, 300), strict=True):
            data = {"epoch": 0, "landed": landed, "sequences": 462, "leased": 2, "done": 3,
                    "shards": 11}  # fmt: skip
            value = status_value("reader", round=2, tokens=4096, loss=2.0) | {"data": data}
            await node.dht.store(status_key(readers), value, ttl=120)
            load = {"rate": 10.0, "queue": 0, "free": 6}
            await publish_load(node.dht, run.swarm_id, stage=0, endpoint=node.endpoint, load=load)
        async with dashboard(nodes[0].endpoint, manifest=run) as (collector, url, http):
            await collector.poll()
            async with http.get(url + "api/v1/state") as response:
                view = await response.json()
    assert view["dataset"] is not None, view
    assert view["dataset"]["landed"] == 300 and view["dataset"]["readers"] == 2, view["dataset"]


async def test_a_pipelined_runs_pools_count_only_the_records_their_servers_vouch_for():
    """Forty strangers' keys claim stage 1, each at an address of its own network: two at
    an honest stage peer's address (whose server answers as itself), the rest where nothing
    serves. The pools count the three honest replicas alone, as the peers' rebalancing
    does, and say how many records they left out."""
    async with pipelined_swarm() as nodes:
        for i in range(40):
            endpoint = nodes[i].endpoint if i < 2 else f"127.0.{i}.1:{closed_port()}"
            stranger = NetNode(
                identity=Identity.generate(), config=NodeConfig(peers=(nodes[0].endpoint,))
            )
            async with stranger:
                await publish_load(
                    stranger.dht,
                    PIPELINED.swarm_id,
                    stage=1,
                    endpoint=endpoint,
                    load={"rate": 1e4, "queue": 0, "free": 64},
                )
        async with dashboard(nodes[0].endpoint, manifest=PIPELINED) as (collector, url, http):
            await collector.poll()
            async with http.get(url + "api/v1/state") as response:
                view = await response.json()
    pipeline = view["pipeline"]
    assert [(r["peers"], r["throughput"]) for r in pipeline["stages"]] == [(2, 210.0), (1, 30.0)]
    assert pipeline["limiting"] == 1, pipeline
    assert any("40 stage-load record(s) not counted: no server" in w for w in view["warnings"])


async def test_the_state_shows_every_peer_and_the_swarm():
    async with swarm_of_three() as nodes, dashboard(nodes[0].endpoint) as (collector, url, http):
        await collector.poll()
        async with http.get(url + "api/v1/state") as response:
            assert response.status == 200
            assert response.content_type == "application/json"
            assert response.headers["Cache-Control"] == "no-store"
            assert response.headers["X-Content-Type-Options"] == "nosniff"
            assert "default-src 'none'" in response.headers["Content-Security-Policy"]
            view = await response.json()
        assert view["error"] is None
        assert view["swarm"]["name"] == "loopback run" and view["swarm"]["params"] == 812_544
        assert view["peers_online"] == 3 and view["round"] == 4
        assert view["swarm"]["rounds_total"] == 40 and view["progress"]["of"] == 40
        assert view["tokens_per_s"] == 3 * 2048.0
        assert view["peers_listed"] == {"trainer": 3}
        assert {p["id"] for p in view["peers"]} == {n.identity.peer_id_hex for n in nodes}
        shares = {p["name"]: p["share"] for p in view["peers"]}
        assert shares == {"peer-0": 0.1667, "peer-1": 0.3333, "peer-2": 0.5}
        assert {p["endpoint"] for p in view["peers"]} == {n.endpoint for n in nodes}
        assert view["agreement"]["round"] == 4
        assert (view["agreement"]["holders"], view["agreement"]["published"]) == (2, 3)
        (round4,) = view["rounds"]
        assert round4["group"] == 3 and round4["compression"] == 4.0 and round4["reported"] == 3
        assert view["next_round"] == {
            "round": 5,
            "peers": 3,
            "tokens": 3 * 4096,
            "tokens_per_s": 3 * 2048.0,
        }
        assert view["history"]["swarm_loss"][0][1] == 2.0


async def test_a_strangers_claims_are_listed_apart_from_the_trusted_peers_partners():
    stranger = Identity.generate()
    async with (
        swarm_of_three(stranger=stranger) as nodes,
        dashboard(nodes[1].endpoint, trust=(nodes[0].identity.peer_id_hex,)) as (
            collector,
            url,
            http,
        ),
    ):
        await collector.poll()
        async with http.get(url + "api/v1/state") as state:
            view = await state.json()
        async with http.get(url + "metrics") as metrics:
            body = await metrics.text()
    assert {p["id"] for p in view["peers"]} == {n.identity.peer_id_hex for n in nodes}
    assert [p["id"] for p in view["uncounted"]] == [stranger.peer_id_hex]
    assert view["peers_online"] == 3 and view["peers_uncounted"] == 1
    assert view["tokens_per_s"] == 3 * 2048.0 and view["round"] == 4 and view["loss"] == 2.0
    assert view["trust"]["anchored"] and view["trust"]["vouched"] == 2
    families = {f.name: f for f in text_string_to_metric_families(body)}
    (uncounted,) = families["swarmloco_peers_uncounted"].samples
    assert uncounted.value == 1


async def test_metrics_parse_as_prometheus_text():
    async with swarm_of_three() as nodes, dashboard(nodes[1].endpoint) as (collector, url, http):
        await collector.poll()
        async with http.get(url + "metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert response.headers["Cache-Control"] == "no-store"
            body = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(body)}

    def value(name: str) -> float:
        (sample,) = families[name].samples
        return sample.value

    assert value("swarmloco_peers_online") == 3
    assert value("swarmloco_swarm_tokens_per_second") == 3 * 2048.0
    assert value("swarmloco_round") == 4
    assert value("swarmloco_dashboard_read_ok") == 1
    assert value("swarmloco_round_agreement_ratio") == pytest.approx(2 / 3, abs=1e-3)
    assert value("swarmloco_last_round_compression_ratio") == 4.0
    per_peer = {s.labels["name"]: s.value for s in families["swarmloco_peer_tokens"].samples}
    assert per_peer == {"peer-0": 100_000, "peer-1": 200_000, "peer-2": 300_000}
    peers = {s.labels["peer"] for s in families["swarmloco_peer_online"].samples}
    assert peers == {n.identity.peer_id_hex[:12] for n in nodes}
    (info,) = families["swarmloco_swarm_info"].samples
    assert info.labels == {
        "swarm_id": SWARM,
        "name": "loopback run",
        "task": "gpt-bytes",
        "preset": "tiny",
    }


async def test_only_get_and_head_from_a_loopback_host():
    async with loopback_network(1) as nodes, dashboard(nodes[0].endpoint) as (_, url, http):
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            for path in ("", "api/v1/state", "metrics", "nowhere"):
                async with http.request(method, url + path, data=b"x") as response:
                    assert response.status == 405, (method, path)
                    assert set(response.headers["Allow"].split(",")) == {"GET", "HEAD"}
                    assert response.headers["X-Content-Type-Options"] == "nosniff"
        async with http.head(url) as response:
            assert response.status == 200 and await response.read() == b""
        async with http.get(url + "nowhere") as response:
            assert response.status == 404
            assert response.headers["X-Content-Type-Options"] == "nosniff"
        # A page elsewhere that rebinds its own name to 127.0.0.1 is refused.
        async with http.get(url + "api/v1/state", headers={"Host": "evil.example"}) as response:
            assert response.status == 421
        async with http.get(url + "api/v1/state", headers={"Host": "localhost:1"}) as response:
            assert response.status == 200
            # Not read yet: the view says so instead of failing.
            assert (await response.json())["error"] == "not read yet"


async def test_the_page_is_self_contained_and_its_script_is_allowed_by_hash():
    async with (
        loopback_network(1) as nodes,
        dashboard(nodes[0].endpoint) as (_, url, http),
        http.get(url) as response,
    ):
        assert response.status == 200
        assert response.content_type == "text/html"
        csp = response.headers["Content-Security-Policy"]
        page = await response.text()
    (script,) = re.findall(r"<script>(.*?)</script>", page, flags=re.DOTALL)
    (style,) = re.findall(r"<style>(.*?)</style>", page, flags=re.DOTALL)
    for inline in (script, style):
        digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp
    assert "'unsafe-inline'" not in csp and "default-src 'none'" in csp
    assert "connect-src 'self'" in csp
    # Nothing is loaded from elsewhere: no src/href attributes, no CSS imports or urls, and
    # the only absolute URL is the SVG namespace (a name, never fetched).
    assert not re.search(r"\b(src|href)\s*=", page)
    assert "@import" not in page and "url(" not in page
    assert set(re.findall(r"[a-z]+://[^\s\"']*", page)) == {"http://www.w3.org/2000/svg"}
    assert re.findall(r"fetch\(([^,)]*)", page) == ['"api/v1/state"']
    for needle in (
        "peers online",
        "swarm tokens/s",
        "current round",
        "loss-chart",
        "time-chart",
        "bytes-chart",
        "compression",
    ):
        assert needle in page


async def test_the_collector_survives_the_network_going_away_and_joins_again():
    hub = NetNode(identity=Identity.generate(), config=NodeConfig())
    await hub.__aenter__()
    try:
        port = int(hub.endpoint.rsplit(":", 1)[1])
        await publish_manifest(hub.dht, MANIFEST)
        await publish(hub, "hub", round=2, tokens=1000, digest=AGREED)
        async with dashboard(hub.endpoint, timeout_s=2.0) as (collector, url, http):
            ok = await collector.poll()
            assert ok["error"] is None and ok["peers_online"] == 1
            await hub.__aexit__(None, None, None)  # the only node the reader knows goes away
            failed = await collector.poll()
            assert failed["error"] and "no DHT node answered" in failed["error"]
            # The last records stay on show while they are fresh.
            assert failed["peers_online"] == 1 and failed["peers"][0]["name"] == "hub"
            async with http.get(url + "metrics") as response:
                assert "swarmloco_dashboard_read_ok 0.0" in await response.text()
            # A node comes back on the same address, with new records; the reader joins it.
            again = NetNode(
                identity=Identity.generate(), config=NodeConfig(server=ServerConfig(port=port))
            )
            async with again:
                await publish(again, "hub-again", round=3, tokens=2000, digest=AGREED)
                deadline = time.monotonic() + 20
                view = failed
                while view["error"] and time.monotonic() < deadline:
                    view = await collector.poll()
                assert view["error"] is None
                assert [p["name"] for p in view["peers"]] == ["hub-again"]
                assert view["round"] == 3
            assert collector.failures >= 1
    finally:
        await hub.__aexit__(None, None, None)


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
PARTIAL = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


async def half_open(port: int, *, source: str, count: int, say: bytes) -> list[Connection]:
    """``count`` connections from ``source`` that send ``say`` (part of a request, or
    nothing) and then neither finish nor close."""
    opened = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(say)
        opened.append((reader, writer))
    return opened


async def page_from(port: int, source: str) -> bytes:
    """The answer to one GET of the page, over a new connection from ``source``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_one_address_cannot_hold_more_connections_than_its_share():
    rejections = RejectionLog(logging.getLogger("test.dashboard"))
    config = HttpConfig(header_timeout_s=60.0, max_connections_per_source=16)
    app = make_app(lambda: {})
    async with (
        serve(app, host="127.0.0.1", port=0, config=config, rejections=rejections) as url,
        aiohttp.ClientSession() as http,
    ):
        port = int(url.rsplit(":", 1)[1].strip("/"))
        held = await half_open(port, source="127.0.0.2", count=16, say=PARTIAL)
        turned_away = await half_open(port, source="127.0.0.2", count=104, say=PARTIAL)
        try:
            # Each one past its share is answered 503 and closed as it opens.
            for reader, _ in turned_away:
                answer = await asyncio.wait_for(reader.read(), 10)
                assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert rejections.counts["too-many-connections"] == 104
            # The page answers everyone else meanwhile.
            for _ in range(3):
                async with http.get(url) as response:
                    assert response.status == 200
                    assert "peers online" in await response.text()
            # Once the held ones close, the address has its share again.
            for _, writer in held:
                writer.close()
            deadline = time.monotonic() + 10
            while not (await page_from(port, "127.0.0.2")).startswith(b"HTTP/1.1 200 "):
                assert time.monotonic() < deadline, "the address never got its share back"
                await asyncio.sleep(0.01)
        finally:
            for _, writer in held + turned_away:
                writer.close()


async def test_half_open_and_idle_connections_are_closed_and_the_page_keeps_answering():
    rejections = RejectionLog(logging.getLogger("test.dashboard"))
    config = HttpConfig(header_timeout_s=0.5, keepalive_s=0.5, max_connections_per_source=128)
    async with (
        serve(
            make_app(lambda: {}), host="127.0.0.1", port=0, config=config, rejections=rejections
        ) as url,
        aiohttp.ClientSession() as http,
    ):
        port = int(url.rsplit(":", 1)[1].strip("/"))
        opened_at = time.monotonic()
        slow = await half_open(port, source="127.0.0.3", count=100, say=PARTIAL)
        silent = await half_open(port, source="127.0.0.4", count=20, say=b"")
        # Held open, they do not keep the page from anyone.
        async with http.get(url) as response:
            assert response.status == 200
        # Each is closed once its headers are late: the server ends it (EOF here).
        for reader, _ in slow + silent:
            assert await asyncio.wait_for(reader.read(), 20) == b""
        assert time.monotonic() - opened_at >= config.header_timeout_s
        assert rejections.counts["header-timeout"] == 120
        # A connection idle after its response is closed after the keep-alive.
        (kept,) = await half_open(port, source="127.0.0.3", count=1, say=b"")
        kept[1].write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await asyncio.wait_for(kept[0].readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        await asyncio.wait_for(kept[0].readexactly(length), 10)
        assert await asyncio.wait_for(kept[0].read(), 20) == b""
        kept[1].close()
        async with http.get(url) as response:
            assert response.status == 200
        for _, writer in slow + silent:
            writer.close()


def test_http_limits_must_make_sense():
    with pytest.raises(ValueError):
        HttpConfig(header_timeout_s=0)
    with pytest.raises(ValueError):
        HttpConfig(max_connections_per_source=0)
