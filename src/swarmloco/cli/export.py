"""`swarmloco export`: the swarm's weights as a loadable checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarmloco.cli.common import _add_peer_option, _membership_text


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
            "and whole (finite, its momentum no longer than its weights went). A pipelined "
            "run (create --stages) exports every stage's latest weights: the built-in llama "
            "as one model (its head untied), any other model as stage-<k>.safetensors."
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
    from swarmloco.pipeline.export import ExportedStages, export_run

    if args.data_dir is None and not args.peers:
        raise ValueError("say where the weights come from: --data-dir DIR or --peer HOST:PORT")
    done = export_run(
        args.swarm_id,
        args.out,
        data_dir=args.data_dir,
        peers=tuple(args.peers),
        timeout_s=args.timeout,
        membership=_membership_text(args.membership),
    )
    if isinstance(done, ExportedStages):
        stages = ", ".join(
            f"stage {k} round {r} (digest {d[:16]})"
            for k, (r, d) in enumerate(zip(done.rounds, done.digests, strict=True))
        )
        print(
            f"exported the {len(done.rounds)} stages of run {done.swarm_id} to "
            f"{done.directory} ({', '.join(done.files)}): {stages}",
            flush=True,
        )
        return 0
    print(
        f"exported round {done.round} of swarm {done.swarm_id} to {done.directory} "
        f"(digest {done.digest[:16]}, from {done.source})",
        flush=True,
    )
    return 0
