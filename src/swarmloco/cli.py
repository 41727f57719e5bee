"""The `swarmloco` command line: subcommands -> config dataclasses -> runtime. No logic here.

Modules that import torch are imported inside the command that needs them, so that
`swarmloco bootstrap` and `swarmloco dashboard` start fast and small.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from swarmloco import __version__
from swarmloco.errors import SwarmlocoError

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
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in _COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
