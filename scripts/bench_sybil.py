#!/usr/bin/env python3
"""A stranger with many keys against a real swarm: the attacks of issue 30 at once, summed
up in ONE JSON object on stdout.

    python scripts/bench_sybil.py                       # 1,000 keys, 4 addresses, 120 s
    python scripts/bench_sybil.py --seconds 60 --keys 200

A bootstrap node, a dashboard and ``--peers`` (4) tiny training peers (`swarmloco join`,
one process each, serving on 127.0.0.2-5; peer 0's key created the run, so the dashboard
trusts it) train through an unmeasured ``--warmup`` (60 s: young processes grow as they
fill their caches) and a clean window of ``--seconds``; then
an attacker with ``--keys`` keys, each proven for the run (``--identity-work`` bits, a
public run's 8 by default; minted on every core before the swarm trains, once the run
exists), calling from four addresses of its own (127.0.0.10-13, through local forwarders:
a gRPC client cannot pick its source address), runs every attack for another
``--seconds``. In the world the attacker runs on machines of its own; here it shares the
swarm's cores, unless ``--attacker-cores N`` gives it N of its own (and the swarm the rest,
in both windows). On 2 cores that leaves the swarm one, on which it applied 6 rounds in
120 s, too few to compare, and answered the attacker's TLS handshakes too late for most
attacks to start (2026-11-26): the figures in docs/SECURITY.md share the cores.

1. state poisoning: each round the swarm applies, the attacker downloads the honest state,
   serves it with the outer momentum x1000 from four servers of its own, and publishes
   its digest under 200 keys for that round and the next (with progress claims ahead);
2. fake leaders: 30 announced keys ready to lead each next round, at listeners that
   accept TCP and never answer;
3. TLS claims: Pings whose self-signed cards claim every honest address with random keys;
4. RPC slots: 128 never-ending health ``Watch`` streams per address at every peer;
5. memory: Pings with a 7 MiB signature at every node;
6. the peer list: a ``peers`` record for every key;
7. donor slots: slow readers of every peer's state from two addresses (just above the
   donors' minimum rate, asking again as each download ends), and pulls as fast as the
   donors allow from a third;
9. the dashboard: 20 status records with absurd figures, each naming the honest peers and
   the other 19 as partners, and 500 half-open connections;
10. logs: malformed Store calls, one connection each.

(Attack 8, checkpoints after corruption, is about a peer's own disk, not the network:
``tests/unit/test_checkpoint.py`` and ``tests/net/test_swarm_peers.py`` cover it.)

The report: ``poisoned_peers`` (honest peers that took a forged state, or whose eval loss
turned non-finite or 1.5x what it was before the attack), ``excluded_peers`` (honest peers
with no round averaged with another honest peer during the attack), ``rounds_ratio``
(rounds applied during the attack over the clean window's), ``peak_rss_growth_mb`` (the
most any honest process's resident memory rose during the attack above its own peak in the
clean window: peers, bootstrap, dashboard, sampled each second; ``rss_growth_mb`` has each
one's rise from the window's first sample, as reported before 2026-11-27),
``mint_cpu_s`` (CPU seconds the attacker spent making its keys and their proofs of work),
what each attack got, and the machine. ``newcomer_clean`` and ``newcomer_attacked``: a
fresh peer that joins ``--join-after`` (20 s) into each window (the first leaves at the
window's end, so both windows end with the same swarm): seconds from its start to the
swarm's state (``state_s``) and to its first round averaged with others (``grouped_s``),
the rounds it averaged with others, and whether it took a forged state (then it counts
in ``poisoned_peers`` too). Logs, events and checkpoints stay in ``--dir``.
On one machine loopback callers are exempt from donors' per-network limits (a local swarm
is its operator's own), so attack 7 binds here only through the donors' global slots;
``tests/net/test_state_transfer.py`` runs it with the limits on.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "net"))  # the source-address forwarder

import grpc  # noqa: E402
import torch  # noqa: E402
from _bench_common import machine, process_cpu_s, status_mb, stop_processes  # noqa: E402
from chaos import PEER_OPTIONS as CHAOS_PEER_OPTIONS  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from local_swarm import COMMAND, publish_swarm, read_events, start_bootstrap  # noqa: E402
from sourceproxy import SourceProxy  # noqa: E402

from swarmloco.core.manifest import PUBLIC_IDENTITY_WORK  # noqa: E402
from swarmloco.core.state import MOMENTUM, StateSchema, StateSnapshot  # noqa: E402
from swarmloco.net.client import ClientConfig, RpcClient  # noqa: E402
from swarmloco.net.deadline import Deadline  # noqa: E402
from swarmloco.net.dht.contact import sign_card  # noqa: E402
from swarmloco.net.dht.transport import PING, STORE  # noqa: E402
from swarmloco.net.dht.wire import signed_store_request  # noqa: E402
from swarmloco.net.endpoints import parse_endpoint  # noqa: E402
from swarmloco.net.identity import Identity  # noqa: E402
from swarmloco.net.node import NetNode, NodeConfig  # noqa: E402
from swarmloco.net.records import (  # noqa: E402
    MAX_PARTNERS,
    MEMBER_FIELD,
    Record,
    digest_key,
    make_record,
    partners_key,
    peers_key,
    progress_key,
    round_key,
    status_key,
)
from swarmloco.net.server import ServerConfig  # noqa: E402
from swarmloco.net.state import (  # noqa: E402
    Donor,
    Requester,
    StateDonor,
    download_state,
    state_service,
)
from swarmloco.net.state.wire import DOWNLOAD_PATH, encode_request  # noqa: E402
from swarmloco.net.swarm import fetch_manifest  # noqa: E402
from swarmloco.net.tls import TLS_SERVER_NAME, fetch_certificate  # noqa: E402
from swarmloco.net.work import solve  # noqa: E402
from swarmloco.proto.v1 import dht_pb2  # noqa: E402
from swarmloco.runtime.swarm import manifest_signature, manifest_spec  # noqa: E402

SOURCES = ("127.0.0.10", "127.0.0.11", "127.0.0.12", "127.0.0.13")
SWARM_OPTIONS = ("--preset", "tiny", "--batch-size", "4", "--sync-every", "20")
# The soak's peers (each on an address of its own here, not its 127.0.0.1), counting the
# attacker's loopback addresses as networks of their own in the donor's limits, as they
# would count its public ones.
PEER_OPTIONS = (*CHAOS_PEER_OPTIONS[2:], "--limit-local-downloads")
assert CHAOS_PEER_OPTIONS[:2] == ("--host", "127.0.0.1")
FORGED_KEYS = 200  # keys publishing each forged digest
FAKE_LEADERS = 30
WATCHES = 128  # per source address and peer
BIG_SIGNATURE = 7 * 1024 * 1024
HALF_OPEN = 500
FAKE_STATUS = 20
BAD_STORES = 200


def log(message: str) -> None:
    print(f"[sybil {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rss_mb(pid: int) -> float | None:
    return status_mb(pid, "VmRSS")


class Honest:
    """One honest training peer (a `swarmloco join` process) and its events."""

    def __init__(self, index: int, run_dir: Path, swarm: str, boot: str) -> None:
        self.index = index
        self.host = f"127.0.0.{2 + index}"
        assert self.host not in SOURCES, "more peers than addresses below the attacker's"
        self.started = time.time()
        self.events_file = run_dir / f"peer{index}.events"
        self.log_file = run_dir / f"peer{index}.log"
        self.process = subprocess.Popen(
            [
                *COMMAND,
                "join",
                swarm,
                "--peer",
                boot,
                "--host",
                self.host,
                *PEER_OPTIONS,
                "--data-dir",
                str(run_dir / f"peer{index}"),
                "--events",
                str(self.events_file),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log_file.open("w"),
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self._offset = 0

    def poll(self) -> None:
        new, self._offset = read_events(self.events_file, self._offset)
        self.events.extend(new)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def endpoint(self) -> str:
        ready = self.of("ready")
        return ready[0]["endpoint"] if ready else ""

    @property
    def round(self) -> int:
        rounds = [e["round"] for e in self.of("round")] + [
            e["round"] for e in self.of("downloaded")
        ]
        return max(rounds, default=0)

    def log_lines(self) -> int:
        with contextlib.suppress(OSError):
            return sum(1 for _ in self.log_file.open(errors="replace"))
        return 0


def _key(seed: bytes) -> Identity:
    return Identity(Ed25519PrivateKey.from_private_bytes(seed))


def _mint_one(job: tuple[str, int, bytes]) -> tuple[bytes, float]:
    """One key (from its seed) and its proof of work for the swarm, in a worker process:
    the nonce, and the CPU seconds making both took."""
    swarm, bits, seed = job
    started = time.process_time()
    identity = _key(seed)
    nonce = solve(swarm, identity.peer_id, bits) if bits else b""
    return nonce, time.process_time() - started


def mint(swarm: str, bits: int, count: int) -> tuple[list[tuple[Identity, bytes]], float]:
    """``count`` keys with their proofs for ``swarm``, on every core; and the CPU seconds
    they cost in all."""
    seeds = [os.urandom(32) for _ in range(count)]
    with multiprocessing.get_context("spawn").Pool(os.cpu_count() or 1) as pool:
        made = pool.map(_mint_one, [(swarm, bits, seed) for seed in seeds], chunksize=8)
    keys = [(_key(seed), nonce) for seed, (nonce, _) in zip(seeds, made, strict=True)]
    return keys, sum(cpu for _, cpu in made)


class Attacker:
    """One stranger: its minted keys (with their proofs of work), four source addresses,
    every attack at once."""

    def __init__(
        self,
        *,
        swarm: str,
        boot: str,
        peers: list[str],
        dashboard: str,
        keys: list[tuple[Identity, bytes]],
    ) -> None:
        self.swarm = swarm
        self.boot = boot
        self.peers = peers
        self.dashboard = dashboard
        self.keys = [identity for identity, _ in keys]
        self.proofs = {identity.peer_id_hex: nonce for identity, nonce in keys}
        self.stats: dict[str, Any] = {
            "forged_digests": [],
            "forged_published": 0,
            "fake_leader_entries": 0,
            "claiming_pings": 0,
            "watch_streams_open": 0,
            "watch_streams_refused": 0,
            "big_pings": 0,
            "big_pings_refused": 0,
            "peer_records_stored": 0,
            "slow_reads_started": 0,
            "slow_reads_cut": 0,
            "slow_reads_yielded": 0,
            "pulls_served": 0,
            "pulls_refused": 0,
            "fake_status_stored": 0,
            "half_open": 0,
            "bad_stores": 0,
        }
        self.errors: collections.Counter[str] = collections.Counter()
        """What went wrong for the attacker (refusals it was told of), by message."""
        self._stack = AsyncExitStack()
        self._proxies: dict[tuple[str, str], SourceProxy] = {}
        self._client = RpcClient(ClientConfig(attempts=1))
        self._listeners: list[asyncio.Server] = []
        self._held: list[Any] = []
        self._servers: list[tuple[NetNode, list[StateSnapshot]]] = []

    async def __aenter__(self) -> Attacker:
        await self._stack.enter_async_context(self._client)
        # A reader of the swarm (client mode: it serves nothing) and four state servers.
        self.reader = await self._stack.enter_async_context(
            NetNode(
                identity=Identity.generate(),
                config=NodeConfig(server=None, peers=(self.boot,)),
            )
        )
        for i, source in enumerate(SOURCES):
            holder: list[StateSnapshot] = []
            donor = StateDonor(
                identity=self.keys[i],
                snapshot=lambda h=holder: h[-1] if h else None,
                previous=lambda h=holder: h[-2] if len(h) > 1 else None,
            )
            node = await self._stack.enter_async_context(
                NetNode(
                    identity=self.keys[i],
                    config=NodeConfig(server=ServerConfig(host=source), peers=(self.boot,)),
                    services=[state_service(donor)],
                )
            )
            self._servers.append((node, holder))
            listener = await asyncio.start_server(self._silent, source, 0)
            self._listeners.append(listener)
        manifest = await fetch_manifest(self.reader.dht, self.swarm)
        spec = manifest_spec(manifest)
        self.numel = manifest_signature(manifest).layout(spec.codec.block_size).numel
        self.schema = StateSchema.diloco(self.numel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._held:
            with contextlib.suppress(Exception):
                closing = writer.close()  # a stream's is plain, a gRPC channel's a coroutine
                if asyncio.iscoroutine(closing):
                    await closing
        for listener in self._listeners:
            listener.close()
        await self._stack.aclose()

    async def _silent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._held.append(writer)  # accepted; never a byte back

    def _silent_endpoint(self, i: int) -> str:
        port = self._listeners[i % len(self._listeners)].sockets[0].getsockname()[1]
        return f"{SOURCES[i % len(SOURCES)]}:{port}"

    async def via(self, source: str, endpoint: str) -> str:
        """Where to dial ``endpoint`` so that it sees the call come from ``source``."""
        proxy = self._proxies.get((source, endpoint))
        if proxy is None:
            proxy = SourceProxy(source, parse_endpoint(endpoint))
            await self._stack.enter_async_context(proxy)
            self._proxies[(source, endpoint)] = proxy
        return proxy.endpoint

    @property
    def nodes(self) -> list[str]:
        return [self.boot, *self.peers]

    async def store(self, records: list[Record], *, source: str) -> int:
        """Store ``records`` at every node of the swarm from ``source`` (a swarm this small
        is every key's k closest nodes); how many node-stores took."""
        sender = self.keys[SOURCES.index(source)]
        node = self._servers[SOURCES.index(source)][0]
        stored = 0
        for start in range(0, len(records), 64):
            batch = records[start : start + 64]
            request = signed_store_request(
                sender, node.dht.card, batch, timestamp_ms=int(time.time() * 1000)
            )
            for endpoint in self.nodes:
                try:
                    answer = await self._client.call(
                        await self.via(source, endpoint), STORE, request, timeout=10.0
                    )
                except Exception as exc:
                    self.errors[type(exc).__name__ + ": " + str(exc)[:120]] += 1
                    continue
                stored += sum(1 for r in answer.results if r.stored)
                for r in answer.results:
                    if not r.stored and r.reason:
                        self.errors[f"store refused: {r.reason[:100]}"] += 1
        return stored

    def _record(self, key: str, value: Any, owner: Identity, ttl: float = 600.0) -> Record:
        proof = self.proofs.get(owner.peer_id_hex, b"")
        if proof:
            value = {**value, MEMBER_FIELD: proof}
        return make_record(key, value, expiration=time.time() + ttl, owner=owner)

    def _request(self, source: str) -> bytes:
        """A download request signed by a proven key of this source's."""
        key = self.keys[SOURCES.index(source)]
        requester = Requester(key, self.proofs.get(key.peer_id_hex, b""))
        return encode_request(swarm_id=self.swarm, nonce=os.urandom(16), requester=requester)

    # -- 1. state poisoning, 2. fake leaders --------------------------------------------------

    async def _latest_round(self) -> tuple[int, list[Donor]]:
        result = await self.reader.dht.get(progress_key(self.swarm))
        mine = {k.peer_id_hex for k in self.keys}
        rounds = [e.value["round"] - 1 for e in result.entries.values() if e.subkey not in mine]
        best = max(rounds, default=0)
        for round in range(best, max(best - 3, 0), -1):
            digests = await self.reader.dht.get(digest_key(self.swarm, round))
            donors = [
                Donor(e.subkey, e.value["endpoint"])
                for e in digests.entries.values()
                if e.subkey not in mine and e.value["endpoint"]
            ]
            if donors:
                return round, donors
        return 0, []

    async def poison_and_lead(self, until: float) -> None:
        last = -1
        while time.monotonic() < until:
            round, donors = await self._latest_round()
            if round > last and donors:
                last = round
                for attack in (self._poison(round, donors), self._fake_leaders(round + 1)):
                    try:
                        await attack
                    except Exception as exc:  # counted: the attacker goes on
                        self.errors[f"{type(exc).__name__}: {exc}"[:160]] += 1
            await asyncio.sleep(1.0)

    async def _poison(self, round: int, donors: list[Donor]) -> None:
        key = self.keys[0]
        got = await download_state(
            self.reader.client,
            donors,
            swarm_id=self.swarm,
            deadline=Deadline.after(30.0),
            expected_round=round,
            schema=self.schema,
            requester=Requester(key, self.proofs.get(key.peer_id_hex, b"")),
        )
        forged = []
        for r in (round, round + 1):
            tensors = dict(got.snapshot.tensors)
            if MOMENTUM in tensors:
                tensors[MOMENTUM] = tensors[MOMENTUM] * 1000.0
            else:
                tensors[MOMENTUM] = torch.ones_like(tensors["theta_g"]) * 1000.0
            forged.append(StateSnapshot.of(swarm_id=self.swarm, round=r, tensors=tensors))
        for _, holder in self._servers:
            holder[:] = forged
        self.stats["forged_digests"] += [f.digest.hex() for f in forged]
        for s, source in enumerate(SOURCES):
            records = []
            for k in range(s, FORGED_KEYS, len(SOURCES)):
                owner = self.keys[k]
                endpoint = self._servers[k % len(SOURCES)][0].endpoint
                for snapshot in forged:
                    value = {"digest": snapshot.digest, "endpoint": endpoint, "at": time.time()}
                    key = digest_key(self.swarm, snapshot.round)
                    records.append(self._record(key, value, owner))
                progress = {
                    "round": round + 2,
                    "tokens": 10**9,
                    "tokens_per_s": 1e9,
                    "at": time.time(),
                }
                records.append(self._record(progress_key(self.swarm), progress, owner))
            self.stats["forged_published"] += await self.store(records, source=source)

    async def _fake_leaders(self, round: int) -> None:
        for s, source in enumerate(SOURCES):
            records = []
            for k in range(FORGED_KEYS + s, FORGED_KEYS + FAKE_LEADERS, len(SOURCES)):
                owner = self.keys[k % len(self.keys)]
                endpoint = self._silent_endpoint(k)
                peer = {"endpoint": endpoint, "role": "trainer", "version": "0.1.0", "public": True}
                records.append(self._record(peers_key(self.swarm), peer, owner))
                entry = {
                    "endpoint": endpoint,
                    "weight": 1.0,
                    "bandwidth": 1e9,
                    "client_mode": False,
                    "announced_at": 0.0,
                    "numel": self.numel,
                }
                records.append(self._record(round_key(self.swarm, round), entry, owner, 120.0))
            self.stats["fake_leader_entries"] += await self.store(records, source=source)

    # -- 3. TLS claims, 5. big pings ------------------------------------------------------------

    async def _ping(self, endpoint: str, card: Any, source: str) -> bool:
        try:
            await self._client.call(
                await self.via(source, endpoint),
                PING,
                dht_pb2.PingRequest(sender=card),
                timeout=10.0,
            )
            return True
        except Exception:
            return False

    async def claim_addresses(self, until: float) -> None:
        while time.monotonic() < until:
            for source in SOURCES:
                for target in self.nodes:
                    for claimed in self.nodes:
                        key = Identity.generate()
                        card = sign_card(key, claimed, tls_fingerprint=os.urandom(32))
                        await self._ping(target, card.to_proto(), source)
                        self.stats["claiming_pings"] += 1
            await asyncio.sleep(10.0)

    async def big_pings(self) -> None:
        for s, source in enumerate(SOURCES):
            for target in self.nodes:
                for _ in range(20 // len(SOURCES)):
                    key = Identity.generate()
                    card = sign_card(key, self._silent_endpoint(s)).to_proto()
                    card.signature = os.urandom(BIG_SIGNATURE)
                    ok = await self._ping(target, card, source)
                    self.stats["big_pings"] += 1
                    self.stats["big_pings_refused"] += not ok

    # -- 4. Watch streams ------------------------------------------------------------------------

    async def _channel(self, source: str, endpoint: str) -> grpc.aio.Channel:
        dial = await self.via(source, endpoint)
        pem = await fetch_certificate(dial, 10.0)
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        cert = x509.load_der_x509_certificate(pem).public_bytes(serialization.Encoding.PEM)
        channel = grpc.aio.secure_channel(
            dial,
            grpc.ssl_channel_credentials(root_certificates=cert),
            options=[("grpc.ssl_target_name_override", TLS_SERVER_NAME)],
        )
        self._held.append(channel)
        return channel

    async def watches(self, until: float) -> None:
        async def hold(stub: Any) -> None:
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.stats["watch_streams_refused"] += 1
                return
            finally:
                call.cancel()

        tasks = []
        for peer in self.peers:
            for source in SOURCES:
                with contextlib.suppress(Exception):
                    stub = health_pb2_grpc.HealthStub(await self._channel(source, peer))
                    tasks += [asyncio.ensure_future(hold(stub)) for _ in range(WATCHES)]
        await asyncio.sleep(max(0.0, min(5.0, until - time.monotonic())))
        self.stats["watch_streams_open"] = sum(1 for t in tasks if not t.done())
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- 6. the peer list, 9. fake status --------------------------------------------------------

    async def fill_peer_list(self) -> None:
        for s, source in enumerate(SOURCES):
            records = []
            for k in range(s, len(self.keys), len(SOURCES)):
                peer = {
                    "endpoint": self._silent_endpoint(k),
                    "role": "trainer",
                    "version": "0.1.0",
                    "public": True,
                }
                records.append(self._record(peers_key(self.swarm), peer, self.keys[k]))
            self.stats["peer_records_stored"] += await self.store(records, source=source)

    async def fake_status(self) -> None:
        records = []
        for owner in self.keys[-FAKE_STATUS:]:
            value = {
                "name": "fast-gpu",
                "state": "training",
                "round": 1_000_000,
                "step": 10**9,
                "tokens": 10**12,
                "tokens_per_s": 2e10,
                "loss": -1e9,
                "eval_loss": -1e9,
                "device": "H200",
                "version": "0.1.0",
                "started_at": time.time() - 10,
                "rounds_applied": 1_000_000,
                "rounds_aborted": 0,
                "downloads": 0,
                "last_error": "",
                "rounds": [],
                "at": time.time(),
            }
            records.append(self._record(status_key(self.swarm), value, owner, 300.0))
        # Each names the honest peers and the other fakes as the peers it averaged with.
        listed = await self.reader.dht.get(peers_key(self.swarm))
        honest = [p for p in listed.entries if p not in self.proofs]
        fakes = [owner.peer_id_hex for owner in self.keys[-FAKE_STATUS:]]
        for owner in self.keys[-FAKE_STATUS:]:
            named = [*honest, *(f for f in fakes if f != owner.peer_id_hex)][:MAX_PARTNERS]
            value = {"peers": named, "round": 1_000_000, "at": time.time()}
            records.append(self._record(partners_key(self.swarm), value, owner, 300.0))
        self.stats["fake_status_stored"] += await self.store(records, source=SOURCES[0])

    async def half_open(self) -> None:
        if not self.dashboard:
            return
        host, port = parse_endpoint(self.dashboard.split("//", 1)[-1].rstrip("/"))
        for i in range(HALF_OPEN):
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection(
                    host, port, local_addr=(SOURCES[i % len(SOURCES)], 0)
                )
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished
                self._held.append(writer)
                self.stats["half_open"] += 1

    # -- 7. donors, 10. logs -----------------------------------------------------------------------

    async def slow_readers(self, until: float) -> None:
        async def read_slowly(peer: str, source: str) -> None:
            # One 1 MiB chunk per 2 s (512 KiB/s, above the donors' 256 KiB/s minimum),
            # asking again at once whenever a download ends or is refused.
            channel = await self._channel(source, peer)
            while time.monotonic() < until:
                call = channel.unary_stream(DOWNLOAD_PATH)(self._request(source))
                self.stats["slow_reads_started"] += 1
                try:
                    async for _ in call:
                        await asyncio.sleep(2.0)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self.stats["slow_reads_cut"] += 1
                        if "another requester asked" in (exc.details() or ""):
                            self.stats["slow_reads_yielded"] += 1
                    await asyncio.sleep(0.5)
                finally:
                    call.cancel()

        async def pull(peer: str, source: str) -> None:
            channel = await self._channel(source, peer)
            while time.monotonic() < until:
                call = channel.unary_stream(DOWNLOAD_PATH)(self._request(source))
                try:
                    async for _ in call:
                        pass
                    self.stats["pulls_served"] += 1
                except grpc.aio.AioRpcError:
                    self.stats["pulls_refused"] += 1
                    await asyncio.sleep(1.0)

        tasks = []
        for peer in self.peers:
            for source in SOURCES[:2]:
                tasks.append(asyncio.ensure_future(read_slowly(peer, source)))
            tasks.append(asyncio.ensure_future(pull(peer, SOURCES[2])))
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def bad_stores(self) -> None:
        # A client of its own: it drops its channel after every call (a new connection per
        # request, what the log's rate limit is about), which must not cut the others'.
        async with RpcClient(ClientConfig(attempts=1)) as client:
            await self._bad_stores(client)

    async def _bad_stores(self, client: RpcClient) -> None:
        for i in range(BAD_STORES):
            source = SOURCES[i % len(SOURCES)]
            key = self.keys[i % len(self.keys)]
            value = {"endpoint": "", "role": "trainer", "version": "0", "public": False}
            record = self._record(peers_key(self.swarm), value, key)
            forged = Record(
                record.key,
                record.subkey,
                record.value,
                record.expiration,
                record.owner_public_key,
                os.urandom(64),  # a signature that does not match
            )
            request = signed_store_request(
                key, sign_card(key, ""), [forged], timestamp_ms=int(time.time() * 1000)
            )
            for endpoint in self.peers:
                dial = await self.via(source, endpoint)
                with contextlib.suppress(Exception):
                    await client.call(dial, STORE, request, timeout=5.0)
                    self.stats["bad_stores"] += 1
                await client.forget(dial)

    async def run(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        attacks = [
            self.poison_and_lead(until),
            self.claim_addresses(until),
            self.watches(until),
            self.slow_readers(until),
            self.big_pings(),
            self.fill_peer_list(),
            self.fake_status(),
            self.half_open(),
            self.bad_stores(),
        ]
        names = [a.__qualname__ for a in attacks]
        outcomes = await asyncio.gather(*attacks, return_exceptions=True)
        for name, outcome in zip(names, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                why = f"{name} failed: {type(outcome).__name__}: {outcome}"[:160]
                self.errors[why] += 1
                log(why)


def start_dashboard(swarm: str, boot: str, run_dir: Path) -> tuple[subprocess.Popen[str], str]:
    dash = subprocess.Popen(
        [*COMMAND, "dashboard", swarm, "--peer", boot, "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=(run_dir / "dashboard.log").open("w"),
        text=True,
    )
    assert dash.stdout is not None
    line = dash.stdout.readline()
    url = line.split("serving ", 1)[-1].split()[0] if "serving " in line else ""
    return dash, url


def window(
    peers: list[Honest],
    seconds: float,
    sample: dict[str, subprocess.Popen[str]],
    join: Callable[[], Honest] | None = None,
    join_after: float = 0.0,
) -> dict[str, Any]:
    """Poll the peers for ``seconds``: rounds applied, each sampled process's growth of
    resident memory (its peak over the window less its size at the start), and the CPU
    seconds this process (the bench, and the attacker in it) spent meanwhile. ``join``
    starts a newcomer ``join_after`` seconds in (returned as ``joiner``, its events read
    to the window's end)."""
    start_round = max(p.round for p in peers)
    base = {name: rss_mb(proc.pid) or 0.0 for name, proc in sample.items()}
    peak = dict(base)
    used = {name: process_cpu_s(proc.pid) for name, proc in sample.items()}
    cpu = time.process_time()
    started = time.monotonic()
    until = started + seconds
    joiner: Honest | None = None
    while time.monotonic() < until:
        time.sleep(1.0)
        if join is not None and joiner is None and time.monotonic() >= started + join_after:
            joiner = join()
        for p in peers:
            p.poll()
        if joiner is not None:
            joiner.poll()
        for name, proc in sample.items():
            peak[name] = max(peak[name], rss_mb(proc.pid) or 0.0)
    return {
        "joiner": joiner,
        "rounds": max(p.round for p in peers) - start_round,
        "rss_growth_mb": {name: round(peak[name] - base[name], 1) for name in base},
        "rss_peak_mb": {name: round(peak[name], 1) for name in base},
        "end_round": max(p.round for p in peers),
        "bench_cpu_s": round(time.process_time() - cpu, 1),
        "cpu_s": {name: round(process_cpu_s(p.pid) - used[name], 1) for name, p in sample.items()},
    }


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process ``pid`` on ``cores`` (threads started later inherit their
    creator's)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), cores)


def newcomer(joiner: Honest | None, forged: set[str]) -> dict[str, Any] | None:
    """What a peer that joined during a window got: seconds from its start to the swarm's
    state and to its first round averaged with others (None: not in the window)."""
    if joiner is None:
        return None

    def after(events: list[dict[str, Any]]) -> float | None:
        return round(events[0]["time"] - joiner.started, 1) if events else None

    grouped = [e for e in joiner.of("round") if e.get("group", 0) >= 2]
    return {
        "state_s": after(joiner.of("downloaded")),
        "grouped_s": after(grouped),
        "rounds_grouped": len(grouped),
        "took_forged": any(e.get("digest") in forged for e in joiner.of("downloaded")),
    }


def eval_loss(peer: Honest) -> float | None:
    """The peer's last eval loss of the global model."""
    losses = [e["eval_loss"] for e in peer.of("round") if e.get("eval_loss") is not None]
    return losses[-1] if losses else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=120.0, help="each window's length")
    parser.add_argument(
        "--identity-work",
        type=int,
        default=PUBLIC_IDENTITY_WORK,
        metavar="BITS",
        help="the run's proof of work per key (default: a public run's, %(default)s); the "
        "attacker proves every key it mints",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="an unmeasured window before the clean one, while young processes fill their "
        "caches (default: %(default)s)",
    )
    parser.add_argument(
        "--attacker-cores",
        type=int,
        default=0,
        metavar="N",
        help="cores of the attacker's own (this process); the swarm's processes get the "
        "rest (default: 0, everyone shares every core)",
    )
    parser.add_argument(
        "--join-after",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="when a fresh peer joins, into each window (default: %(default)s; a negative "
        "value: no newcomer)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where logs and data stay")
    args = parser.parse_args()
    if args.keys < FORGED_KEYS + FAKE_LEADERS + FAKE_STATUS:
        parser.error(f"--keys must be at least {FORGED_KEYS + FAKE_LEADERS + FAKE_STATUS}")
    if args.dir is not None and args.dir.exists() and any(args.dir.iterdir()):
        # A run there would resume the swarm and the peers it holds, whose event logs
        # already name their earlier endpoints: the attacker would aim at those.
        parser.error(f"--dir {args.dir} is not empty: give a new or empty directory")
    run_dir = args.dir or Path(tempfile.mkdtemp(prefix="bench-sybil-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    children: list[subprocess.Popen[str]] = []
    try:
        cores = sorted(os.sched_getaffinity(0))
        if not 0 <= args.attacker_cores < len(cores):
            parser.error(f"--attacker-cores must be in [0, {len(cores) - 1}] on this machine")
        attacker_cores = set(cores[len(cores) - args.attacker_cores :]) or set(cores)
        swarm_cores = set(cores[: len(cores) - args.attacker_cores])
        boot, boot_endpoint = start_bootstrap(run_dir)
        pin(boot.pid, swarm_cores)
        children.append(boot)
        swarm = publish_swarm(
            boot_endpoint,
            run_dir,
            *SWARM_OPTIONS,
            "--total-steps",
            "1000000",
            "--identity-work",
            str(args.identity_work),
        )
        # Keys can be proven only once the run exists; the attacker mints them before the
        # swarm trains, on every core, so that the minting slows no window down.
        log(f"swarm {swarm}: the attacker mints {args.keys} keys ({args.identity_work} bits)")
        minted = time.monotonic()
        keys, mint_cpu_s = mint(swarm, args.identity_work, args.keys)
        mint_wall_s = time.monotonic() - minted
        log(f"minted in {mint_wall_s:.0f} s ({mint_cpu_s:.0f} CPU-s); {args.peers} peers start")
        pin(os.getpid(), swarm_cores)  # the processes started now inherit the swarm's cores
        dash, url = start_dashboard(swarm, boot_endpoint, run_dir)
        children.append(dash)
        peers = [Honest(i, run_dir, swarm, boot_endpoint) for i in range(args.peers)]
        children += [p.process for p in peers]
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # every peer up and averaging with the others
            time.sleep(1.0)
            for p in peers:
                p.poll()
            if all(any(e["group"] >= 2 for e in p.of("round")) for p in peers):
                break
            if any(p.process.poll() is not None for p in peers):
                raise RuntimeError("a peer exited while starting: see its log in " + str(run_dir))
        else:
            raise RuntimeError("the peers did not start averaging within 10 minutes")
        sampled = {"bootstrap": boot, "dashboard": dash}
        sampled.update({f"peer{p.index}": p.process for p in peers})
        if args.warmup > 0:
            log(f"warm-up: {args.warmup:.0f} s (not measured)")
            window(peers, args.warmup, sampled)

        def joiner(index: int) -> Callable[[], Honest] | None:
            if args.join_after < 0:
                return None

            def start() -> Honest:
                log(f"a newcomer (peer {index}) joins")
                fresh = Honest(index, run_dir, swarm, boot_endpoint)
                children.append(fresh.process)
                return fresh

            return start

        log(f"clean window: {args.seconds:.0f} s")
        clean = window(peers, args.seconds, sampled, joiner(args.peers), args.join_after)
        if clean["joiner"] is not None:  # it leaves: both windows end with the same swarm
            stop_processes([clean["joiner"].process])
        before_loss = {p.index: eval_loss(p) for p in peers}
        lines_before = {p.index: p.log_lines() for p in peers}
        seen = {p.index: len(p.events) for p in peers}
        log(f"clean: {clean['rounds']} rounds; the attacker attacks")
        attacker = Attacker(
            swarm=swarm,
            boot=boot_endpoint,
            peers=[p.endpoint for p in peers],
            dashboard=url,
            keys=keys,
        )

        async def attack() -> None:
            async with attacker:
                await attacker.run(args.seconds)

        # The attacker (this process: its thread and its forwarders) at the lowest priority;
        # the swarm's processes were started before and keep theirs.
        pin(os.getpid(), attacker_cores)
        thread = threading.Thread(target=lambda: asyncio.run(attack()), daemon=True)
        thread.start()
        attacked = window(peers, args.seconds, sampled, joiner(args.peers + 1), args.join_after)
        thread.join(120)
        forged = set(attacker.stats["forged_digests"])
        newcomer_clean = newcomer(clean["joiner"], forged)
        newcomer_attacked = newcomer(attacked["joiner"], forged)
        poisoned, excluded = [], []
        for p in peers:
            during = p.events[seen[p.index] :]
            took_forged = any(
                e.get("event") == "downloaded" and e.get("digest") in forged for e in during
            )
            losses = [
                e["eval_loss"]
                for e in during
                if e.get("event") == "round" and e.get("eval_loss") is not None
            ]
            loss = losses[-1] if losses else None
            reference = before_loss[p.index]
            blown = loss is not None and (
                not math.isfinite(loss) or (reference is not None and loss > 1.5 * reference)
            )
            if took_forged or blown:
                poisoned.append(p.index)
        if newcomer_attacked is not None and newcomer_attacked["took_forged"]:
            poisoned.append(args.peers + 1)
            grouped = [e for e in during if e.get("event") == "round" and e.get("group", 0) >= 2]
            if not grouped:
                excluded.append(p.index)
        # What the attack cost each process: its peak during the attack beyond its peak in
        # the clean window (a young peer's resident set swings 25-50 MB on its own, so
        # growth from the window's first sample measures that swing as much as the attack).
        beyond = {
            name: round(max(0.0, attacked["rss_peak_mb"][name] - clean["rss_peak_mb"][name]), 1)
            for name in attacked["rss_peak_mb"]
        }
        growth = max(beyond.values(), default=0.0)
        dashboard_view: dict[str, Any] = {}
        if url:
            import urllib.request

            with contextlib.suppress(Exception):
                state = json.loads(urllib.request.urlopen(url + "api/v1/state", timeout=10).read())
                dashboard_view = {
                    "peers_online": state.get("peers_online"),
                    "peers_uncounted": state.get("peers_uncounted"),
                    "round": state.get("round"),
                    "tokens_per_s": state.get("tokens_per_s"),
                    "warnings": len(state.get("warnings", [])),
                }
        stats = dict(attacker.stats)
        stats["forged_digests"] = len(forged)
        stats["refusals_seen"] = dict(attacker.errors.most_common(12))
        report = {
            "benchmark": "sybil",
            "machine": machine(),
            "settings": {
                "peers": args.peers,
                "keys": args.keys,
                "source_addresses": len(SOURCES),
                "seconds": args.seconds,
                "identity_work": args.identity_work,
                "warmup_s": args.warmup,
                "join_after_s": args.join_after,
                "swarm_cores": sorted(swarm_cores),
                "attacker_cores": sorted(attacker_cores),
                "swarm": list(SWARM_OPTIONS),
            },
            "poisoned_peers": len(poisoned),
            "newcomer_clean": newcomer_clean,
            "newcomer_attacked": newcomer_attacked,
            "excluded_peers": len(excluded),
            "rounds_clean": clean["rounds"],
            "rounds_attacked": attacked["rounds"],
            "rounds_ratio": round(attacked["rounds"] / clean["rounds"], 3)
            if clean["rounds"]
            else None,
            "peak_rss_growth_mb": growth,
            "rss_beyond_clean_peak_mb": beyond,
            "rss_growth_mb": attacked["rss_growth_mb"],
            "rss_growth_mb_clean": clean["rss_growth_mb"],
            "rss_peak_mb": attacked["rss_peak_mb"],
            "rss_peak_mb_clean": clean["rss_peak_mb"],
            "cpu_s": attacked["cpu_s"],
            "cpu_s_clean": clean["cpu_s"],
            # The attacker runs in this process, on the same two cores as the swarm.
            "attacker_cpu_s": attacked["bench_cpu_s"],
            "mint_cpu_s": round(mint_cpu_s, 3),
            "mint_wall_s": round(mint_wall_s, 3),
            "log_lines_during_attack": {
                str(p.index): p.log_lines() - lines_before[p.index] for p in peers
            },
            "eval_loss_before": before_loss,
            "eval_loss_after": {p.index: eval_loss(p) for p in peers},
            "dashboard": dashboard_view,
            "attacker": stats,
            "dir": str(run_dir),
        }
        print(json.dumps(report, indent=1, default=str))
    finally:
        stop_processes(children)


if __name__ == "__main__":
    main()
