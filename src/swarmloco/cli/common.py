"""What every subcommand shares: the command registry, logging, the event loop, and the
options and values several subcommands take."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


Handler = Callable[[argparse.Namespace], int]


Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]
"""Adds one subcommand to the parser and sets its handler with ``set_defaults``."""


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
    "repeat for more (all are asked at once; one answering is enough). A training peer "
    "named here is trusted, as the run's creator is: with no state of its own to weigh "
    "others against (a fresh peer, or an export), this one takes their states before any "
    "other's, so name one you trust (a peer of yours)"
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


def _peer_default(field: str) -> Any:
    """A PeerConfig default (imported lazily: the config module imports the averaging layer)."""
    from swarmloco.runtime.config import PeerConfig, default

    return default(PeerConfig, field)


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
