"""The options of a training peer (`create` and `join`) and the peer's run (a box of ranks
is `cli/box.py`'s)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from swarmloco.cli.box import _box_rank, _init_box, _leave_process_group
from swarmloco.cli.common import (
    _add_tls_options,
    _matchmaking_default,
    _membership_text,
    _peer_default,
    _tls_config,
)


def _add_peer_run_options(parser: argparse.ArgumentParser) -> None:
    """A training peer's own choices (none enters the manifest), defaults from
    :class:`~swarmloco.runtime.config.PeerConfig`."""
    g = parser.add_argument_group("the training peer")
    g.add_argument(
        "--stage",
        type=int,
        default=None,
        metavar="K",
        help="in a pipelined run (create --stages), start by serving stage K (0 draws the data "
        "and drives micro-batches through the others); default: the stage whose checkpoints "
        "--data-dir holds (a restart takes back its stage), else a stage with no peer, else "
        "the one of least throughput",
    )
    g.add_argument(
        "--rebalance-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="in a pipelined run, ask this often whether the stage that limits the pipeline "
        "needs this peer more than its own (then it moves there; one peer per check, never "
        "the last of a stage); 0 keeps the peer at its stage (default: %(default)s)",
    )
    g.add_argument(
        "--rebalance-gap",
        type=float,
        default=0.2,
        metavar="SHARE",
        help="in a pipelined run, move only when the slowest stage's throughput is below the "
        "fastest's by more than this share of it, and moving raises the slower of the two by "
        "more than this share too (from 0 to below 1; the same on every peer of a run, so "
        "that they agree who moves; default: %(default)s)",
    )
    g.add_argument(
        "--rebalance-hold",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a peer that moved stays at least this long (default: %(default)s)",
    )
    g.add_argument(
        "--in-flight",
        type=int,
        default=None,
        metavar="N",
        help="in a pipelined run, a stage-0 peer keeps up to N micro-batches in the pipeline "
        "at once, so that the stages compute side by side (each replica still steps on the "
        "run's batch); default: the run's stage count",
    )
    g.add_argument(
        "--audit-share",
        type=float,
        default=None,
        metavar="SHARE",
        help="in a pipelined run, a stage-0 peer has this share of each later stage's answers "
        "computed again by another replica of the stage and compared; a replica judged "
        "wrong by three answers twice running is not drawn for an hour (default: 0.05; 0: "
        "no audits)",
    )
    g.add_argument(
        "--leave-idle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="in a pipelined run, a peer of a later stage (1 and up) leaves once no "
        "micro-batch came through it for this long and no stage-0 peer holds a session with "
        "it (a driver that pauses keeps its session): its drivers are gone, the run's readers "
        "reached --max-epochs, say. Counted once a first micro-batch came. Before it leaves "
        "it averages what it trained since its stage's last round at once, with whichever "
        "replicas of its stage come (alone if none does; it leaves without after 120 s, its "
        "checkpoint keeping them). A later stage does not end at the run's total steps or "
        "tokens, which are stage 0's (default: 300; 0: serve until stopped)",
    )
    g.add_argument(
        "--slowdown",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="in a pipelined run, each forward of this peer's stage waits this long more: a "
        "slower device, for tests and benchmarks (default: none)",
    )
    g.add_argument(
        "--dataset",
        default=None,
        metavar="DIR_OR_ID",
        help="create: the run trains on this prepared dataset (a directory `swarmloco data "
        "prepare` wrote, or its id with --dataset-mirror), pinned by its id; join: a local "
        "copy of the run's dataset, read in place before its mirrors",
    )
    g.add_argument(
        "--max-epochs",
        type=int,
        default=None,
        metavar="E",
        help="on a pinned dataset: leave once E epochs of it landed whole, every sequence "
        "once (default: train until stopped)",
    )
    g.add_argument(
        "--lease-seconds",
        type=float,
        default=60.0,
        metavar="S",
        help="on a pinned dataset: how long this peer's lease of a shard lives unless renewed "
        "(renewed every quarter of it while it trains); a shard of a peer that died is "
        "another's after this long (default: %(default)s)",
    )
    g.add_argument(
        "--lease-idle-seconds",
        type=float,
        default=1800.0,
        metavar="S",
        help="on a pinned dataset: a shard other peers list is theirs while something of it "
        "lands, or one of them averages with this peer, within S seconds; a listing that "
        "shows no work that long is passed over and the shard read here, so keys that "
        "list shards and never read them cannot hold the run (default: %(default)s)",
    )
    g.add_argument(
        "--read-log",
        type=Path,
        default=None,
        metavar="FILE",
        help="on a pinned dataset: append the sequences each batch reads to FILE, one JSON "
        "line a batch (against what landed in the final state, what was trained and never "
        "landed; default: none)",
    )
    _add_network_options(g)
    _add_compute_options(g)
    _add_round_options(g)


def _add_network_options(g: argparse._ArgumentGroup) -> None:
    """Where the peer serves and how others reach it."""
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    g.add_argument(
        "--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)"
    )
    g.add_argument(
        "--announce-host",
        default=None,
        help="host other peers should dial, an address or a name (default: the bound host, or "
        "as the peers see us). A name counts as its domain wherever peers are counted per "
        "network: peers under one dynamic-DNS domain count as one network; an address is "
        "counted by its /24",
    )
    g.add_argument(
        "--announce-port",
        type=int,
        default=None,
        help="port other peers should dial, when a router or proxy forwards another port to "
        "--port (default: the bound port)",
    )
    g.add_argument(
        "--reflection",
        action="store_true",
        help="serve gRPC server reflection, so `grpcurl` can list the services (default: off)",
    )
    _add_tls_options(g)
    g.add_argument(
        "--client-mode",
        action="store_true",
        help="for a peer that others cannot dial (behind NAT or a firewall): it only calls "
        "out, sends its update and receives the average, but reduces no part and serves no "
        "state; needs --peer (not in a pipelined run: a stage peer must be dialled)",
    )
    g.add_argument(
        "--membership",
        metavar="CERT",
        default="",
        help="a private swarm's membership certificate for this peer: the line `swarmloco "
        "admit` printed for it, or a file holding that line (kept in the data directory, so "
        "a restart needs it no more)",
    )


def _add_compute_options(g: argparse._ArgumentGroup) -> None:
    """What the peer trains on and how much of the machine it takes."""
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="train as a box of N ranks on this machine, one peer in the swarm (data "
        "parallel: each rank trains the preset's batch on its own data, one GPU each with "
        "--device cuda, CPU ranks over gloo otherwise; on a pinned dataset, rank 0 leases "
        "for the box and hands each rank its sequences); this command starts the ranks, "
        "which die with it",
    )
    g.add_argument(
        "--peer-name",
        default="",
        help="how dashboards name this peer (default: the host name and the start of its id)",
    )
    g.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's)"
    )
    g.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default=None,
        help="torch.compile the model (default: the swarm's choice: on CUDA only, where a "
        "C compiler is found; see docs/operating.md, Compilers)",
    )
    g.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default=None,
        help="inner-loop arithmetic: auto (bf16 autocast on CUDA, fp16 with loss scaling on "
        "GPUs without bf16, fp32 on CPU; the default), or one of them; the global state is "
        "fp32 either way (a pipeline stage: bf16 autocast or fp32, never fp16)",
    )
    g.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        metavar="GB",
        help="device memory the training may use: the largest micro-batch that fits is "
        "accumulated to the run's sequences per step (the same arithmetic on any card), "
        "with activation checkpointing when not even one sequence fits otherwise. On CUDA "
        "the default is the card's memory, measured at start; elsewhere no fitting unless "
        "given (then estimated from the model's shape). The choice is logged and in the "
        "ready event",
    )
    g.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="MBIT",
        help="cap this peer's upload and download at MBIT megabits/s (averaging and state "
        "transfer together; default: no cap); the peer then reduces a part of each round "
        "sized to that rate",
    )
    g.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve the swarm's dashboard on 127.0.0.1:PORT (0: a free port)",
    )
    g.add_argument(
        "--codec",
        choices=("auto", "compiled", "eager"),
        default=None,
        help="how this peer runs the int8 codec: compiled (fast, compiles for a few seconds "
        "at start), eager, or auto (compiled where possible; the default)",
    )


def _add_round_options(g: argparse._ArgumentGroup) -> None:
    """Rounds, matchmaking, checkpoints, evaluation and events."""
    g.add_argument(
        "--max-rounds",
        type=int,
        default=None,
        metavar="R",
        help="leave once the swarm's state reached round R, first serving it (a minute at "
        "most) to peers still working towards it; in a pipelined run, round R of the stage "
        "it serves (each stage averages in rounds of its own, a later stage ahead of stage "
        "0's where fewer peers serve it: stage 0's rounds are the run's) (default: train "
        "until stopped)",
    )
    g.add_argument(
        "--round-timeout",
        type=float,
        default=_peer_default("round_timeout_s"),
        metavar="SECONDS",
        help="matchmaking plus all-reduce of one round (default: %(default)s)",
    )
    g.add_argument(
        "--gather",
        type=float,
        default=_matchmaking_default("gather_s"),
        metavar="SECONDS",
        help="how long a round's leader waits for the others to join (default: %(default)s)",
    )
    g.add_argument(
        "--min-group",
        type=int,
        default=_matchmaking_default("min_group_size"),
        metavar="N",
        help="abort a round with fewer peers than this and retry later (default: 1, i.e. a "
        "peer alone averages with itself)",
    )
    g.add_argument(
        "--limit-local-downloads",
        action="store_true",
        help="count callers on this machine (loopback) per address in the limits of state "
        "downloads, as any other network, instead of exempting them (benchmarks and tests "
        "of many peers on one machine)",
    )
    g.add_argument(
        "--progress-interval",
        type=float,
        default=_peer_default("progress_interval_s"),
        metavar="SECONDS",
        help="how often the peer publishes its progress (default: %(default)s)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=_peer_default("checkpoint_every"),
        metavar="ROUNDS",
        help="rounds between checkpoints, their files written between two steps and finished "
        "in the background (one is skipped while the last is still being finished); 0: only "
        "when stopping (default: %(default)s)",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=_peer_default("eval_every"),
        metavar="ROUNDS",
        help="evaluate the global model every this many rounds; 0: never (default: %(default)s)",
    )
    g.add_argument(
        "--events",
        metavar="FILE",
        default=None,
        help="write one JSON object per event (ready, round, checkpoint, ...) to FILE; - for "
        "stdout",
    )


def _run_peer(manifest: Any, args: argparse.Namespace) -> int:
    """Train as a peer of ``manifest`` until stopped (SIGINT/SIGTERM), the run's end or
    --max-rounds. In a box's rank other than 0, ``manifest`` is None (rank 0 sends it)."""

    import torch

    from swarmloco.net.identity import Identity
    from swarmloco.runtime.daemon import DaemonConfig, train_task

    if args.threads:
        torch.set_num_threads(args.threads)
    peer = _peer_config(args)
    box = None
    if "RANK" in os.environ and args.nproc_per_node > 1:
        box = _init_box(args.device)
    config = DaemonConfig(
        peer=peer,
        device=args.device,
        compile=args.compile,
        precision=args.precision,
        memory_budget_gb=args.memory_budget,
        dataset_copies=_dataset_copies(args),
        max_epochs=args.max_epochs,
        lease_s=args.lease_seconds,
        lease_idle_s=args.lease_idle_seconds,
        read_log=args.read_log,
    )
    sink = None
    events_file = None
    if args.events:
        events_file = sys.stdout if args.events == "-" else open(args.events, "a", encoding="utf-8")  # noqa: SIM115

        def sink(event: dict[str, Any]) -> None:
            assert events_file is not None
            events_file.write(json.dumps(event) + "\n")
            events_file.flush()

    try:
        identity = Identity.load_or_create(args.data_dir) if _box_rank() == 0 else None
        if manifest is not None and manifest.model.get("pipeline") is not None:
            return _run_stage(manifest, args, peer, identity, sink, box, config)
        summary = train_task(manifest, config, identity=identity, on_event=sink, box=box)
    finally:
        if events_file is not None and events_file is not sys.stdout:
            events_file.close()
        if box is not None:
            box = None
            _leave_process_group()
    if summary is not None:  # a rank other than 0 has none: rank 0 reports
        _log_summary(summary)
    return 0


def _dataset_copies(args: argparse.Namespace) -> tuple[Path, ...]:
    """The local copy ``--dataset`` names (none: it names an id, which create pinned)."""
    if args.dataset is None:
        return ()
    path = Path(args.dataset)
    if path.is_dir():
        return (path,)
    if args.command == "join":
        raise ValueError(
            f"--dataset {args.dataset}: no such directory (join takes the run's dataset from "
            "its manifest; --dataset names a local copy of it)"
        )
    return ()


CLIENT_MODE_STAGE = (
    "--client-mode serves nothing, and a stage peer must be dialled: later stages receive "
    "the micro-batches, every stage serves its state to newcomers, and the others count "
    "only the replicas whose servers answer for them"
)


def check_stage_flags(args: argparse.Namespace) -> None:
    """``--rebalance-gap`` is a share and ``--leave-idle`` seconds, refused by name
    otherwise (join and create)."""
    from swarmloco.errors import SwarmlocoError

    if not 0.0 <= args.rebalance_gap < 1.0:
        raise SwarmlocoError(
            "--rebalance-gap is a share of the fastest stage's throughput, from 0 to below 1: "
            f"got {args.rebalance_gap}"
        )
    if args.leave_idle is not None and not args.leave_idle >= 0:
        raise SwarmlocoError(f"--leave-idle is seconds, 0 or more: got {args.leave_idle}")


def _run_stage(
    manifest: Any,
    args: argparse.Namespace,
    peer: Any,
    identity: Any,
    sink: Any,
    box: Any,
    reading: Any,
) -> int:
    """Serve one stage of a pipelined run (``pipeline/daemon.py``; ``reading``: how stage
    0 reads a pinned dataset)."""
    from swarmloco.errors import SwarmlocoError
    from swarmloco.pipeline.daemon import train_stage

    if box is not None:
        raise SwarmlocoError(
            "a pipelined run's stage is served by one process (no --nproc-per-node)"
        )
    from swarmloco.pipeline.daemon import LEAVE_IDLE_S
    from swarmloco.pipeline.rebalance import RebalanceConfig

    check_stage_flags(args)
    summary = train_stage(
        manifest,
        peer,
        identity=identity,
        stage=args.stage,
        device=args.device,
        on_event=sink,
        rebalance=RebalanceConfig(
            every_s=args.rebalance_every, gap=args.rebalance_gap, hold_s=args.rebalance_hold
        ),
        slowdown_s=args.slowdown,
        precision=args.precision,
        in_flight=args.in_flight,
        audit_share=args.audit_share,
        reading=reading,
        leave_idle_s=LEAVE_IDLE_S if args.leave_idle is None else args.leave_idle,
    )
    logging.getLogger("swarmloco.peer").info(
        "left stage %d at round %d after %d steps (%d micro-batches driven, %d moves; "
        "inputs dropped: %d at their deadline, %d of drivers gone): %s",
        summary.stage,
        summary.round,
        summary.steps,
        summary.micro_batches,
        summary.moves,
        summary.dropped,
        summary.orphaned,
        summary.stopped_because,
    )
    return 0


def _peer_config(args: argparse.Namespace) -> Any:
    """The peer's :class:`~swarmloco.runtime.config.PeerConfig` from its options."""
    from swarmloco.net.averaging import BandwidthConfig, MatchmakingConfig
    from swarmloco.net.client import ClientConfig
    from swarmloco.net.node import NodeConfig
    from swarmloco.net.server import ServerConfig
    from swarmloco.net.state import DonorConfig
    from swarmloco.runtime.config import PeerConfig

    return PeerConfig(
        data_dir=args.data_dir,
        node=NodeConfig(
            server=None
            if args.client_mode
            else ServerConfig(
                host=args.host, port=args.port, reflection=args.reflection, **_tls_config(args)
            ),
            client=ClientConfig(tls_ca_file=args.tls_ca),
            announce_host=args.announce_host,
            announce_port=args.announce_port,
            peers=tuple(args.peers),
        ),
        name=args.peer_name,
        dashboard_port=args.dashboard_port,
        bandwidth=BandwidthConfig.mbit(args.bandwidth) if args.bandwidth else None,
        codec_backend=args.codec,
        max_rounds=args.max_rounds,
        round_timeout_s=args.round_timeout,
        matchmaking=MatchmakingConfig(gather_s=args.gather, min_group_size=args.min_group),
        progress_interval_s=args.progress_interval,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        membership=_membership_text(args.membership),
        donor=DonorConfig(limit_loopback=args.limit_local_downloads),
    )


def _log_summary(summary: Any) -> None:
    logging.getLogger("swarmloco.peer").info(
        "left swarm %s at round %d after %d steps (global step %d; %d rounds applied, %d "
        "aborted, %d downloads)%s",
        summary.swarm_id[:12],
        summary.round,
        summary.steps,
        summary.global_step,
        summary.rounds_applied,
        summary.rounds_aborted,
        summary.downloads,
        f": {summary.stopped_because}" if summary.stopped_because else "",
    )
