#!/usr/bin/env python3
"""Datasets for a run: how fast `swarmloco data prepare` tokenizes, and how fast a peer
fetches a pinned dataset. Prints ONE JSON object.

- ``prepare``: ``--megabytes`` of real text (the Python standard library's source, cycled)
  as JSONL, tokenized with a byte-level BPE tokenizer of ``--vocab`` tokens trained on it
  (the training is timed apart); ``prepare_mb_per_s`` (MB of text per second) and
  ``prepare_mb_per_s_per_core`` (over the cores the process may use), the median of
  ``--repeats``.
- ``fetch``: the prepared dataset fetched whole into an empty cache, every shard checked
  against its hash: from a local HTTP mirror (``swarmloco data serve``) on loopback, from a
  peer (its ``swarmloco.v1.DatasetFiles`` service over gRPC with TLS, on loopback), and from
  a local copy read in place (hashing only); ``fetch_http_mb_per_s``,
  ``fetch_peer_mb_per_s``, ``fetch_local_mb_per_s``.

- ``churn``: every sequence of an epoch landing once through churn (DESIGN section 11): a
  dataset of about ``--churn-tokens`` tokens of the same text in shards of 3,000, three
  ``swarmloco join`` peers of the tiny preset (sequences of 64 tokens) around a bootstrap
  node, up to ``--churn-kills`` SIGKILLs of a peer at random moments (seeded: after 0 to
  2 more of its rounds and up to 1.5 s; each killed peer started again from its data
  directory; a peer that already left is not killed), leases of 4 s, ``--max-epochs 1``; then
  what landed in the state the run ends on (of the peers' last checkpoints, the newest
  round's; ``final_round``, and ``states_agree`` when every peer's last state holds the
  same) against the epoch: ``tokens_duplicated`` and ``tokens_missing`` (targets 0 and 0;
  a sequence of 64 targets counts 64 tokens), with ``tokens_wasted`` (trained and never
  landed in it: what the peers' ``--read-log`` files say they read, killed runs included,
  less what landed), ``tokens_given_back`` (read again after a download, a discard or a
  left-out contribution, as the peers logged it), the seconds the epoch took, and
  ``audits`` (the union of the peers' audits, each contribution once: what the peers saw
  land, in states later dropped too). With ``--churn-box``, peer ``c`` is a box of 2 ranks
  (``--nproc-per-node 2``: its rank 0 leases and deals each rank its sequences), killed
  as a whole (its daemon SIGKILLed: the ranks die with it) and started again like the
  others (``churn_box``). With ``--churn-pipeline``, the run is a pipeline of 2 stages
  (``--stages 2``): ``a``, ``b`` and ``c`` serve stage 0 (they read the dataset and are
  killed as above), one more peer serves stage 1 throughout and leaves by itself once the
  readers are gone (``--leave-idle``: ``stage1_left_by_itself``; what it trained that no
  round of its stage averaged, as it left: ``stage1_unaveraged_tokens_at_leave``, from its
  ``stopped`` event), and the final state is
  stage 0's (``churn_pipeline``; DESIGN section 10, "A pinned dataset"). Stage 1's
  leaving line says the micro-batches of killed readers it dropped at their deadline and
  at their sessions' end (``stage1_inputs_dropped_at_deadline``,
  ``stage1_micro_batches_of_drivers_gone``). With ``--churn-freeze S``, each victim is
  SIGSTOPped for S seconds and then SIGCONTed instead of killed (a machine that froze,
  slept or dropped off its network and came back: nothing closes its connections), not
  started again.
- ``squat``: keys that list shards and never read them (docs/SECURITY.md, "Datasets"): the
  churn soak's dataset and peers with no kill, twice in one run of the bench: ``clean``,
  and ``squatted``, where a stranger's key (a DHT node of its own, its proof of work
  solved) lists the dataset's last ``--squat-shards`` shards before the peers start and
  renews the listing every second until they end, reading nothing; the peers run with
  ``--lease-idle-seconds`` ``--squat-idle``. For each arm: the peers' exit codes, the
  seconds the epoch took, ``tokens_duplicated`` and ``tokens_missing`` in the final state
  (targets 0 and 0),
  and for the squatted arm whether the listed shards landed whole
  (``squat_listed_landed``) and ``squat_extra_seconds`` (the squatted epoch's seconds less
  the clean one's: the idle wait and the listed shards' reading, about ``--squat-idle``).

    python scripts/bench_data.py [--megabytes 50] [--vocab 8192] [--repeats 3]
    python scripts/bench_data.py --parts churn [--churn-tokens 150000] [--churn-kills 6]
                                 [--churn-box | --churn-pipeline]
    python scripts/bench_data.py --parts squat [--squat-shards 4] [--squat-idle 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

from swarmloco.dataset.fetch import DatasetCache, HttpSource, LocalSource, Source
from swarmloco.dataset.index import read_index
from swarmloco.dataset.peers import FileServer, PeerReader, PeerSource, holdings_in
from swarmloco.dataset.prepare import PrepareConfig, prepare, train_tokenizer
from swarmloco.dataset.serve import serve_dataset
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import RejectionLog
from swarmloco.runtime.loop_thread import LoopThread


def write_corpus(path: Path, megabytes: float) -> int:
    """JSONL documents (one standard-library file each, cycled) up to ``megabytes``."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    written = 0
    with path.open("w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            for source in files:
                text = source.read_text(encoding="utf-8", errors="replace")
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line.encode())
                if written >= megabytes * 1e6:
                    break
    return written


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--megabytes", type=float, default=50.0, help="text to prepare (MB)")
    p.add_argument("--vocab", type=int, default=8192, help="the trained tokenizer's vocabulary")
    p.add_argument("--shard-tokens", type=int, default=1 << 22, help="tokens a shard holds")
    p.add_argument("--repeats", type=int, default=3, help="runs of each part")
    p.add_argument("--dir", type=Path, default=None, help="where to work (default: a temp dir)")
    p.add_argument(
        "--parts",
        default="prepare,fetch,churn",
        help="comma-separated: prepare, fetch, churn, squat",
    )
    p.add_argument("--churn-tokens", type=int, default=150_000, help="the churn soak's dataset")
    p.add_argument("--churn-kills", type=int, default=6, help="SIGKILLs during the churn soak")
    p.add_argument("--seed", type=int, default=0, help="when the churn soak's kills fall")
    p.add_argument(
        "--churn-box",
        action="store_true",
        help="the churn soak's peer c is a box of 2 ranks (killed and started as a whole)",
    )
    p.add_argument(
        "--churn-freeze",
        type=float,
        default=0.0,
        help="the churn soak freezes its victims instead: SIGSTOP for this many seconds, "
        "then SIGCONT (a machine that froze, slept or dropped off its network and came "
        "back; 0: SIGKILL and start again)",
    )
    p.add_argument(
        "--churn-pipeline",
        action="store_true",
        help="the churn soak's run is a pipeline of 2 stages: its 3 peers serve stage 0, "
        "one more stage 1",
    )
    p.add_argument("--squat-shards", type=int, default=4, help="shards the squatter lists (1 to 4)")
    p.add_argument(
        "--squat-idle",
        type=float,
        default=20.0,
        help="the peers' --lease-idle-seconds in the squat part (at least 8)",
    )
    args = p.parse_args()
    parts = set(args.parts.split(","))
    known = {"prepare", "fetch", "churn", "squat"}
    if parts - known or not parts:
        p.error(f"--parts: unknown {sorted(parts - known)}")
    if args.churn_box and args.churn_pipeline:
        p.error("--churn-box and --churn-pipeline: a stage is served by one process")
    if args.churn_freeze < 0 or (args.churn_freeze and args.churn_box):
        p.error("--churn-freeze: seconds >= 0, without --churn-box (its ranks are processes "
                "of their own)")  # fmt: skip
    if not 1 <= args.squat_shards <= 4:
        p.error(
            f"--squat-shards: 1 to 4 (a leases record lists 4 at most), got {args.squat_shards}"
        )
    work = Path(tempfile.mkdtemp(prefix="swarmloco-bench-data-", dir=args.dir))
    try:
        report = {
            "bench": "data",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine(),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
        if parts & {"prepare", "fetch"}:
            report.update(run(args, work))
        if "churn" in parts:
            report.update(churn(args, work / "churn"))
        if "squat" in parts:
            report.update(squat(args, work / "squat"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    corpus = work / "corpus.jsonl"
    text_bytes = write_corpus(corpus, args.megabytes)
    started = time.perf_counter()
    tokenizer = train_tokenizer([corpus], args.vocab, "text")
    train_s = time.perf_counter() - started
    tokenizer.save(str(work / "tokenizer.json"))
    config = PrepareConfig(shard_tokens=args.shard_tokens)
    times = []
    for i in range(args.repeats):
        out = work / f"prepared-{i}"
        done = prepare([corpus], out, tokenizer=work / "tokenizer.json", config=config,
                       progress=False)  # fmt: skip
        times.append(done.seconds)
        if i:
            shutil.rmtree(out)
    data = work / "prepared-0"
    index = read_index(data)
    dataset_bytes = index.tokens * index.token_bytes

    def fetch_all(source: Source, name: str) -> list[float]:
        times = []
        for i in range(args.repeats):
            cache = DatasetCache(work / f"{name}-{i}", index.dataset_id, [source])
            started = time.perf_counter()
            cache.all_shards(cache.index(), progress=False)
            times.append(time.perf_counter() - started)
            shutil.rmtree(work / f"{name}-{i}", ignore_errors=True)
        return times

    with serve_dataset(data) as url:
        http = fetch_all(HttpSource(url), "http")
    refusals = RejectionLog(logging.getLogger("bench"))
    server = FileServer(holdings_in([data], work / "none"), rejections=refusals)
    node = NetNode(identity=Identity.generate(), config=NodeConfig(), services=[server.service()])
    with LoopThread(name="bench-peer") as loop:
        loop.run(node.__aenter__(), timeout=60)
        try:
            with PeerReader([node.endpoint]) as reader:
                peer = fetch_all(PeerSource(node.endpoint, index.dataset_id, reader), "peer")
        finally:
            loop.run(node.__aexit__(None, None, None), timeout=60)
    local = fetch_all(LocalSource(data), "local")
    prepare_s = statistics.median(times)
    return {
        "text_bytes": text_bytes,
        "tokens": index.tokens,
        "shards": len(index.shards),
        "dataset_bytes": dataset_bytes,
        "tokenizer_train_s": round(train_s, 3),
        "prepare_s": [round(t, 3) for t in times],
        "prepare_mb_per_s": round(text_bytes / 1e6 / prepare_s, 2),
        "prepare_mb_per_s_per_core": round(text_bytes / 1e6 / prepare_s / cores(), 2),
        "cores": cores(),
        "fetch_http_s": [round(t, 3) for t in http],
        "fetch_http_mb_per_s": round(dataset_bytes / 1e6 / statistics.median(http), 1),
        "fetch_local_s": [round(t, 3) for t in local],
        "fetch_local_mb_per_s": round(dataset_bytes / 1e6 / statistics.median(local), 1),
        "fetch_peer_s": [round(t, 3) for t in peer],
        "fetch_peer_mb_per_s": round(dataset_bytes / 1e6 / statistics.median(peer), 1),
    }


SEQ_LEN = 64
"""The churn and squat parts' sequences (tokens)."""


def soak_dataset(args: argparse.Namespace, work: Path) -> tuple[Path, list[int]]:
    """The churn and squat parts' dataset: about ``--churn-tokens`` tokens in shards of
    3,000, prepared under ``work``; its directory and each shard's training sequences."""
    import numpy as np

    from swarmloco.dataset.ledger import Sequences

    work.mkdir(parents=True)
    corpus = work / "corpus.jsonl"
    write_corpus(corpus, args.churn_tokens * 2.2 / 1e6)  # about 2.2 bytes of text a token
    tokenizer = train_tokenizer([corpus], 400, "text")
    tokenizer.save(str(work / "tokenizer.json"))
    data = work / "data"
    prepare([corpus], data, tokenizer=work / "tokenizer.json",
            config=PrepareConfig(shard_tokens=3000), progress=False)  # fmt: skip
    index = read_index(data)
    shards = [np.fromfile(data / f"shard-{i:05d}.bin", dtype=np.dtype(index.dtype))
              for i in range(len(index.shards))]  # fmt: skip
    return data, Sequences(shards, seq_len=SEQ_LEN, val_fraction=0.05).counts


LEAVE_IDLE_S = 20
"""(``--churn-pipeline``.) The stage-1 peer's ``--leave-idle``."""
STAGE_LEFT = r"inputs dropped: (\d+) at their deadline, (\d+) of drivers gone"


def churn(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The churn soak (see the module)."""
    import random
    import signal

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
    from swarmutil import Bootstrap, PeerProcess, process_gone, rank_pid

    from swarmloco.dataset.ledger import coverage, read_audit

    data, counts = soak_dataset(args, work)
    seq_len = SEQ_LEN
    rng = random.Random(args.seed)
    peer = ("--dataset", str(data), "--max-epochs", "1", "--lease-seconds", "4")
    started = time.monotonic()
    runs: list[Any] = []
    victims: list[str] = []  # the peers killed (and started again), in order
    left_idle = False  # (--churn-pipeline) the stage-1 peer left by itself
    unaveraged = None  # and the tokens it trained that no round of its stage averaged
    stages = ("--stages", "2") if args.churn_pipeline else ()
    stage = ("--stage", "0") if args.churn_pipeline else ()
    with Bootstrap(work / "boot") as boot:
        swarm = PeerProcess.publish(work / "creator", boot.endpoint, "--dataset", str(data),
                                    "--seq-len", str(seq_len), *stages)  # fmt: skip
        if args.churn_pipeline:  # stage 1's peer first: the readers drive through it
            # It leaves by itself once the readers are gone (no driver's session, no
            # micro-batch for LEAVE_IDLE_S): a reader killed and started again keeps it.
            leave = ("--leave-idle", str(LEAVE_IDLE_S))
            later = PeerProcess.join(swarm, boot.endpoint, work / "s1", "--stage", "1", *leave)
            runs.append(later)
            later.wait_for("ready", timeout=120)

        def join(n: str) -> PeerProcess:
            box = ("--nproc-per-node", "2") if args.churn_box and n == "c" else ()
            return PeerProcess.join(swarm, boot.endpoint, work / n, *peer, *box, *stage,
                                    "--read-log", str(work / f"{n}.reads"))  # fmt: skip

        peers = {n: join(n) for n in "abc"}
        runs += peers.values()
        try:
            for _ in range(args.churn_kills):
                name = rng.choice("abc")
                victim = peers[name]
                if victim.process.poll() is not None:
                    continue  # it left: the epoch is near its end
                # After a random number of its rounds (0 to 2 more than it had).
                have = len(victim.of("round"))
                more = rng.randint(0, 2)
                with contextlib.suppress(AssertionError):
                    victim.wait_for(
                        "round",
                        lambda e, v=victim, n=have + more: len(v.of("round")) > n,
                        timeout=60,
                    )
                time.sleep(rng.uniform(0.0, 1.5))  # a random moment of the round after
                if args.churn_freeze > 0:
                    if victim.process.poll() is None:
                        victim.process.send_signal(signal.SIGSTOP)
                        time.sleep(args.churn_freeze)  # the freeze: a setting of the bench
                        victim.process.send_signal(signal.SIGCONT)
                        victims.append(name)
                    continue
                if victim.process.poll() is None:
                    boxed = []  # a box's ranks, which die with its daemon
                    if name == "c" and args.churn_box:
                        for r in (0, 1):
                            with contextlib.suppress(AssertionError):  # (one that left)
                                boxed.append(rank_pid(victim, r))
                    victim.process.send_signal(signal.SIGKILL)
                    victim.wait(30)
                    assert all(process_gone(pid) for pid in boxed), boxed  # (they hold its lock)
                peers[name] = join(name)
                runs.append(peers[name])
                victims.append(name)
            codes = {n: p.wait(600) for n, p in peers.items()}
            ended = time.monotonic()  # the epoch's end: the readers left
            if args.churn_pipeline:
                try:
                    codes["s1"] = later.wait(90 + LEAVE_IDLE_S)
                except AssertionError:  # it did not leave: said below, and stopped here
                    later.process.send_signal(signal.SIGINT)
                    codes["s1"] = later.wait(90)
                stopped = later.of("stopped")
                left_idle = bool(stopped) and "--leave-idle" in stopped[-1]["reason"]
                # What it trained that no applied round of its stage averaged, as it left.
                unaveraged = stopped[-1].get("unaveraged_tokens") if stopped else None
        finally:
            for p in runs:
                if p.process.poll() is None:
                    p.kill()
    seconds = ended - started
    final, final_round, agree = final_state(work)
    cover = final.coverage(counts, epoch=0)
    audits = coverage([read_audit(work / n / "audit.jsonl") for n in "abc"], counts, epoch=0)
    read = sum(
        count
        for n in "abc"
        if (work / f"{n}.reads").exists()
        for line in (work / f"{n}.reads").read_text().splitlines()
        for _, _, _, count in json.loads(line)
    )
    given = sum(
        int(m.group(1))
        for p in runs
        for line in p.log
        if (m := re.search(r"(\d+) sequence\(s\) given back", line))
    )
    pipeline = {}
    if args.churn_pipeline:
        # Stage 1's micro-batches of killed drivers: inputs held for a backward that never
        # came, dropped at their deadline; and those dropped, or not taken, once the
        # driver's session ended with its process (its "left stage" line says both).
        found = [m for line in later.log if (m := re.search(STAGE_LEFT, line))]
        pipeline = {
            "stage1_inputs_dropped_at_deadline": int(found[-1].group(1)) if found else None,
            "stage1_micro_batches_of_drivers_gone": int(found[-1].group(2)) if found else None,
            "stage1_left_by_itself": left_idle,
            "stage1_unaveraged_tokens_at_leave": unaveraged,
        }
    return {
        **pipeline,
        "churn_sequences": cover.sequences,
        "churn_shards": len(counts),
        "churn_seq_len": seq_len,
        "churn_kills": len(victims),
        "churn_box": args.churn_box,
        "churn_pipeline": args.churn_pipeline,
        "churn_freeze_s": args.churn_freeze,
        "churn_victims": victims,
        "churn_exit_codes": codes,
        "churn_seconds": round(seconds, 1),
        "tokens_landed": cover.landed * seq_len,
        "tokens_duplicated": cover.duplicated * seq_len,
        "tokens_missing": cover.missing * seq_len,
        "tokens_given_back": given * seq_len,
        "tokens_read": read * seq_len,
        "tokens_wasted": (read - cover.landed - cover.duplicated) * seq_len,
        "final_round": final_round,
        "states_agree": agree,
        "audits": {
            "tokens_landed": audits.landed * seq_len,
            "tokens_duplicated": audits.duplicated * seq_len,
            "tokens_missing": audits.missing * seq_len,
        },
    }


class Squatter:
    """A stranger's key that lists ``shards`` (of epoch 0) in a run's ``leases`` record and
    renews the listing every second, reading nothing: a DHT node of its own (no server)
    joined through ``boot``, its proof of work solved when the run asks for one."""

    def __init__(self, boot: str, swarm_id: str, shards: list[int]) -> None:
        self.boot, self.swarm_id, self.shards = boot, swarm_id, shards
        self.stored = 0
        """Listings stored (each counted once per node that took it)."""
        self.error = ""
        self._stop = threading.Event()
        self._loop = LoopThread(name="squatter")

    def __enter__(self) -> Squatter:
        self._done = self._loop.start().submit(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._done.result(60)  # (it keeps its own errors: _run says them in ``error``)
        self._loop.stop()

    async def _run(self) -> None:
        from swarmloco.net.records import leases_key
        from swarmloco.net.swarm import fetch_manifest
        from swarmloco.net.work import IdentityWork, solve

        identity = Identity.generate()
        node = NetNode(identity=identity, config=NodeConfig(server=None, peers=(self.boot,)))
        try:
            async with node:
                manifest = await fetch_manifest(node.dht, self.swarm_id)
                if manifest.identity_work:
                    nonce = await asyncio.to_thread(
                        solve, self.swarm_id, identity.peer_id, manifest.identity_work
                    )
                    node.dht.admit(
                        IdentityWork(swarm_id=self.swarm_id, bits=manifest.identity_work, own=nonce)
                    )
                value = {"shards": [[0, s] for s in self.shards]}
                while not self._stop.is_set():
                    at = {**value, "at": node.dht.clock()}
                    self.stored += await node.dht.store(leases_key(self.swarm_id), at, ttl=10.0)
                    await asyncio.to_thread(self._stop.wait, 1.0)
        except Exception as exc:  # said in the report: an arm without its squatter is void
            self.error = f"{type(exc).__name__}: {exc}"


def final_state(where: Path, names: str = "abc") -> tuple[Any, int, bool]:
    """What landed in the state the run ends on (``dataset.ledger.Landed``): of the peers'
    last checkpoints under ``where``, the newest round's (the most landed of equal rounds);
    its round, and whether every peer's last state holds the same."""
    from swarmloco.dataset.ledger import Landed
    from swarmloco.runtime.checkpoint import CheckpointStore

    last: list[tuple[int, int, Landed]] = []
    for n in names:
        for swarm_dir in (where / n / "swarms").iterdir():
            if not (swarm_dir / "checkpoints").is_dir():
                continue  # (a stage peer keeps its run's manifest beside its stage's swarm)
            with CheckpointStore(
                swarm_dir / "checkpoints", swarm_id=swarm_dir.name, readonly=True
            ) as store:
                found = store.latest()
            if found is not None:
                landed = Landed.from_tensor(found.state["diloco"]["landed"])
                last.append((found.round, sum(r.count for r in landed.ranges), landed))
    if not last:
        return Landed(), 0, False
    round_, _, landed = max(last, key=lambda x: (x[0], x[1]))
    return landed, round_, all(x[2] == landed for x in last)


def squat(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Keys that list shards and never read them (see the module)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
    from swarmutil import Bootstrap, PeerProcess

    data, counts = soak_dataset(args, work)
    report: dict[str, Any] = {"squat_sequences": sum(counts), "squat_shards": len(counts)}
    peer = ("--dataset", str(data), "--max-epochs", "1", "--lease-seconds", "4",
            "--lease-idle-seconds", str(args.squat_idle))  # fmt: skip
    seconds: dict[str, float] = {}
    for arm in ("clean", "squatted"):
        where = work / arm
        runs: list[Any] = []
        listed: list[int] = []
        with Bootstrap(where / "boot") as boot, contextlib.ExitStack() as stack:
            swarm = PeerProcess.publish(where / "creator", boot.endpoint, "--dataset", str(data),
                                        "--seq-len", str(SEQ_LEN))  # fmt: skip
            squatter = None
            if arm == "squatted":
                listed = list(range(len(counts) - args.squat_shards, len(counts)))
                squatter = stack.enter_context(Squatter(boot.endpoint, swarm, listed))
                deadline = time.monotonic() + 60
                while squatter.stored == 0 and not squatter.error:  # listed before peers come
                    if time.monotonic() > deadline:
                        squatter.error = "no listing stored in 60 s"
                        break
                    time.sleep(0.1)
            started = time.monotonic()
            try:
                runs = [PeerProcess.join(swarm, boot.endpoint, where / n, *peer) for n in "abc"]
                end = time.monotonic() + 600
                codes: dict[str, int | str] = {}
                for n, p in zip("abc", runs, strict=True):
                    try:
                        codes[n] = p.wait(max(1.0, end - time.monotonic()))
                    except subprocess.TimeoutExpired:  # held at the epoch's end
                        codes[n] = "did not end in 600 s"
            finally:
                for p in runs:
                    if p.process.poll() is None:
                        p.kill()
        seconds[arm] = time.monotonic() - started
        final, final_round, agree = final_state(where)
        cover = final.coverage(counts, epoch=0)
        report[f"squat_{arm}"] = {
            "exit_codes": codes,
            "seconds": round(seconds[arm], 1),
            "tokens_landed": cover.landed * SEQ_LEN,
            "tokens_duplicated": cover.duplicated * SEQ_LEN,
            "tokens_missing": cover.missing * SEQ_LEN,
            "final_round": final_round,
            "states_agree": agree,
        }
        if squatter is not None:
            whole = {s: sum(b - a for a, b in final.of(0, s)) for s in listed}
            report["squat_listed_shards"] = listed
            report["squat_listed_landed"] = all(whole[s] == counts[s] for s in listed)
            report["squat_listings_stored"] = squatter.stored
            report["squat_error"] = squatter.error
    report["squat_extra_seconds"] = round(seconds["squatted"] - seconds["clean"], 1)
    return report


if __name__ == "__main__":
    sys.exit(main())
