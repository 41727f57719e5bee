"""`swarmloco bootstrap`: a DHT node others join the network through."""

from __future__ import annotations

import argparse

from swarmloco.cli.common import (
    _add_data_dir_option,
    _add_tls_options,
    _tls_config,
    run_until_signal,
)


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
