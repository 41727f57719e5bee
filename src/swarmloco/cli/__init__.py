"""The `swarmloco` command line: subcommands -> config dataclasses -> runtime. No logic here.

One module per subcommand (``create``, ``join``, ...), each with the function that adds its
parser (listed in :data:`COMMANDS`, in the order of ``--help``) and its handler; ``common``
and ``peer`` hold what several share. Modules that import torch are imported inside the
command that needs them, so that `swarmloco bootstrap` and `swarmloco dashboard` start fast
and small.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import signal
import sys
from collections.abc import Sequence

from swarmloco import __version__
from swarmloco.cli import admit, bootstrap, create, data, export, join, simulate, view
from swarmloco.cli.common import Handler, Register, _setup_logging, run_async
from swarmloco.errors import SwarmlocoError

__all__ = ["COMMANDS", "build_parser", "main", "run_async"]

COMMANDS: tuple[Register, ...] = (
    bootstrap._bootstrap_command,
    create._create_command,
    join._join_command,
    admit._admit_command,
    export._export_command,
    data._data_command,
    simulate._add_simulate,
    view._dashboard_command,
    view._status_command,
)
"""Every subcommand, in the order of ``--help``."""


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
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    _setup_logging(-1 if args.quiet else args.verbose)
    if hasattr(signal, "SIGUSR1"):
        # `kill -USR1 PID`: every thread's stack on stderr, the process goes on (a peer
        # that seems stuck says where). A stderr with no file descriptor (captured) has
        # nowhere to take it.
        with contextlib.suppress(ValueError, OSError):
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (SwarmlocoError, ValueError) as exc:
        print(f"swarmloco {args.command}: error: {exc}", file=sys.stderr)
        return 2
