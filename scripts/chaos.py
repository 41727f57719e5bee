#!/usr/bin/env python3
"""The churn soak: a local swarm under faults, summed up in ONE JSON object on stdout.

    python scripts/chaos.py --minutes 10                 # as in docs/benchmarks.md (~22 min with
                                                         # the fault-free baseline)
    python scripts/chaos.py --minutes 1.5 --quiet 30 --seed 3 --no-baseline   # what CI runs

A bootstrap node and ``--peers`` (5) tiny training peers (`swarmloco join`, one process
each) on 127.0.0.1. The run's clock starts once the swarm has formed (every peer up, a
first round applied), however long that takes on a loaded machine. Then every 20-60 s
(seeded) one peer is hit: SIGKILLed (restarted 3 s later on the same data dir, so it
resumes from its newest checkpoint), SIGKILLed a few milliseconds after it applied a round
(while its checkpoint is being written), or frozen with SIGSTOP for 25-32 s and then
continued. Once, a peer more joins and later leaves; once,
the bootstrap node is killed for good (restarts then rejoin through the peers they
remember). The last ``--quiet`` seconds have no faults: the swarm should settle on one
state. Then every peer is stopped with SIGTERM.

The report: rounds committed, the longest gap between new rounds, rounds applied with
several digests (all run long and in the quiet end), rounds a peer applied and then replaced
by a download, group sizes, restarts that resumed or failed, checkpoints that do not verify,
tracebacks in the logs, peak RSS per peer, whether the final states agree, and the final
eval loss beside the same run without faults (``--baseline``, on by default). Progress
goes to stderr; logs, events and checkpoints stay in ``--dir``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from _bench_common import machine, status_mb
from local_swarm import COMMAND, publish_swarm, read_events, start_bootstrap

# Keys without proofs of work: five peers start at once on two cores, and a proof takes each
# a second or more of CPU, at random; a run with proofs is tested in tests/e2e/test_swarm.py.
SWARM_OPTIONS = ("--preset", "tiny", "--batch-size", "4", "--identity-work", "0")
PEER_OPTIONS = (
    "--host",
    "127.0.0.1",
    "--threads",
    "1",
    "--gather",
    "3",
    "--round-timeout",
    "30",
    "--progress-interval",
    "1",
    "--codec",
    "eager",
    "--eval-every",
    "1",
)
REPLACED = "partners back another state of round"


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident set so far (VmHWM), in MB."""
    return status_mb(pid, "VmHWM")


class Peer:
    """One training peer: its data dir is kept across incarnations (processes)."""

    def __init__(self, index: int, run_dir: Path, swarm: str, boot: str) -> None:
        self.index = index
        self.run_dir = run_dir
        self.swarm = swarm
        self.boot = boot
        self.process: subprocess.Popen[str] | None = None
        self.incarnations = 0
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._events_file: Path | None = None
        self.frozen_until = 0.0
        self.down_until = 0.0
        self.peak_rss = 0.0
        self.killed = False  # the current incarnation was killed by us
        self.also: tuple[str, ...] = ()  # more entry addresses (a live peer's)
        self.outcomes: list[str] = []  # per restart: resumed, fresh, failed

    @property
    def name(self) -> str:
        return f"peer{self.index}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.incarnations += 1
        self._events_file = self.run_dir / f"{self.name}.{self.incarnations}.events"
        self._offset = 0
        self.killed = False
        self.process = subprocess.Popen(
            [
                *COMMAND,
                "join",
                self.swarm,
                "--peer",
                self.boot,
                *(a for peer in self.also for a in ("--peer", peer)),
                *PEER_OPTIONS,
                "--data-dir",
                str(self.run_dir / self.name),
                "--events",
                str(self._events_file),
            ],
            stdout=subprocess.DEVNULL,
            stderr=(self.run_dir / f"{self.name}.log").open("a"),
            text=True,
        )

    def poll(self) -> list[dict[str, Any]]:
        if self._events_file is None:
            return []
        new, self._offset = read_events(self._events_file, self._offset)
        for event in new:
            event["incarnation"] = self.incarnations
        self.events.extend(new)
        if self.alive and self.process is not None:
            self.peak_rss = max(self.peak_rss, peak_rss_mb(self.process.pid) or 0.0)
        return new

    def signal(self, sig: signal.Signals) -> None:
        if self.alive and self.process is not None:
            self.process.send_signal(sig)

    def kill(self) -> None:
        self.poll()
        self.killed = True
        self.signal(signal.SIGCONT)  # a frozen process dies as well, but say so
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()

    def stop(self, timeout: float) -> None:
        self.terminate()
        self.wait(timeout)

    def terminate(self) -> None:
        """Ask it to stop (it saves and says goodbye); :meth:`wait` for it."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Wait for a stop asked for, and kill it after ``timeout`` seconds."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


class Chaos:
    """The fault schedule and its bookkeeping."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, faults: bool) -> None:
        self.args = args
        self.run_dir = run_dir
        self.faults = faults
        self.rng = random.Random(args.seed)
        self.log: list[dict[str, Any]] = []
        self.pending: list[tuple[float, str, Peer]] = []  # (when, action, peer)

    def run(self) -> dict[str, Any]:
        args = self.args
        self.run_dir.mkdir(parents=True, exist_ok=True)
        boot, endpoint = start_bootstrap(self.run_dir)
        options = [
            *SWARM_OPTIONS,
            *("--sync-every", str(args.sync_every), "--seed", str(args.seed)),
            *("--total-steps", str(args.total_steps)),
        ]
        swarm = publish_swarm(endpoint, self.run_dir, *options)
        log(f"swarm {swarm[:12]} via {endpoint} in {self.run_dir} (faults: {self.faults})")
        peers = [Peer(i, self.run_dir, swarm, endpoint) for i in range(args.peers)]
        guest = Peer(args.peers, self.run_dir, swarm, endpoint)
        for peer in peers:
            peer.start()
        formed_after = self._wait_until_formed(peers, boot)
        started = time.monotonic()
        end = started + args.minutes * 60
        quiet_at = end - args.quiet
        chaos_s = max(quiet_at - started, 0.0)
        bootstrap_kill_at = started + chaos_s / 3
        guest_join_at, guest_leave_at = started + chaos_s / 4, started + 3 * chaos_s / 4
        next_fault = started + self.rng.uniform(20, 60)
        quiet_wall = time.time() + (quiet_at - started)
        try:
            while time.monotonic() < end:
                now = time.monotonic()
                for peer in [*peers, guest]:
                    peer.poll()
                    self._check_exit(peer)
                self._due(now)
                if self.faults and now < quiet_at:
                    if boot.poll() is None and now >= bootstrap_kill_at:
                        boot.kill()
                        boot.wait()
                        self._note("kill-bootstrap", None)
                    if guest.incarnations == 0 and now >= guest_join_at:
                        # As a newcomer would: the bootstrap, and addresses the dashboard
                        # lists (the bootstrap may be dead by the time it joins): the
                        # latest of peers up and not frozen. None yet (the peers are still
                        # starting on a loaded machine): join a little later.
                        listed = [
                            ready[-1]["endpoint"]
                            for p in peers
                            if p.alive and p.frozen_until < now
                            and (ready := [e for e in p.events if e["event"] == "ready"])
                        ]  # fmt: skip
                        if listed:
                            guest.also = tuple(listed[:2])
                            guest.start()
                            self._note("join", guest)
                    if guest.alive and now >= guest_leave_at:
                        guest.stop(timeout=60)
                        self._note("leave", guest)
                    if now >= next_fault:
                        self._fault(peers)
                        next_fault = now + self.rng.uniform(20, 60)
                time.sleep(0.25)
        finally:
            log("stopping every peer")
            for peer in [*peers, guest]:
                peer.terminate()  # all at once: each saves and says goodbye meanwhile
            for peer in [*peers, guest]:
                peer.wait(timeout=90)
                peer.poll()
            if boot.poll() is None:
                boot.terminate()
                boot.wait()
        report = self._report(peers, guest, quiet_wall, swarm)
        report["formed_after_s"] = formed_after
        return report

    def _wait_until_formed(self, peers: list[Peer], boot: subprocess.Popen[str]) -> float:
        """Wait until every peer is up and one round has been applied: the schedule's clock
        starts there, not when the processes were spawned, so that on a loaded machine no
        fault lands before the swarm exists (a bootstrap node killed before the peers had
        met each other would end the run, not test it). Seconds waited; SystemExit after
        ``--form-timeout`` or when a peer or the bootstrap node exits meanwhile."""
        spawned = time.monotonic()
        deadline = spawned + self.args.form_timeout
        while True:
            for peer in peers:
                peer.poll()
            kinds = [{e["event"] for e in p.events} for p in peers]
            if all("ready" in k for k in kinds) and any("round" in k for k in kinds):
                waited = round(time.monotonic() - spawned, 1)
                log(f"the swarm formed {waited} s after its peers were started")
                return waited
            dead = [p.name for p in peers if not p.alive]
            if dead or boot.poll() is not None or time.monotonic() > deadline:
                for peer in peers:
                    peer.stop(timeout=30)
                boot.terminate()
                boot.wait()
                why = (
                    f"{', '.join(dead)} exited"
                    if dead
                    else "the bootstrap node exited"
                    if boot.poll() is not None
                    else f"not within --form-timeout ({self.args.form_timeout:g} s)"
                )
                up = sum("ready" in k for k in kinds)
                raise SystemExit(
                    f"the swarm never formed ({up} of {len(peers)} peers up, "
                    f"{'a' if any('round' in k for k in kinds) else 'no'} round applied): "
                    f"{why}; logs in {self.run_dir}"
                )
            time.sleep(0.25)

    # -- faults -----------------------------------------------------------------------------

    def _note(self, action: str, peer: Peer | None, **fields: Any) -> None:
        entry = {"t": round(time.time(), 3), "action": action, "peer": peer.name if peer else ""}
        entry.update(fields)
        self.log.append(entry)
        log(f"{action} {peer.name if peer else ''} {fields if fields else ''}".rstrip())

    def _fault(self, peers: list[Peer]) -> None:
        now = time.monotonic()
        ready = [p for p in peers if p.alive and p.frozen_until < now and p.down_until < now]
        if len(ready) <= 2:  # keep a core of the swarm untouched
            return
        victim = self.rng.choice(ready)
        action = self.rng.choices(["kill", "kill-in-checkpoint", "freeze"], [2, 1, 2])[0]
        if action == "freeze":
            seconds = self.rng.uniform(25, 32)
            victim.signal(signal.SIGSTOP)
            victim.frozen_until = now + seconds
            self.pending.append((now + seconds, "thaw", victim))
            self._note("freeze", victim, seconds=round(seconds, 1))
            return
        if action == "kill-in-checkpoint":
            seen = len(victim.events)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and victim.alive:
                victim.poll()
                if any(e["event"] == "round" for e in victim.events[seen:]):
                    break
                time.sleep(0.005)
            time.sleep(self.rng.uniform(0.0, 0.05))
        victim.kill()
        victim.down_until = now + 3
        self.pending.append((time.monotonic() + 3, "restart", victim))
        self._note(action, victim)

    def _due(self, now: float) -> None:
        for item in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(item)
            _, action, peer = item
            if action == "thaw":
                peer.signal(signal.SIGCONT)
                self._note("thaw", peer)
            elif action == "restart":
                peer.start()
                self._note("restart", peer)

    def _check_exit(self, peer: Peer) -> None:
        """An incarnation that ended without us killing it (or one that never came up)."""
        if (
            peer.process is None
            or peer.incarnations < 2
            or len(peer.outcomes) >= peer.incarnations - 1
        ):
            return
        mine = [e for e in peer.events if e.get("incarnation") == peer.incarnations]
        kinds = {e["event"] for e in mine}
        if "resumed" in kinds:
            peer.outcomes.append("resumed")
        elif "ready" in kinds:
            peer.outcomes.append("fresh")
        elif peer.process.poll() is not None and not peer.killed:
            peer.outcomes.append("failed")

    # -- the report -------------------------------------------------------------------------

    def _report(
        self, peers: list[Peer], guest: Peer, quiet_wall: float, swarm: str
    ) -> dict[str, Any]:
        everyone = [p for p in [*peers, guest] if p.incarnations]
        applied: dict[int, set[str]] = collections.defaultdict(set)
        first_at: dict[int, float] = {}
        groups: collections.Counter[int] = collections.Counter()
        replaced = behind = 0
        for peer in everyone:
            for e in peer.events:
                if e["event"] == "round":
                    applied[e["round"]].add(e["digest"])
                    first_at[e["round"]] = min(first_at.get(e["round"], e["time"]), e["time"])
                    groups[e["group"]] += 1
                elif e["event"] == "downloaded":
                    if REPLACED in e.get("why", ""):
                        replaced += 1
                    else:
                        behind += 1
        several = sorted(r for r, d in applied.items() if len(d) > 1)
        quiet_rounds = [r for r, t in first_at.items() if t >= quiet_wall]
        times = sorted(first_at.values())
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # The final states: the last round every peer still up at the end holds a digest of.
        final: dict[str, dict[int, str]] = {}
        for peer in peers:
            held: dict[int, str] = {}
            for e in peer.events:
                if e["event"] in ("round", "downloaded") and e.get("digest"):
                    held[e["round"]] = e["digest"]
            final[peer.name] = held
        common = set.intersection(*(set(h) for h in final.values())) if final else set()
        final_round = max(common) if common else None
        final_digests = {final[n][final_round] for n in final} if final_round is not None else set()
        last_eval = []
        for peer in peers:
            losses = [
                e["eval_loss"]
                for e in peer.events
                if e["event"] == "round" and e.get("eval_loss") is not None
            ]
            if losses:
                last_eval.append(losses[-1])
        corrupted = 0
        checkpoints = 0
        for peer in everyone:
            corrupted_here, total = _checkpoint_health(self.run_dir / peer.name, swarm)
            corrupted += corrupted_here
            checkpoints += total
        tracebacks = sum(
            (self.run_dir / f"{p.name}.log").read_text(errors="replace").count("Traceback")
            for p in everyone
        )
        outcomes = collections.Counter(o for p in everyone for o in p.outcomes)
        rounds = len(applied)
        return {
            "rounds_committed": rounds,
            "max_gap_s": round(max(gaps), 2) if gaps else None,
            "median_gap_s": round(statistics.median(gaps), 2) if gaps else None,
            "rounds_with_several_digests": len(several),
            "rounds_with_several_digests_share": round(len(several) / rounds, 4)
            if rounds
            else None,
            "several_digests_in_quiet_end": len([r for r in several if r in quiet_rounds]),
            "rounds_in_quiet_end": len(quiet_rounds),
            "applied_then_replaced_by_download": replaced,
            "downloads_when_behind": behind,
            "group_sizes": dict(sorted(groups.items())),
            "restarts": {
                "resumed": outcomes["resumed"],
                "fresh": outcomes["fresh"],
                "failed": outcomes["failed"],
            },
            "checkpoints": checkpoints,
            "corrupted_checkpoints": corrupted,
            "tracebacks": tracebacks,
            "peak_rss_mb": {p.name: round(p.peak_rss, 1) for p in everyone},
            "final_round": final_round,
            "final_digests_agree": len(final_digests) == 1,
            "eval_loss_final": round(statistics.median(last_eval), 4) if last_eval else None,
            "faults": self.log,
        }


def _checkpoint_health(data_dir: Path, swarm: str) -> tuple[int, int]:
    """(checkpoints that do not verify, checkpoints) in a peer's data dir."""
    from swarmloco.runtime.checkpoint import CheckpointStore

    root = data_dir / "swarms" / swarm / "checkpoints"
    if not root.exists():
        return 0, 0
    store = CheckpointStore(root, swarm_id=swarm, readonly=True)
    inventory = store.inventory()
    return sum(1 for _, why in inventory if why), len(inventory)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="length of the run from when the swarm formed (default: 10)",
    )
    parser.add_argument("--peers", type=int, default=5, help="training peers (default: 5)")
    parser.add_argument(
        "--quiet", type=float, default=60.0, help="seconds without faults at the end (default: 60)"
    )
    parser.add_argument(
        "--sync-every", type=int, default=20, help="inner steps per round (default: 20)"
    )
    parser.add_argument(
        "--total-steps",
        type=int,
        default=100_000,
        help="the swarm's schedule length, longer than the run (default: 100000)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the fault schedule's seed (default: 0)"
    )
    parser.add_argument(
        "--form-timeout",
        type=float,
        default=300.0,
        help="most seconds to wait for every peer to be up and a first round applied; "
        "the schedule starts there (default: 300)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where logs, events and checkpoints go (default: a new temporary directory)",
    )
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the same swarm without faults, for its eval loss (default: on)",
    )
    args = parser.parse_args()
    if args.peers < 3:
        parser.error("--peers must be at least 3 (two are always left untouched)")
    run_dir = args.dir or Path(tempfile.mkdtemp(prefix="swarmloco-chaos-"))
    out: dict[str, Any] = {"chaos": Chaos(args, run_dir / "chaos", faults=True).run()}
    if args.baseline:
        log("the same run without faults")
        clean = Chaos(args, run_dir / "clean", faults=False).run()
        out["baseline"] = {
            k: clean[k]
            for k in (
                "rounds_committed",
                "rounds_with_several_digests",
                "final_digests_agree",
                "eval_loss_final",
                "peak_rss_mb",
            )
        }
        a, b = out["chaos"]["eval_loss_final"], clean["eval_loss_final"]
        out["eval_loss_over_baseline"] = round(a / b, 4) if a and b else None
    chaos = out["chaos"]
    out["targets"] = {
        "several digests <= 2% of rounds": (chaos["rounds_with_several_digests_share"] or 0)
        <= 0.02,
        "no several digests in the quiet end": chaos["several_digests_in_quiet_end"] == 0,
        "final digests agree": chaos["final_digests_agree"],
        "no failed restarts": chaos["restarts"]["failed"] == 0,
        "no corrupted checkpoints": chaos["corrupted_checkpoints"] == 0,
        "no tracebacks": chaos["tracebacks"] == 0,
        "peak RSS < 300 MB": max(chaos["peak_rss_mb"].values(), default=0) < 300,
    }
    out["settings"] = {
        "minutes": args.minutes,
        "peers": args.peers,
        "quiet_s": args.quiet,
        "sync_every": args.sync_every,
        "total_steps": args.total_steps,
        "seed": args.seed,
        "swarm": " ".join(SWARM_OPTIONS),
        "peer": " ".join(PEER_OPTIONS),
        "dir": str(run_dir),
    }
    out["machine"] = machine()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
