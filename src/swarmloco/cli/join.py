"""`swarmloco join`: a peer of an existing swarm."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from swarmloco.cli.box import _box_launch, _box_rank
from swarmloco.cli.common import _add_data_dir_option, _add_peer_option, _fetch_manifest
from swarmloco.cli.peer import (
    CLIENT_MODE_STAGE,
    _add_peer_run_options,
    _run_peer,
    check_stage_flags,
)


def _join_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "join",
        help="join a swarm by its id: download its state and train",
        description=(
            "Join the swarm SWARM_ID through --peer. The manifest is fetched from the DHT and "
            "its hash checked against the id: a manifest that hashes to anything else is "
            "refused. Then the peer downloads the swarm's state (the run's creator's or a "
            "--peer's when they hold one, else the one held from the most networks), checks "
            "it whole and trains, averaging with the others every H steps, until "
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
    from swarmloco.errors import ManifestError, SwarmlocoError

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
    if manifest.model.get("pipeline") is None:
        given = (
            ("--stage", args.stage is not None),
            ("--slowdown", args.slowdown > 0),
            ("--in-flight", args.in_flight is not None),
            ("--audit-share", args.audit_share is not None),
            ("--leave-idle", args.leave_idle is not None),
        )
        staged = [flag for flag, was_given in given if was_given]
        if staged:
            raise SwarmlocoError(
                f"swarm {swarm_id} is not a pipelined run (create --stages makes one): every "
                f"peer trains the whole model, so {' and '.join(staged)} mean nothing here"
            )
    elif args.client_mode:
        raise SwarmlocoError(f"swarm {swarm_id} is a pipelined run: {CLIENT_MODE_STAGE}")
    check_stage_flags(args)
    if args.audit_share is not None and not 0.0 <= args.audit_share <= 1.0:
        raise SwarmlocoError(
            f"--audit-share is the share of answers audited, from 0 to 1: got {args.audit_share}"
        )
    if args.dry_run:
        print(_dry_run(manifest, as_json=args.json), flush=True)
        return 0
    return _run_peer(manifest, args)
