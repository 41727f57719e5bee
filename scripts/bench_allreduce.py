#!/usr/bin/env python3
"""All-reduce benchmark: prints ONE JSON object on stdout (progress goes to stderr).

``--peers`` (4) peer processes on loopback average ``--params`` (25M fp32 = 100 MB) each:

1. swarmloco: each peer is this script with ``--worker swarmloco``: a NetNode, a
   Matchmaker and an Averager on its own uvloop event loop, torch on one thread, its codec
   backend settled for the vector's size as a peer's is (compiled, and compiled before the
   first round, from 4M values). After one warm-up round (connections open, buffers
   allocated), ``--rounds`` rounds are timed: matchmaking
   (``form_group``) on its own, then the round from the moment the first member holds the
   group to the moment the last member holds the result (the agreement included), and the
   CPU time of each peer process over that span. Bytes are the averaging messages each
   peer sent (``bytes_sent``), also cross-checked with the loopback interface counters.
   Every member declares its vector's norm, so the group's norm bound (4x the median) is
   checked on every chunk, as in a daemon. Beside each round a probe sleeps 5 ms at a time
   on each peer's event loop: ``swarmloco_loop_lag_max_s`` is the latest it woke (the
   loop held by the round's work in one piece, or waiting for a core), and
   ``swarmloco_loop_lag_over_50ms`` how many times a peer's probe woke over 50 ms late in
   a round (medians of the rounds; the worst peer of each).
2. The same with every peer limited to ``--mbit`` (100) Mbit/s up and down by the
   averager's bandwidth limiter; the ideal is the bytes each peer must send at that rate.
3. ``--aggregators``: the same rounds with each aggregator (norm bound on) and with the
   plain mean without the bound, interleaved: ``aggregator_round_s`` gives each median
   and its ratio to the unbounded mean.
4. ``--tls``: a second set of peers that talk plaintext gRPC, its rounds interleaved with
   the first set's (TLS, the default): ``tls_round_s`` gives both medians and their ratio.
5. ``--kill-trials`` (20) rounds in which one peer, chosen at random, is SIGKILLed at a
   random moment of the exchange: a *hang* is a survivor that has neither the result nor
   an abort by the round deadline plus 15 s. The killed peer is restarted for the next
   trial.
6. hivemind 1.1.12's ``DecentralizedAverager`` with ``Uniform8BitQuantization`` on the
   same payload, peers and machine (each peer is this script with ``--worker hivemind``):
   matchmaking runs with ``require_trigger``; once every peer has its group all are
   triggered at once and the round runs from the trigger to the last peer's result; CPU
   counts the peer process and its children (averager process, p2pd).

    .venv-bench/bin/python scripts/bench_allreduce.py             # everything (~5 min)
    python scripts/bench_allreduce.py --skip-hivemind --kill-trials 3 --params 2000000
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def log(message: str) -> None:
    print(f"[bench_allreduce] {message}", file=sys.stderr, flush=True)


def cpu_seconds_tree(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in Path(f"/proc/{p}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, IndexError, ValueError):
            continue
    return total


def loopback_tx_bytes() -> int:
    try:
        return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())
    except OSError:
        return -1


# --------------------------------------------------------------------------- workers


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _vector(index: int, params: int, padded: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 + index)
    vector = torch.zeros(padded)
    vector[:params] = torch.randn(params, generator=g)
    return vector


def swarmloco_worker(args: argparse.Namespace) -> None:
    import asyncio
    import dataclasses
    import faulthandler
    import logging

    import torch
    import uvloop
    from _bench_common import loop_lag

    from swarmloco.core.aggregate import AggregatorConfig
    from swarmloco.core.codec import (
        CodecConfig,
        padded_numel,
        settle_backend,
        warm_up,
    )
    from swarmloco.net.averaging import (
        Averager,
        AveragingConfig,
        BandwidthConfig,
        BandwidthLimiter,
        Matchmaker,
        MatchmakingConfig,
        averaging_service,
    )
    from swarmloco.net.client import ClientConfig
    from swarmloco.net.deadline import Deadline
    from swarmloco.net.identity import Identity
    from swarmloco.net.node import NetNode, NodeConfig
    from swarmloco.net.server import ServerConfig

    faulthandler.register(signal.SIGUSR1)
    logging.basicConfig(
        level=os.environ.get("BENCH_LOG", "WARNING"),
        format=f"[peer {args.index}] %(asctime)s %(name)s %(message)s",
    )
    torch.set_num_threads(1)
    # As a peer does: the backend settled for the vector's size (compiled kernels from 4M
    # values), compiled before it joins, so that no kernel compiles inside a round.
    codec = CodecConfig(backend="auto")
    padded = padded_numel(args.params, codec.block_size)
    codec = settle_backend(codec, padded)
    warm_up(codec)

    async def main() -> None:
        identity = Identity.generate()
        node = NetNode(
            identity=identity,
            config=NodeConfig(
                peers=(args.bootstrap,) if args.bootstrap else (),
                server=ServerConfig(tls=not args.plain, host=args.host),
                client=ClientConfig(tls=not args.plain),
            ),
        )
        matchmaker = Matchmaker(
            identity=identity,
            dht=node.dht,
            client=node.client,
            swarm_id="be" * 20,
            config=MatchmakingConfig(max_group_size=args.peers, gather_s=30.0, poll_s=0.2),
        )
        averager = Averager(
            identity=identity, client=node.client, config=AveragingConfig(codec=codec)
        )
        assert node.server is not None
        node.server.add_service(averaging_service(matchmaker, averager))
        vector = _vector(args.index, args.params, padded)
        norm = float(torch.linalg.vector_norm(vector, dtype=torch.float64))
        mean = torch.empty_like(vector)  # reused every round, as a daemon would
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        async with node:
            _emit({"event": "ready", "endpoint": node.endpoint})
            while True:
                line = await reader.readline()
                if not line:
                    return
                command = json.loads(line)
                if command["cmd"] == "quit":
                    return
                mbit = command.get("mbit", 0)
                averager.limiter = BandwidthLimiter(BandwidthConfig.mbit(mbit)) if mbit else None
                # The reduction bandwidth this peer declares (bytes/s; sizes its part).
                matchmaker.config = dataclasses.replace(
                    matchmaker.config, bandwidth=command.get("declare", 12.5e6)
                )
                averager.config = dataclasses.replace(
                    averager.config,
                    aggregator=AggregatorConfig(
                        method=command.get("aggregator", "mean"),
                        norm_clip=command.get("norm_clip", 4.0),
                    ),
                )
                deadline = Deadline.after(command["deadline"])
                t0 = time.time()
                try:
                    group = await matchmaker.form_group(
                        command["round"],
                        weight=1.0 + args.index,
                        numel=padded,
                        block_size=codec.block_size,
                        deadline=deadline,
                        norm=norm,
                    )
                    t_group = time.time()
                    _emit({"event": "group", "t": t_group, "size": group.size})
                    cpu0 = time.process_time()
                    lags: list[float] = []
                    probe = asyncio.ensure_future(loop_lag(lags))
                    try:
                        result = await averager.all_reduce(
                            group, vector, deadline=deadline, out=mean
                        )
                    finally:
                        probe.cancel()
                    t_done = time.time()
                    cpu = time.process_time() - cpu0
                except Exception as exc:  # report any failure to the orchestrator
                    _emit({"event": "aborted", "error": f"{type(exc).__name__}: {exc}"})
                    continue
                report = result.report
                _emit(
                    {
                        "event": "done",
                        "matchmaking_s": t_group - t0,
                        "t_group": t_group,
                        "t_done": t_done,
                        "cpu_s": cpu,
                        "loop_lag_max_s": max(lags, default=0.0),
                        "loop_lag_over_50ms": sum(lag > 0.05 for lag in lags),
                        "bytes_sent": report.bytes_sent,
                        "bytes_received": report.bytes_received,
                        "digest": report.digest,
                        "excluded": report.excluded,
                        "timings": report.timings,
                        "epochs": [p.epoch for p in report.parts],
                        "own_part": sum(
                            p.stop - p.start for p in report.parts if p.reducer == report.me
                        )
                        / padded,
                    }
                )

    asyncio.run(main()) if os.environ.get("BENCH_LOOP") == "asyncio" else uvloop.run(main())


def hivemind_worker(args: argparse.Namespace) -> None:
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import Uniform8BitQuantization

    torch.set_num_threads(1)
    initial = [args.bootstrap] if args.bootstrap else []
    dht = hivemind.DHT(start=True, initial_peers=initial)
    tensor = _vector(args.index, args.params, args.params)
    averager = hivemind.averaging.DecentralizedAverager(
        averaged_tensors=[tensor],
        dht=dht,
        prefix="bench",
        target_group_size=args.peers,
        min_group_size=args.peers,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        compression=Uniform8BitQuantization(),
        start=True,
    )
    addresses = [str(a) for a in dht.get_visible_maddrs()]
    _emit({"event": "ready", "endpoint": addresses[0]})
    me = os.getpid()
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        control = averager.step(
            wait=False, require_trigger=True, timeout=command["deadline"], weight=1.0 + args.index
        )
        while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
            time.sleep(0.005)
        _emit({"event": "group", "t": time.time()})
        go = json.loads(sys.stdin.readline())
        assert go["cmd"] == "go"
        cpu0 = cpu_seconds_tree(me)
        t_go = time.time()
        control.allow_allreduce()
        try:
            control.result()
        except Exception as exc:  # report any failure to the orchestrator
            _emit({"event": "aborted", "error": f"{type(exc).__name__}: {exc}"})
            continue
        t_done = time.time()
        _emit(
            {
                "event": "done",
                "t_group": t_go,
                "t_done": t_done,
                "cpu_s": cpu_seconds_tree(me) - cpu0,
            }
        )
    averager.shutdown()
    dht.shutdown()


# --------------------------------------------------------------------------- orchestration


class Worker:
    """One peer process, driven by JSON lines on its stdin and stdout."""

    def __init__(
        self,
        kind: str,
        index: int,
        args: argparse.Namespace,
        bootstrap: str,
        *,
        plain: bool = False,
        host: str = "127.0.0.1",
        prefix: tuple[str, ...] = (),
    ) -> None:
        """``host``: the address the peer binds; ``prefix``: what the worker command runs
        under (``ip netns exec NS``)."""
        command = [
            *prefix,
            sys.executable,
            __file__,
            "--worker",
            kind,
            "--index",
            str(index),
            "--peers",
            str(args.peers),
            "--params",
            str(args.params),
            "--host",
            host,
        ]
        if bootstrap:
            command += ["--bootstrap", bootstrap]
        if plain:
            command.append("--plain")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.index = index
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        # A thread per worker turns its stdout into a queue of lines (select() cannot see
        # lines already buffered by readline()).
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self.read(timeout=180)
        assert ready["event"] == "ready", ready
        self.endpoint = ready["endpoint"]

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put("")

    def read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"worker {self.index} said nothing for {timeout:.0f}s") from None
        if not line:
            raise EOFError(f"worker {self.index} exited (code {self.process.poll()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def quit(self) -> None:
        if self.process.poll() is None:
            try:
                self.send(cmd="quit")
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


def start_workers(kind: str, args: argparse.Namespace, *, plain: bool = False) -> list[Worker]:
    first = Worker(kind, 0, args, "", plain=plain)
    rest = [Worker(kind, i, args, first.endpoint, plain=plain) for i in range(1, args.peers)]
    return [first, *rest]


def swarmloco_round(
    workers: list[Worker],
    round: int,
    *,
    mbit: float = 0.0,
    deadline: float = 60.0,
    aggregator: str = "mean",
    norm_clip: float = 4.0,
    declare: list[float] | None = None,
) -> dict[str, Any]:
    """One timed round; ``declare``: each worker's declared bandwidth (bytes/s)."""
    lo_before = loopback_tx_bytes()
    for i, w in enumerate(workers):
        w.send(
            cmd="round",
            round=round,
            declare=declare[i] if declare else 12.5e6,
            mbit=mbit,
            deadline=deadline,
            aggregator=aggregator,
            norm_clip=norm_clip,
        )
    results = []
    for w in workers:
        event = w.read(timeout=deadline + 30)
        if event["event"] == "group":
            event = w.read(timeout=deadline + 30)
        if event["event"] != "done":
            raise RuntimeError(f"worker {w.index}: {event}")
        results.append(event)
    lo_bytes = loopback_tx_bytes() - lo_before
    digests = {r["digest"] for r in results}
    assert len(digests) == 1, f"members hold different results: {digests}"
    return {
        "round_s": max(r["t_done"] for r in results) - min(r["t_group"] for r in results),
        "matchmaking_s": max(r["matchmaking_s"] for r in results),
        "cpu_s_per_peer": statistics.mean(r["cpu_s"] for r in results),
        "cpu_s_max": max(r["cpu_s"] for r in results),
        "loop_lag_max_s": max(r["loop_lag_max_s"] for r in results),
        "loop_lag_over_50ms": max(r["loop_lag_over_50ms"] for r in results),
        "bytes_sent_per_peer": max(r["bytes_sent"] for r in results),
        "loopback_bytes_per_peer": lo_bytes / len(workers),
        "timings": [r["timings"] for r in results],
        "own_parts": [r["own_part"] for r in results],
        "sent": [r["bytes_sent"] for r in results],
    }


def hivemind_round(workers: list[Worker], deadline: float = 120.0) -> dict[str, Any]:
    for w in workers:
        w.send(cmd="round", deadline=deadline)
    for w in workers:
        event = w.read(timeout=deadline + 30)
        assert event["event"] == "group", event
    for w in workers:
        w.send(cmd="go")
    results = []
    for w in workers:
        event = w.read(timeout=deadline + 30)
        if event["event"] != "done":
            raise RuntimeError(f"hivemind worker {w.index}: {event}")
        results.append(event)
    return {
        "round_s": max(r["t_done"] for r in results) - min(r["t_group"] for r in results),
        "cpu_s_per_peer": statistics.mean(r["cpu_s"] for r in results),
    }


def kill_trials(
    args: argparse.Namespace, workers: list[Worker], first_round: int
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    deadline = 30.0
    outcome: dict[str, Any] = {
        "kill_trials": 0,
        "kill_hangs": 0,
        "kill_completed": 0,
        "kill_aborted": 0,
        "kill_diverged": 0,
        "kill_reruns": 0,
        "kill_recovery_s": [],
    }
    reasons: list[str] = []
    for trial in range(args.kill_trials):
        victim = rng.randrange(len(workers))
        round = first_round + trial
        for w in workers:
            w.send(cmd="round", round=round, mbit=0, deadline=deadline)
        event = workers[victim].read(timeout=deadline)
        assert event["event"] == "group", event
        # A random moment of the exchange (an unlimited round takes about half a second).
        time.sleep(rng.uniform(0.0, 0.4))
        workers[victim].kill()
        t_kill = time.time()
        survivors = [w for w in workers if w is not workers[victim]]
        digests = set()
        hung = aborted = 0
        for w in survivors:
            try:
                event = w.read(timeout=deadline + 15)
                if event["event"] == "group":
                    event = w.read(timeout=deadline + 15)
            except TimeoutError:
                hung += 1
                continue
            if event["event"] == "done":
                digests.add(event["digest"])
                outcome["kill_reruns"] += sum(1 for e in event["epochs"] if e > 0)
                outcome["kill_recovery_s"].append(event["t_done"] - t_kill)
            else:
                aborted += 1
                reasons.append(event["error"][:300])
                log(f"kill trial {trial}: survivor {w.index} aborted: {event['error']}")
        outcome["kill_trials"] += 1
        outcome["kill_hangs"] += hung
        if hung:
            log(f"kill trial {trial}: {hung} survivor(s) hung")
        elif aborted:
            outcome["kill_aborted"] += 1
        elif len(digests) == 1:
            outcome["kill_completed"] += 1
        else:
            outcome["kill_diverged"] += 1
        log(f"kill trial {trial}: victim {victim}, {len(digests)} digest(s), {aborted} aborted")
        bootstrap = survivors[0].endpoint
        workers[victim] = Worker("swarmloco", victim, args, bootstrap)
        # One unmeasured round with the new peer (its connections open).
        swarmloco_round(workers, first_round + args.kill_trials + trial + 1000)
    outcome["kill_abort_reasons"] = reasons
    recovery = outcome.pop("kill_recovery_s")
    outcome["kill_survivor_done_after_kill_s_median"] = (
        statistics.median(recovery) if recovery else None
    )
    return outcome


def aggregator_rounds(args: argparse.Namespace, workers: list[Worker]) -> dict[str, Any]:
    """Median round seconds per aggregator, against the plain mean without the norm bound
    (the rounds interleaved, so that drifts of the machine hit every arm alike)."""
    arms = [("mean, no bound", "mean", 0.0)] + [
        (method, method, 4.0) for method in args.aggregators.split(",")
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    for r in range(args.rounds):
        for i, (name, method, clip) in enumerate(arms):
            rnd = 300 + r * len(arms) + i
            outcome = swarmloco_round(workers, rnd, aggregator=method, norm_clip=clip)
            times[name].append(outcome["round_s"])
            cpu[name].append(outcome["cpu_s_per_peer"])
        log(f"aggregator rounds {r}: " + ", ".join(f"{n} {t[-1]:.3f}s" for n, t in times.items()))
    base = statistics.median(times["mean, no bound"])
    return {
        name: {
            "round_s": statistics.median(t),
            "over_unbounded_mean": statistics.median(t) / base,
            "cpu_s_per_peer": statistics.median(cpu[name]),
        }
        for name, t in times.items()
    }


def tls_rounds(args: argparse.Namespace, workers: list[Worker]) -> dict[str, Any]:
    """Median round seconds over TLS (``workers``) and over plaintext gRPC (a second set of
    peers started here), the rounds of the two sets interleaved."""
    log(f"starting {args.peers} plaintext swarmloco peers")
    plain = start_workers("swarmloco", args, plain=True)
    try:
        swarmloco_round(plain, 0)  # warm-up: connections open, buffers allocated
        times: dict[str, list[float]] = {"tls": [], "plain": []}
        for r in range(args.rounds):
            times["tls"].append(swarmloco_round(workers, 500 + r)["round_s"])
            times["plain"].append(swarmloco_round(plain, 500 + r)["round_s"])
            log(f"tls round {r}: tls {times['tls'][-1]:.3f}s, plain {times['plain'][-1]:.3f}s")
    finally:
        for w in plain:
            w.quit()
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {**medians, "tls_over_plain": medians["tls"] / medians["plain"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _bench_common import machine

    out: dict[str, Any] = {"peers": args.peers, "params": args.params}
    log(f"starting {args.peers} swarmloco peers")
    workers = start_workers("swarmloco", args)
    try:
        log("warm-up round (connections open, buffers allocated)")
        swarmloco_round(workers, 0)
        rounds = []
        for r in range(1, args.rounds + 1):
            rounds.append(swarmloco_round(workers, r))
            log(f"round {r}: {rounds[-1]['round_s']:.3f}s")
        out["swarmloco_round_s"] = statistics.median(r["round_s"] for r in rounds)
        out["swarmloco_matchmaking_s"] = statistics.median(r["matchmaking_s"] for r in rounds)
        out["swarmloco_cpu_s_per_peer"] = statistics.median(r["cpu_s_per_peer"] for r in rounds)
        out["swarmloco_cpu_s_max_peer"] = statistics.median(r["cpu_s_max"] for r in rounds)
        # The longest the event loop of any peer was held in one piece during a round, and
        # how many times a peer's loop was held over 50 ms in one round (medians of rounds).
        out["swarmloco_loop_lag_max_s"] = statistics.median(r["loop_lag_max_s"] for r in rounds)
        out["swarmloco_loop_lag_over_50ms"] = statistics.median(
            r["loop_lag_over_50ms"] for r in rounds
        )
        out["bytes_sent_per_peer"] = max(r["bytes_sent_per_peer"] for r in rounds)
        out["loopback_bytes_per_peer"] = statistics.median(
            r["loopback_bytes_per_peer"] for r in rounds
        )
        out["bytes_min_per_peer"] = 2 * (args.peers - 1) / args.peers * args.params
        out["swarmloco_rounds_s"] = [round(r["round_s"], 4) for r in rounds]
        out["swarmloco_phase_timings_round1"] = rounds[0]["timings"]
        limited = []
        for r in range(args.limited_rounds):
            limited.append(swarmloco_round(workers, 100 + r, mbit=args.mbit, deadline=120.0))
            log(f"limited round {r}: {limited[-1]['round_s']:.3f}s")
        if limited:
            out["limited_round_s"] = statistics.median(r["round_s"] for r in limited)
            sent = max(r["bytes_sent_per_peer"] for r in limited)
            out["limited_ideal_s"] = sent / (args.mbit * 1e6 / 8)
            out["limited_mbit"] = args.mbit
        if args.aggregators:
            out["aggregator_round_s"] = aggregator_rounds(args, workers)
        if args.tls:
            out["tls_round_s"] = tls_rounds(args, workers)
        if args.kill_trials:
            log(f"{args.kill_trials} kill trials")
            out.update(kill_trials(args, workers, 200))
    finally:
        for w in workers:
            w.quit()
    if args.skip_hivemind:
        out["hivemind_round_s"] = None
        out["hivemind_skipped"] = "--skip-hivemind"
    else:
        try:
            import hivemind  # noqa: F401
        except ImportError as exc:
            out["hivemind_round_s"] = None
            out["hivemind_skipped"] = f"hivemind is not importable ({exc}); run from .venv-bench"
        else:
            log(f"starting {args.peers} hivemind peers")
            hworkers = start_workers("hivemind", args)
            try:
                hivemind_round(hworkers)  # warm-up
                hrounds = []
                for r in range(args.rounds):
                    hrounds.append(hivemind_round(hworkers))
                    log(f"hivemind round {r}: {hrounds[-1]['round_s']:.3f}s")
                out["hivemind_round_s"] = statistics.median(r["round_s"] for r in hrounds)
                out["hivemind_cpu_s_per_peer"] = statistics.median(
                    r["cpu_s_per_peer"] for r in hrounds
                )
                out["hivemind_rounds_s"] = [round(r["round_s"], 4) for r in hrounds]
            finally:
                for w in hworkers:
                    w.quit()
    out["targets"] = targets(out)
    out["settings"] = {
        "rounds": args.rounds,
        "limited_rounds": args.limited_rounds,
        "kill_trials": args.kill_trials,
        "mbit": args.mbit,
        "aggregators": args.aggregators,
        "tls": args.tls,
        "transport": "gRPC over TLS 1.3 (self-signed P-256, pinned)",
        "norm_clip": 4.0,
        "codec": "int8 absmax, block 1024, fp32 scales, 1 MiB chunks",
        "event_loop": "uvloop",
        "torch_threads_per_peer": 1,
    }
    out["machine"] = machine()
    return out


def targets(out: dict[str, Any]) -> dict[str, bool | None]:
    def ratio(a: str, b: str, at_most: float) -> bool | None:
        if out.get(a) is None or out.get(b) is None:
            return None
        return bool(out[a] <= at_most * out[b])

    return {
        "round_s <= 0.5 x hivemind": ratio("swarmloco_round_s", "hivemind_round_s", 0.5),
        "cpu_s_per_peer <= 0.3": (
            None
            if out.get("swarmloco_cpu_s_per_peer") is None
            else out["swarmloco_cpu_s_per_peer"] <= 0.3
        ),
        "bytes <= 1.05 x min": ratio("bytes_sent_per_peer", "bytes_min_per_peer", 1.05),
        "limited <= 1.15 x ideal": ratio("limited_round_s", "limited_ideal_s", 1.15),
        "kill_hangs == 0": None if "kill_hangs" not in out else out["kill_hangs"] == 0,
        "tls <= 1.2 x plain": (
            None if "tls_round_s" not in out else out["tls_round_s"]["tls_over_plain"] <= 1.2
        ),
        **{
            f"{name} <= 1.3 x unbounded mean": arm["over_unbounded_mean"] <= 1.3
            for name, arm in out.get("aggregator_round_s", {}).items()
            if name != "mean, no bound"
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limited-rounds", type=int, default=1)
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--kill-trials", type=int, default=20)
    parser.add_argument(
        "--aggregators",
        default="mean,trimmed_mean,centered_clip",
        help="aggregators (with the norm bound) to time against the unbounded mean ('' skips)",
    )
    parser.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time rounds over TLS against a second set of plaintext peers (default: on)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hivemind", action="store_true")
    parser.add_argument("--worker", choices=("swarmloco", "hivemind"), help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "swarmloco":
        swarmloco_worker(args)
    elif args.worker == "hivemind":
        hivemind_worker(args)
    else:
        print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
