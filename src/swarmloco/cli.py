"""The `swarmloco` command line: subcommands -> config dataclasses -> runtime. No logic here.

Modules that import torch are imported inside the command that needs them, so that
`swarmloco bootstrap` and `swarmloco dashboard` start fast and small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from swarmloco import __version__
from swarmloco.errors import SwarmlocoError

T = TypeVar("T")
Handler = Callable[[argparse.Namespace], int]
Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

# Each entry adds one subcommand to the parser and sets its handler with set_defaults.
_COMMANDS: list[Register] = []


def command(register: Register) -> Register:
    """Decorator: add a subcommand (in definition order, which is the order of --help)."""
    _COMMANDS.append(register)
    return register


def _setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on the application's one event loop (uvloop when it is installed)."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def run_until_signal(serve: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run ``serve(stop)`` on the application's event loop; SIGINT or SIGTERM sets ``stop``."""

    async def main() -> None:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await serve(stop)

    run_async(main())


DATA_ROOT = Path.home() / ".swarmloco"

_PEER_HELP = (
    "HOST:PORT of a peer or `swarmloco bootstrap` node of the network to join through; "
    "repeat for more (the first that answers is used)"
)


def _add_peer_option(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--peer",
        dest="peers",
        action="append",
        default=[],
        metavar="HOST:PORT",
        required=required,
        help=_PEER_HELP,
    )


def _add_data_dir_option(parser: argparse.ArgumentParser, role: str, what: str) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DATA_ROOT / role,
        help=f"{what} (default: %(default)s; two processes on one machine need two)",
    )


# -- peer layer ---------------------------------------------------------------------------


@command
def _bootstrap_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bootstrap",
        help="run a DHT-only node that peers of public runs join through (no training)",
        description=(
            "Run a DHT-only node: peers of any swarm can join the network through it, find "
            "each other and publish their records. It trains nothing and never imports torch. "
            "Once it serves it prints one line with the HOST:PORT to give to peers "
            "(`swarmloco create/join --peer HOST:PORT`), then logs peers joining and leaving. "
            "Its identity (an Ed25519 key) is kept in --data-dir, so its peer id survives "
            "restarts. Stop it with Ctrl-C or SIGTERM."
        ),
        epilog=(
            "example: swarmloco bootstrap --host 0.0.0.0 --port 31337 --announce-host 203.0.113.7"
        ),
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    parser.add_argument(
        "--port",
        type=int,
        default=31337,
        help="port to bind; 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--announce-host",
        default=None,
        help="host other peers should dial (default: the bound host; when bound to every "
        "interface, this machine's address on its default route)",
    )
    _add_data_dir_option(parser, "bootstrap", "where the node keeps its key")
    parser.add_argument(
        "--peer",
        dest="peers",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="another bootstrap node to connect to (optional; repeatable)",
    )
    parser.add_argument(
        "--reflection",
        action="store_true",
        help="serve gRPC server reflection, so `grpcurl` can list the services (off: a "
        "public node need not describe itself to anyone)",
    )
    _add_tls_options(parser)
    parser.add_argument(
        "--liveness-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="ping peers not heard from for this long; those that fail are logged as gone "
        "(default: %(default)s)",
    )
    parser.set_defaults(handler=_bootstrap)


def _bootstrap(args: argparse.Namespace) -> int:
    from swarmloco.net.bootstrap import BootstrapConfig, serve_bootstrap
    from swarmloco.net.identity import Identity

    config = BootstrapConfig(
        data_dir=args.data_dir,
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        peers=tuple(args.peers),
        liveness_interval_s=args.liveness_interval,
        reflection=args.reflection,
        tls_ca_file=args.tls_ca,
        **_tls_config(args),
    )

    def ready(endpoint: str, identity: Identity) -> None:
        print(
            f"swarmloco bootstrap: serving on {endpoint} as peer {identity.peer_id_hex}",
            flush=True,
        )

    run_until_signal(lambda stop: serve_bootstrap(config, stop=stop, ready=ready))
    return 0


def _peer_default(field: str) -> Any:
    """A PeerConfig default (imported lazily: the config module imports the averaging layer)."""
    from swarmloco.runtime.config import PeerConfig, default

    return default(PeerConfig, field)


# The matchmaking layer imports torch; --help must not. tests/unit/test_cli_defaults.py
# checks these against MatchmakingConfig.
_MATCHMAKING_DEFAULTS = {"gather_s": 5.0, "min_group_size": 1}


def _matchmaking_default(field: str) -> Any:
    return _MATCHMAKING_DEFAULTS[field]


def _add_tls_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve TLS with this certificate (PEM, chain after the leaf) instead of the "
        "peer's own self-signed one; needs --tls-key",
    )
    parser.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert (PEM)")
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="accept only servers whose certificate this CA (PEM) issued, on top of the "
        "check against their signed card (for a swarm whose operators run a CA)",
    )


def _tls_config(args: argparse.Namespace) -> dict[str, Any]:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    return {"tls_cert_file": args.tls_cert, "tls_key_file": args.tls_key}


def _add_peer_run_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("the training peer")
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    g.add_argument(
        "--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)"
    )
    g.add_argument(
        "--announce-host",
        default=None,
        help="host other peers should dial (default: the bound host, or as the peers see us)",
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
        "state; needs --peer",
    )
    g.add_argument(
        "--membership",
        metavar="CERT",
        default="",
        help="a private swarm's membership certificate for this peer: the line `swarmloco "
        "admit` printed for it, or a file holding that line (kept in the data directory, so "
        "a restart needs it no more)",
    )
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="train as a box of N ranks on this machine, one peer in the swarm (data "
        "parallel: each rank trains the preset's batch on its own data, one GPU each with "
        "--device cuda, CPU ranks over gloo otherwise); this command starts the ranks",
    )
    g.add_argument(
        "--peer-name",
        default="",
        help="how dashboards name this peer (default: the host name)",
    )
    g.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's)"
    )
    g.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default=None,
        help="torch.compile the model (default: the swarm's choice: on CUDA only)",
    )
    g.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default=None,
        help="inner-loop arithmetic: auto (bf16 autocast on CUDA, fp16 with loss scaling on "
        "GPUs without bf16, fp32 on CPU; the default), or one of them; the global state is "
        "fp32 either way",
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
    g.add_argument(
        "--max-rounds",
        type=int,
        default=None,
        metavar="R",
        help="leave once the swarm's state reached round R (default: train until stopped)",
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
        help="rounds between checkpoints, written in the background (one is skipped while "
        "the last is still being written); 0: only when stopping (default: %(default)s)",
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


def _membership_text(given: str) -> str:
    """``--membership``: the certificate's line itself, or a file holding it."""
    from swarmloco.net.admission import TEXT_PREFIX

    given = given.strip()
    if not given or given.startswith(TEXT_PREFIX):
        return given
    path = Path(given).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--membership {given!r} is neither a certificate (it starts with {TEXT_PREFIX!r}) "
            "nor a file"
        )
    return path.read_text(encoding="utf-8").strip()


def _box_launch(args: argparse.Namespace) -> int | None:
    """With --nproc-per-node N > 1: run this same command as N ranks (the environment of a
    torch.distributed launch: RANK, WORLD_SIZE, MASTER_ADDR/PORT on this machine) and
    return the box's exit code; None inside a rank (or for one process).

    SIGINT/SIGTERM go to rank 0, which stops every rank at a step's end, checkpoints the
    box and leaves. A rank that fails stops the others (SIGTERM, then SIGKILL after
    30 s): the box's peer leaves the swarm, and the box resumes from its checkpoint."""
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    if args.nproc_per_node == 1 or "RANK" in os.environ:
        return None
    if getattr(args, "no_train", False):
        raise ValueError("--no-train trains nothing: leave out --nproc-per-node")
    import signal
    import socket

    n = args.nproc_per_node
    with socket.socket() as s:  # a free port for the box's rendezvous, on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    command = [sys.executable, "-m", "swarmloco.cli", *args.argv]
    ranks = [
        subprocess.Popen(command, env=env | {"RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(n)
    ]
    logging.getLogger("swarmloco.box").info("started %d ranks (rank 0 is the peer)", n)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: ranks[0].send_signal(signum))
    by_pid = {p.pid: p for p in ranks}
    code = 0
    while by_pid:
        pid, status = os.waitpid(-1, 0)
        rank = by_pid.pop(pid, None)
        if rank is None:
            continue
        rank.returncode = os.waitstatus_to_exitcode(status)
        if rank.returncode != 0 and code == 0:
            code = rank.returncode if rank.returncode > 0 else 128 - rank.returncode
            logging.getLogger("swarmloco.box").error(
                "rank %d exited with %d: stopping the box", ranks.index(rank), rank.returncode
            )
            for other in by_pid.values():
                other.terminate()
            _reap(by_pid, grace_s=30.0)
            break
    return code


def _reap(ranks: dict[int, subprocess.Popen[bytes]], *, grace_s: float) -> None:
    """Wait for ``ranks`` to exit; SIGKILL those still running after ``grace_s``."""
    for p in ranks.values():
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _box_rank() -> int:
    """This process's rank in a box (0 outside one)."""
    return int(os.environ.get("RANK", "0"))


def _run_peer(manifest: Any, args: argparse.Namespace) -> int:
    """Train as a peer of ``manifest`` until stopped (SIGINT/SIGTERM), the run's end or
    --max-rounds. In a box's rank other than 0, ``manifest`` is None (rank 0 sends it)."""
    import json

    import torch

    from swarmloco.net.averaging import BandwidthConfig, MatchmakingConfig
    from swarmloco.net.client import ClientConfig
    from swarmloco.net.identity import Identity
    from swarmloco.net.node import NodeConfig
    from swarmloco.net.server import ServerConfig
    from swarmloco.net.state import DonorConfig
    from swarmloco.runtime.config import PeerConfig
    from swarmloco.runtime.daemon import DaemonConfig, train_task

    if args.threads:
        torch.set_num_threads(args.threads)
    peer = PeerConfig(
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
    box = None
    if "RANK" in os.environ and args.nproc_per_node > 1:
        box = _init_box(args.device)
    config = DaemonConfig(
        peer=peer,
        device=args.device,
        compile=args.compile,
        precision=args.precision,
        memory_budget_gb=args.memory_budget,
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
        summary = train_task(manifest, config, identity=identity, on_event=sink, box=box)
    finally:
        if events_file is not None and events_file is not sys.stdout:
            events_file.close()
        if box is not None:
            box = None
            _leave_process_group()
    if summary is None:  # a rank other than 0: rank 0 reports
        return 0
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
    return 0


@command
def _create_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "create",
        help="create a swarm, print its id, and train as its first peer",
        description=(
            "Create a new swarm (a training run). The manifest (task, model, data, "
            "hyperparameters, your public key) is built from the options below; its hash is "
            "the swarm id, printed alone on the first line of stdout. Then this process "
            "trains as the swarm's first peer: it serves on --host/--port, publishes the "
            "manifest, and averages with every peer that joins "
            "(`swarmloco join SWARM_ID --peer HOST:PORT`). Without --peer it starts a new "
            "network (others join through this peer's address, logged at start). With "
            "--no-train the manifest is only published through --peer. The same command "
            "again with the same --data-dir (after Ctrl-C or a crash) resumes that swarm "
            "from its checkpoints, as its creator; other settings make a new swarm."
        ),
        epilog=(
            "examples:\n"
            "  swarmloco create --task gpt-bytes --preset tiny --host 127.0.0.1\n"
            "  swarmloco create --preset tiny --sync-every 100 --peer 127.0.0.1:31337\n"
            "  swarmloco create --preset tiny --peer 127.0.0.1:31337 --no-train"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _describe_tasks_in_help(parser)
    parser.add_argument(
        "--task",
        default="gpt-bytes",
        help="task to train (default: %(default)s; the list is at the end)",
    )
    parser.add_argument(
        "--preset",
        default="tiny",
        help="model size preset of the task (default: %(default)s; each preset's size and "
        "hyperparameters are at the end)",
    )
    parser.add_argument("--name", default="", help="a human label for dashboards (optional)")
    h = parser.add_argument_group("hyperparameters (default: the preset's; all enter the manifest)")
    h.add_argument(
        "--sync-every", type=int, default=None, metavar="H", help="inner steps per round"
    )
    h.add_argument(
        "--fragments",
        type=int,
        default=None,
        metavar="F",
        help="Streaming DiLoCo: split the model into F fragments, each synced every H steps at "
        "staggered times (1: plain DiLoCo)",
    )
    h.add_argument(
        "--delay",
        type=int,
        default=None,
        metavar="TAU",
        help="Streaming DiLoCo: inner steps a fragment's exchange overlaps before it is applied",
    )
    h.add_argument(
        "--alpha",
        type=float,
        default=None,
        help="Streaming DiLoCo: on landing, local = lerp(global, local, alpha) (0: global)",
    )
    h.add_argument("--batch-size", type=int, default=None, help="sequences per inner step")
    h.add_argument("--lr", type=float, default=None, help="peak inner learning rate")
    h.add_argument(
        "--warmup",
        type=int,
        default=None,
        metavar="STEPS",
        help="inner learning-rate warmup in the swarm's inner steps (tiny: 150, three "
        "rounds of H = 50). A warmup over several rounds learns better from scratch: the "
        "first pseudo-gradients do not carry the whole initial drop of the loss, which "
        "outer momentum would keep re-applying",
    )
    h.add_argument("--outer-lr", type=float, default=None, help="outer learning rate")
    h.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help="outer Nesterov momentum (0.9, the papers'; in small runs with small batches "
        "0.5 learned better: compare them with `swarmloco simulate --sweep`)",
    )
    h.add_argument(
        "--total-steps",
        type=int,
        default=None,
        help="the run's length in the swarm's inner steps (rounds x H / F); the cosine "
        "schedule ends there too",
    )
    h.add_argument(
        "--aggregator",
        choices=("mean", "trimmed_mean", "centered_clip"),
        default=None,
        help="how each part's reducer combines the members' updates (default: trimmed_mean "
        "in a public run, where anyone may send a lie; mean in a private one)",
    )
    h.add_argument("--seed", type=int, default=None, help="seed of the initial model and data")
    parser.add_argument(
        "--private",
        action="store_true",
        help="a private run: only peers you admit take part (give each a certificate with "
        "`swarmloco admit PEER_ID --swarm SWARM_ID`); default: anyone may join",
    )
    parser.add_argument(
        "--identity-work",
        type=int,
        default=None,
        metavar="BITS",
        help="bits of work every peer's key proves for this run before it takes part: about "
        "2^BITS x 5 ms of one core, once per key and run, so that a stranger pays for each "
        "key it shows (default: 8, about a second, for a public run; 0 for a private one)",
    )
    _add_data_options(parser)
    _add_peer_option(parser, required=False)
    _add_data_dir_option(
        parser,
        "peer",
        "where this peer keeps its key (its public half is the swarm's creator) and checkpoints",
    )
    parser.add_argument(
        "--no-train",
        action="store_true",
        help="only publish the manifest, then exit (`swarmloco join` with this --data-dir "
        "later trains as the creator, the peer dashboards trust by default)",
    )
    _add_peer_run_options(parser)
    parser.set_defaults(handler=_create)


def _describe_tasks_in_help(parser: argparse.ArgumentParser) -> None:
    """Append the tasks and presets to ``parser``'s help, computed only when it is printed
    (listing them imports torch, which other commands' start should not wait for)."""
    plain = parser.format_help

    def with_tasks() -> str:
        from swarmloco.train.tasks import describe_tasks

        return plain().rstrip("\n") + "\n\n" + describe_tasks() + "\n"

    parser.format_help = with_tasks  # type: ignore[method-assign]


def _leave_process_group() -> None:
    """Destroy the box's process group once nothing holds it (the model's DDP wrapper, the
    box): its communication threads are joined now, while the interpreter runs. Left to
    exit, one of them may free its last work object during finalization and abort the
    process (std::terminate), failing a box that stopped cleanly."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def _init_box(device: str) -> Any:
    """Join this torchrun rank's process group (NCCL on GPUs, gloo on CPUs); the box."""
    import torch
    import torch.distributed as dist

    from swarmloco.runtime.box import Box

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return Box()


def _create(args: argparse.Namespace) -> int:
    import dataclasses

    from swarmloco.net.identity import Identity
    from swarmloco.runtime.api import created_before
    from swarmloco.train.tasks import build_manifest, get_task  # imports torch

    launched = _box_launch(args)
    if launched is not None:
        return launched
    if _box_rank() > 0:
        return _run_peer(None, args)  # rank 0 makes the manifest and sends it

    if args.no_train and not args.peers:
        raise ValueError("--no-train publishes the manifest through a peer: pass --peer HOST:PORT")
    if args.client_mode and not args.peers:
        raise ValueError(
            "--client-mode serves nothing, so others could never reach this swarm: pass "
            "--peer HOST:PORT of a serving peer or bootstrap node"
        )
    identity = Identity.load_or_create(args.data_dir)
    run = get_task(args.task).default_run(args.preset)
    inner_changes = {
        k: v
        for k, v in (
            ("batch_size", args.batch_size),
            ("lr", args.lr),
            ("warmup_steps", args.warmup),
            ("total_steps", args.total_steps),
        )
        if v is not None
    }
    run = dataclasses.replace(run, inner=dataclasses.replace(run.inner, **inner_changes))
    if run.inner.warmup_steps > run.inner.total_steps:
        raise ValueError(
            f"--warmup {run.inner.warmup_steps} is longer than the run "
            f"({run.inner.total_steps} steps): the peak learning rate would never be reached"
        )
    spec_changes: dict[str, Any] = {
        k: v
        for k, v in (
            ("sync_every", args.sync_every),
            ("fragments", args.fragments),
            ("delay", args.delay),
            ("alpha", args.alpha),
            ("outer_lr", args.outer_lr),
            ("outer_momentum", args.outer_momentum),
            ("seed", args.seed),
            ("total_steps", args.total_steps),
            ("aggregator", args.aggregator),
        )
        if v is not None
    }
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, **spec_changes))
    overrides = _model_overrides(args) or None
    manifest = build_manifest(
        args.task,
        args.preset,
        creator=identity.public_key.hex(),
        name=args.name,
        data=_data_spec(args),
        run=run,
        model_overrides=overrides,
        admission="certificate" if args.private else "",
        identity_work=args.identity_work,
    )
    # The same create command in the same data directory resumes its swarm as the creator.
    manifest = created_before(manifest, Path(args.data_dir))
    print(manifest.swarm_id, flush=True)
    if not args.no_train:
        return _run_peer(manifest, args)

    async def publish() -> int:
        from swarmloco.net.node import NetNode, NodeConfig
        from swarmloco.net.swarm import publish_manifest

        config = NodeConfig(server=None, peers=tuple(args.peers))
        async with NetNode(identity=identity, config=config) as node:
            return await publish_manifest(node.dht, manifest)

    stored = run_async(publish())
    logging.getLogger("swarmloco.create").info(
        "published the manifest of swarm %s on %d DHT nodes", manifest.swarm_id, stored
    )
    return 0


@command
def _join_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "join",
        help="join a swarm by its id: download its state and train",
        description=(
            "Join the swarm SWARM_ID through --peer. The manifest is fetched from the DHT and "
            "its hash checked against the id: a manifest that hashes to anything else is "
            "refused. Then the peer downloads the swarm's latest state from peers holding "
            "its majority digest and trains, averaging with the others every H steps, until "
            "the run ends (its manifest's total steps: --dry-run says after which round), "
            "--max-rounds, or Ctrl-C or SIGTERM (it finishes the current round, checkpoints "
            "and leaves). Run it again with the same --data-dir to resume from the newest "
            "checkpoint. With --dry-run it prints what the run trains and how (--json: the "
            "verified manifest itself) and exits."
        ),
        epilog=(
            "examples:\n"
            "  swarmloco join 3f2a...9c1d --peer 127.0.0.1:31337 --data-dir ./peer2\n"
            "  swarmloco join 3f2a...9c1d --peer 127.0.0.1:31337 --dry-run\n"
            "  swarmloco join 3f2a...9c1d --peer 127.0.0.1:31337 --dry-run --json | jq .hparams"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("swarm_id", metavar="SWARM_ID", help="the id printed by `swarmloco create`")
    _add_peer_option(parser, required=True)
    _add_data_dir_option(parser, "peer", "where this peer keeps its key and checkpoints")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="fetch and verify the manifest, print what the run trains and how, then exit",
    )
    parser.add_argument(
        "--json", action="store_true", help="with --dry-run: print the manifest as JSON"
    )
    _add_peer_run_options(parser)
    parser.set_defaults(handler=_join)


def _fetch_manifest(swarm_id: str, peers: Sequence[str]) -> Any:
    """The verified manifest of ``swarm_id``, fetched through ``peers`` (ManifestError if
    none has it). Fetching leaves nothing behind: a throwaway identity, no key file."""
    from swarmloco.core.manifest import SwarmManifest
    from swarmloco.net.identity import Identity
    from swarmloco.net.node import NetNode, NodeConfig
    from swarmloco.net.swarm import fetch_manifest

    async def fetch() -> SwarmManifest:
        config = NodeConfig(server=None, peers=tuple(peers))
        async with NetNode(identity=Identity.generate(), config=config) as node:
            return await fetch_manifest(node.dht, swarm_id)

    return run_async(fetch())


def _dry_run(manifest: Any, *, as_json: bool) -> str:
    """What `join --dry-run` prints: a summary, or the manifest as JSON."""
    if as_json:
        return json.dumps(manifest.to_dict(), indent=2, sort_keys=True, ensure_ascii=False)
    from swarmloco.runtime.swarm import manifest_signature
    from swarmloco.train.tasks import describe_manifest

    try:
        parameters: int | None = manifest_signature(manifest).numel
    except Exception:  # a task this machine lacks: the summary goes without the size
        parameters = None
    return describe_manifest(manifest, parameters)


def _join(args: argparse.Namespace) -> int:
    from swarmloco.core.manifest import SwarmManifest, check_swarm_id
    from swarmloco.errors import ManifestError

    swarm_id = check_swarm_id(args.swarm_id)
    if not args.dry_run:
        launched = _box_launch(args)
        if launched is not None:
            return launched
        if _box_rank() > 0:
            return _run_peer(None, args)  # rank 0 finds the manifest and sends it
    local = args.data_dir / "swarms" / swarm_id / "manifest.json"
    if local.is_file() and not args.dry_run:
        # A restart: the copy this peer verified when it first joined (checked against the
        # id again here) needs no network, so a dead --peer address does not matter; the
        # peers it remembers are joined through when the peer starts.
        manifest = SwarmManifest.from_bytes(local.read_bytes(), expected_id=swarm_id)
    else:
        try:
            manifest = _fetch_manifest(swarm_id, args.peers)
        except ManifestError:
            # A swarm whose peers all restarted: our own verified copy serves (and is
            # republished when the peer starts).
            if args.dry_run or not local.is_file():
                raise
            manifest = SwarmManifest.from_bytes(local.read_bytes(), expected_id=swarm_id)
            logging.getLogger("swarmloco.join").warning(
                "the network does not hold swarm %s's manifest; using the copy in %s",
                swarm_id[:12],
                local,
            )
    if args.dry_run:
        print(_dry_run(manifest, as_json=args.json), flush=True)
        return 0
    return _run_peer(manifest, args)


@command
def _admit_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "admit",
        help="admit a peer to your private swarm: print its membership certificate",
        description=(
            "Sign a membership certificate for PEER_ID in the private swarm SWARM_ID (made "
            "with `swarmloco create --private`). Run it with the creator's --data-dir: only "
            "the key that created the swarm can admit. The certificate is printed alone on "
            "stdout; the peer passes it to `swarmloco join ... --membership CERT`. A peer "
            "that joins without one is told its PEER_ID and this command. Certificates are "
            "not secret: each names the one key it admits."
        ),
        epilog=(
            "examples:\n"
            "  swarmloco admit 5be1...07aa --swarm 3f2a...9c1d\n"
            "  swarmloco admit 5be1...07aa --swarm 3f2a...9c1d --days 30 > peer2.member"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("peer_id", metavar="PEER_ID", help="the peer's id (40 hex digits)")
    parser.add_argument("--swarm", required=True, metavar="SWARM_ID", help="the private swarm's id")
    parser.add_argument(
        "--days",
        type=float,
        default=0.0,
        help="the certificate expires after this many days (default: 0, never)",
    )
    _add_peer_option(parser, required=False)
    _add_data_dir_option(parser, "peer", "the creator's data directory (its key signs)")
    parser.set_defaults(handler=_admit)


def _admit(args: argparse.Namespace) -> int:
    import time

    from swarmloco.core.manifest import SwarmManifest, check_swarm_id
    from swarmloco.net.admission import Membership
    from swarmloco.net.identity import KEY_FILE_NAME, Identity

    swarm_id = check_swarm_id(args.swarm)
    if args.days < 0:
        raise ValueError(f"--days must be >= 0, got {args.days}")
    if not (args.data_dir / KEY_FILE_NAME).is_file():
        raise SwarmlocoError(
            f"{args.data_dir} holds no key: give the --data-dir the swarm was created with"
        )
    identity = Identity.load_or_create(args.data_dir)
    local = args.data_dir / "swarms" / swarm_id / "manifest.json"
    if local.is_file():
        manifest = SwarmManifest.from_bytes(local.read_bytes(), expected_id=swarm_id)
    elif args.peers:
        manifest = _fetch_manifest(swarm_id, args.peers)
    else:
        raise SwarmlocoError(
            f"no copy of swarm {swarm_id}'s manifest in {args.data_dir}: pass --peer HOST:PORT "
            "to fetch it"
        )
    if not manifest.private:
        raise SwarmlocoError(
            f"swarm {swarm_id} is public: anyone may join it, there is nobody to admit"
        )
    if manifest.creator != identity.public_key.hex():
        raise SwarmlocoError(
            f"the key in {args.data_dir} did not create swarm {swarm_id}: only its creator "
            "can admit peers (give the --data-dir the swarm was created with)"
        )
    expires_at = int(time.time() + args.days * 86400) if args.days else 0
    cert = Membership.issue(identity, swarm_id, args.peer_id, expires_at=expires_at)
    print(cert.to_text(), flush=True)
    until = (
        "until " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires_at))
        if expires_at
        else "with no expiry"
    )
    logging.getLogger("swarmloco.admit").info(
        "admitted peer %s to swarm %s %s; it joins with `swarmloco join %s --peer "
        "HOST:PORT --membership CERT`",
        cert.peer_id,
        swarm_id[:12],
        until,
        swarm_id,
    )
    return 0


@command
def _export_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "export",
        help="write a swarm's latest global weights as safetensors (and its manifest)",
        description=(
            "Write the latest global weights of SWARM_ID into --out: model.safetensors (the "
            "model's parameters by name, with their shapes and dtypes), manifest.json, and, "
            "for a Hugging Face model, config.json, so that from_pretrained(OUT) loads it. "
            "The weights come from the newest checkpoint in --data-dir (safe while that "
            "peer runs), or with --peer from the swarm itself: the state of its latest "
            "round held from the most networks, downloaded and checked against its digest "
            "and whole (finite, its momentum no longer than its weights went)."
        ),
        epilog=(
            "examples:\n"
            "  swarmloco export 3f2a...9c1d --data-dir ./peer1 --out ./model\n"
            "  swarmloco export 3f2a...9c1d --peer 127.0.0.1:31337 --out ./model\n"
            "  # a private swarm: a member's data dir (its key and kept certificate)\n"
            "  swarmloco export 3f2a...9c1d --peer 127.0.0.1:31337 --data-dir ./peer1 "
            "--out ./model"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("swarm_id", metavar="SWARM_ID", help="the id printed by `swarmloco create`")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="a peer's data directory to read the newest checkpoint from; with --peer, "
        "the key (and kept certificate) a private swarm's download is signed with",
    )
    _add_peer_option(parser, required=False)
    parser.add_argument(
        "--membership",
        default="",
        metavar="CERT",
        help="with --peer, in a private swarm: the certificate `swarmloco admit` printed for "
        "the key in --data-dir (the line, or a file holding it)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="with --peer: how long the download may take (default: %(default)s)",
    )
    parser.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> int:
    from swarmloco.runtime.export import export

    if args.data_dir is None and not args.peers:
        raise ValueError("say where the weights come from: --data-dir DIR or --peer HOST:PORT")
    done = export(
        args.swarm_id,
        args.out,
        data_dir=args.data_dir,
        peers=tuple(args.peers),
        timeout_s=args.timeout,
        membership=_membership_text(args.membership),
    )
    print(
        f"exported round {done.round} of swarm {done.swarm_id} to {done.directory} "
        f"(digest {done.digest[:16]}, from {done.source})",
        flush=True,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmloco",
        description=(
            "Low-communication decentralized training: every peer trains locally with AdamW "
            "and the swarm averages what it learned every few hundred steps "
            "(DiLoCo / Streaming DiLoCo)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"swarmloco {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in _COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    _setup_logging(-1 if args.quiet else args.verbose)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (SwarmlocoError, ValueError) as exc:
        print(f"swarmloco {args.command}: error: {exc}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- shared options


def _add_data_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data (default: the Python standard library's .py files as bytes)")
    g.add_argument(
        "--data",
        metavar="PATH",
        action="append",
        default=[],
        help="a text file or directory (all files below it), or with --data-kind tokens a .npy "
        "or raw .bin token file; repeat for several",
    )
    g.add_argument(
        "--data-kind",
        choices=("text", "tokens"),
        default="text",
        help="how to read --data paths: text (bytes, vocabulary 256) or tokens (pre-tokenized)",
    )
    g.add_argument(
        "--data-suffix",
        metavar="EXT",
        action="append",
        default=[],
        help="with text directories, only files ending in EXT (e.g. .py); repeatable",
    )
    g.add_argument(
        "--token-dtype",
        default="uint16",
        help="element type of raw .bin token files (default: uint16)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size for token files (default: the preset's)",
    )
    g.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="context length of the model (default: the preset's)",
    )


def _model_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The preset's values --vocab-size and --seq-len replace."""
    values = {"vocab_size": args.vocab_size, "seq_len": args.seq_len}
    return {k: v for k, v in values.items() if v is not None}


def _data_spec(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from swarmloco.train.spec import DataSpec

    if not args.data:
        return DataSpec()
    return DataSpec(
        source="tokens" if args.data_kind == "tokens" else "text",
        paths=tuple(args.data),
        suffixes=tuple(args.data_suffix),
        token_dtype=args.token_dtype,
    )


# --------------------------------------------------------------------------- simulate


@command
def _add_simulate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "simulate",
        help="N DiLoCo workers in one process vs synchronous data-parallel training",
        description=(
            "Train N DiLoCo workers in this process (no network) with the real codec and outer "
            "step, and the synchronous data-parallel baseline at equal tokens (one model, N "
            "times the batch), then print a JSON summary. Example: swarmloco simulate "
            "--preset tiny --workers 4 --steps 300 --sync-every 50"
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--task", default="gpt-bytes", help="registered task name")
    p.add_argument("--preset", default="tiny", help="model preset of the task (tiny, small, base)")
    p.add_argument("--workers", type=int, default=4, help="number of DiLoCo workers")
    p.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    p.add_argument("--sync-every", type=int, default=50, help="H: inner steps between syncs")
    p.add_argument(
        "--exchange",
        choices=("int8", "fp32"),
        default="int8",
        help="int8: the blockwise codec; fp32: exact averaging",
    )
    p.add_argument("--fragments", type=int, default=1, help="F: Streaming DiLoCo fragments")
    p.add_argument(
        "--delay",
        type=int,
        default=0,
        help="tau: inner steps a fragment's exchange overlaps before it lands",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=0.0,
        help="mix on landing: local = lerp(global, local, alpha)",
    )
    p.add_argument("--error-feedback", action="store_true", help="keep the quantization residual")
    p.add_argument("--outer-lr", type=float, default=None, help="outer learning rate (default 0.7)")
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help="outer Nesterov momentum (default 0.9)",
    )
    p.add_argument(
        "--lr", type=float, default=None, help="inner peak learning rate (preset default)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="sequences per worker step")
    p.add_argument("--no-baseline", action="store_true", help="skip the synchronous baseline")
    p.add_argument(
        "--warm-start",
        type=int,
        default=0,
        metavar="STEPS",
        help="first train STEPS steps synchronously (N times the batch) and start every arm "
        "from there, as the DiLoCo paper does (0: every arm from the initial model)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="try every H of --sweep-sync-every with every outer lr of --sweep-outer-lr and "
        "every momentum of --sweep-outer-momentum (one DiLoCo arm each, one baseline) and "
        "print them best first",
    )
    p.add_argument("--sweep-sync-every", default="10,30,100", help="the H values of --sweep")
    p.add_argument("--sweep-outer-lr", default="0.4,0.7,1.0", help="the outer lrs of --sweep")
    p.add_argument(
        "--sweep-outer-momentum",
        default="0.5,0.9",
        help="the outer momenta of --sweep (0.5 learned better than the papers' 0.9 in small "
        "runs with small batches)",
    )
    p.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data streams")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="inner-loop arithmetic (auto: bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile the model (auto: on CUDA only)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice, usually one per core)",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the summary here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_data_options(p)
    p.set_defaults(handler=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from swarmloco.train.simulate import SimulationConfig, run_diloco, run_sync, warm_start
    from swarmloco.train.tasks import get_task, resolve_model

    task = get_task(args.task)
    overrides = _model_overrides(args)
    model = resolve_model(task, args.preset, overrides)
    run = task.default_run(args.preset)
    inner = run.inner
    inner = dataclasses.replace(
        inner,
        total_steps=args.steps,
        lr=args.lr if args.lr is not None else inner.lr,
        batch_size=args.batch_size or inner.batch_size,
        warmup_steps=min(inner.warmup_steps, max(args.steps // 10, 1)),
        precision=args.precision,
        compile=args.compile,
    )
    spec = dataclasses.replace(
        run.spec,
        sync_every=args.sync_every,
        fragments=args.fragments,
        delay=args.delay,
        alpha=args.alpha,
        outer_lr=run.spec.outer_lr if args.outer_lr is None else args.outer_lr,
        outer_momentum=(
            run.spec.outer_momentum if args.outer_momentum is None else args.outer_momentum
        ),
        codec=dataclasses.replace(run.spec.codec, error_feedback=args.error_feedback),
        seed=args.seed,
    )
    run = dataclasses.replace(run, inner=inner, spec=spec)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sim = SimulationConfig(
        workers=args.workers,
        steps=args.steps,
        exchange=args.exchange,
        eval_every=args.eval_every,
        device=device,
    )
    data = task.load_data(model, _data_spec(args))
    print(f"data: {data.description}", file=sys.stderr)
    progress = not args.no_progress
    start = None
    if args.warm_start:
        if args.warm_start >= args.steps:
            raise SystemExit(f"--warm-start {args.warm_start} leaves nothing of --steps")
        start = warm_start(task, model, data, run, sim, args.warm_start, progress=progress)
    grid = [(args.sync_every, spec.outer_lr, spec.outer_momentum)]
    if args.sweep:
        grid = [
            (int(h), float(lr), float(mu))
            for h in args.sweep_sync_every.split(",")
            for lr in args.sweep_outer_lr.split(",")
            for mu in args.sweep_outer_momentum.split(",")
        ]
    suffix = f"-F{args.fragments}" if args.fragments > 1 else ""
    arms = []
    for h, outer_lr, momentum in grid:
        arm_spec = dataclasses.replace(
            spec, sync_every=h, outer_lr=outer_lr, outer_momentum=momentum
        )
        arm_run = dataclasses.replace(run, spec=arm_spec)
        label = f"diloco-{args.exchange}{suffix}"
        if args.sweep:
            label += f"-H{h}-lr{outer_lr:g}-m{momentum:g}"
        arms.append(
            run_diloco(task, model, data, arm_run, sim, progress=progress, label=label, start=start)
        )
    if not args.no_baseline:
        arms.append(run_sync(task, model, data, run, sim, progress=progress, start=start))
    summary = {
        "task": task.name,
        "preset": args.preset,
        "model_params": sum(p.numel() for p in task.build_model(model).parameters()),
        "workers": args.workers,
        "steps": args.steps,
        "sync_every": args.sync_every,
        "fragments": args.fragments,
        "delay": args.delay,
        "alpha": args.alpha,
        "exchange": args.exchange,
        "device": device,
        "precision": args.precision,
        "data": data.description,
        "tokens": arms[0].tokens,
        "arms": {a.name: a.summary() for a in arms},
    }
    if start is not None:
        summary["warm_start_steps"] = start.step
    baseline = None if args.no_baseline else arms[-1]
    diloco = arms[:-1] if baseline is not None else arms
    if args.sweep:
        ranked = sorted(zip(grid, diloco, strict=True), key=lambda g: g[1].final_eval_loss)
        summary["sweep"] = [
            {
                "sync_every": h,
                "outer_lr": lr,
                "outer_momentum": mu,
                "final_eval_loss": a.final_eval_loss,
                **({"over_sync": a.final_eval_loss / baseline.final_eval_loss} if baseline else {}),
            }
            for (h, lr, mu), a in ranked
        ]
        summary["best"] = summary["sweep"][0]
        for row in summary["sweep"]:
            versus = f" ({100 * (row['over_sync'] - 1):+.2f}% vs sync)" if baseline else ""
            print(
                f"H {row['sync_every']:>4}  outer lr {row['outer_lr']:<4g}  "
                f"momentum {row['outer_momentum']:<4g}  "
                f"final eval loss {row['final_eval_loss']:.4f}{versus}",
                file=sys.stderr,
            )
        best = summary["best"]
        print(
            f"best: --sync-every {best['sync_every']} --outer-lr {best['outer_lr']:g} "
            f"--outer-momentum {best['outer_momentum']:g}",
            file=sys.stderr,
        )
    elif baseline is not None:
        d, s = diloco[0].final_eval_loss, baseline.final_eval_loss
        summary["diloco_vs_sync_eval_loss_ratio"] = d / s
        print(
            f"final eval loss: {diloco[0].name} {d:.4f}, sync {s:.4f} "
            f"({100 * (d / s - 1):+.2f}% vs synchronous data-parallel at equal tokens)",
            file=sys.stderr,
        )
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


# --------------------------------------------------------------------------- dashboard


def _add_view_options(parser: argparse.ArgumentParser) -> None:
    from swarmloco.dashboard.view import FRESH_S  # no torch: --help stays fast

    parser.add_argument("swarm_id", metavar="SWARM_ID", help="the id printed by `swarmloco create`")
    _add_peer_option(parser, required=True)
    parser.add_argument(
        "--stale-after",
        type=float,
        default=FRESH_S,
        metavar="SECONDS",
        help="a peer whose status is older than this is shown offline (default: %(default)s)",
    )
    parser.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="PEER_ID",
        help=(
            "count the figures of the peers this one averaged with, and of their partners, "
            "besides the swarm creator's (repeat for several; a peer's log names its id). "
            "Other keys' records are listed apart"
        ),
    )


@command
def _dashboard_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "dashboard",
        help="serve a web page showing a swarm: peers, loss, throughput, rounds",
        description=textwrap.fill(
            "Read the swarm SWARM_ID from the DHT every --interval seconds and serve a page "
            "that updates itself: peers online, swarm tokens/s, current round, loss curves "
            "(swarm and per peer), the round timeline with bytes sent and compression, and a "
            "table of peers. Also served: /api/v1/state (the same as JSON) and /metrics "
            "(Prometheus text format). Read-only (GET only), self-contained (works offline), "
            "and bound to 127.0.0.1 unless --host says otherwise. It never imports torch and "
            "writes nothing to disk. Once it serves it prints one line with its URL; stop it "
            "with Ctrl-C or SIGTERM.",
            width=88,
        ),
        epilog=(
            "examples:\n"
            "  swarmloco dashboard 3f2a...9c1d --peer 127.0.0.1:31337\n"
            "  swarmloco dashboard 3f2a...9c1d --peer 127.0.0.1:31337 --port 0 --interval 5\n"
            "  curl -s localhost:8080/metrics | grep swarmloco_peers_online"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_view_options(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to serve the page on (default: %(default)s, this machine only)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=8080,
        help="port to serve the page on; 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how often to read the swarm's records (default: %(default)s)",
    )
    parser.set_defaults(handler=_dashboard)


def _dashboard(args: argparse.Namespace) -> int:
    from swarmloco.dashboard.collector import CollectorConfig, check_peer_ids
    from swarmloco.dashboard.service import DashboardConfig, serve_dashboard

    config = DashboardConfig(
        swarm_id=args.swarm_id,
        peers=tuple(args.peers),
        host=args.host,
        port=args.port,
        collector=CollectorConfig(
            interval_s=args.interval,
            fresh_s=args.stale_after,
            trust=check_peer_ids(args.trust),
        ),
    )

    def ready(url: str) -> None:
        print(f"swarmloco dashboard: serving {url} for swarm {config.swarm_id}", flush=True)

    run_until_signal(lambda stop: serve_dashboard(config, stop=stop, ready=ready))
    return 0


@command
def _status_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "status",
        help="print a swarm's peers, throughput and latest rounds, then exit",
        description=textwrap.fill(
            "Read the swarm SWARM_ID from the DHT once and print what `swarmloco dashboard` "
            "shows: peers online, swarm tokens/s, current round and how many peers agree on "
            "its state, a table of peers and the latest rounds. With --json, print the "
            "dashboard's /api/v1/state document instead.",
            width=88,
        ),
        epilog=(
            "examples:\n"
            "  swarmloco status 3f2a...9c1d --peer 127.0.0.1:31337\n"
            "  swarmloco status 3f2a...9c1d --peer 127.0.0.1:31337 --json | jq .peers_online"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_view_options(parser)
    parser.add_argument("--json", action="store_true", help="print the view as JSON")
    parser.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    import json

    from swarmloco.dashboard import text
    from swarmloco.dashboard.service import swarm_status

    if not args.stale_after > 0:
        raise ValueError(f"--stale-after must be positive, got {args.stale_after}")
    view = run_async(
        swarm_status(
            args.swarm_id, tuple(args.peers), fresh_s=args.stale_after, trust=tuple(args.trust)
        )
    )
    print(json.dumps(view, indent=2, allow_nan=False) if args.json else text.render(view))
    return 0


if __name__ == "__main__":
    sys.exit(main())
