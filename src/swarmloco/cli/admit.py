"""`swarmloco admit`: a membership certificate for a private swarm."""

from __future__ import annotations

import argparse
import logging

from swarmloco.cli.common import _add_data_dir_option, _add_peer_option, _fetch_manifest
from swarmloco.errors import SwarmlocoError


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
