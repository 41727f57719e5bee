"""`swarmloco dashboard` and `swarmloco status`: the swarm seen from outside."""

from __future__ import annotations

import argparse
import json
import textwrap

from swarmloco.cli.common import _add_peer_option, run_async, run_until_signal


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
