"""The steps of entering a swarm that build a peer's parts, each from what it needs:
the DiLoCo state around the user's parameters, the checkpoint directory and its keeper,
the network, and the line a peer logs once it trains. ``Swarm.__enter__`` calls them in
order (see its module docstring); none of them trains or averages anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from swarmloco.core.adoption import Evidence
from swarmloco.core.codec import CodecConfig, warm_up
from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import ModelSignature, parameters_in_order
from swarmloco.core.state import THETA_G, state_digest
from swarmloco.errors import SwarmlocoError
from swarmloco.net.admission import Gate
from swarmloco.net.identity import Identity
from swarmloco.runtime.box import Box, BoxParams
from swarmloco.runtime.checkpoint import BackgroundWriter, CheckpointStore
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.keeper import CheckpointKeeper
from swarmloco.runtime.network import SwarmNetwork, averaging_config, peer_codec
from swarmloco.runtime.session import Session
from swarmloco.train.diloco import DilocoState

logger = logging.getLogger("swarmloco.runtime.swarm")


def manifest_spec(manifest: SwarmManifest) -> RunSpec:
    try:
        return RunSpec.from_manifest(manifest.hparams["run"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SwarmlocoError(
            f"swarm {manifest.swarm_id}'s manifest has no valid run spec: {exc}"
        ) from exc


def manifest_signature(manifest: SwarmManifest) -> ModelSignature:
    signature = manifest.model.get("signature")
    if not isinstance(signature, Mapping):
        raise SwarmlocoError(
            f"swarm {manifest.swarm_id}'s manifest has no model signature: it was made by an "
            "older swarmloco; create the run again"
        )
    return ModelSignature.from_manifest(signature)


def diloco_around(
    model: torch.nn.Module,
    signature: ModelSignature,
    spec: RunSpec,
    config: PeerConfig,
    box: Box | None,
) -> tuple[DilocoState, BoxParams, CodecConfig]:
    """The DiLoCo state of the swarm's layout, the model's parameters in the layout's order
    (in a box, every rank's), and this peer's codec (compiled and warmed up first: a compile
    during a round would stall the event loop)."""
    layout = signature.layout(spec.codec.block_size)
    codec = peer_codec(config, spec.codec, layout.numel)
    seconds = warm_up(codec, trimmed=spec.averaging_aggregator.method == "trimmed_mean")
    logger.info("codec (%s) ready in %.1fs", codec.backend, seconds)
    diloco = DilocoState(layout, spec.outer, codec)
    return diloco, BoxParams(parameters_in_order(model, signature.params), layout, box), codec


def take_own_initial(diloco: DilocoState, params: BoxParams, init_digest: bytes) -> bool:
    """Whether the model's weights are the run's initial ones (the manifest's digest);
    they then become the global state of round 0. False: round 0's must be fetched."""
    with params.view(None, read=True) as whole:
        diloco.set_global(whole)  # gathered in place: no copy of the model besides
    if state_digest({THETA_G: diloco.theta_g}) != init_digest:
        with diloco.lock:
            diloco.theta_g.zero_()
        return False
    return True


def open_keeper(
    stack: contextlib.ExitStack,
    config: PeerConfig,
    manifest: SwarmManifest,
    emit: Callable[..., None],
) -> CheckpointKeeper:
    """The swarm's directory (with a copy of its manifest), its checkpoint store, the
    writer thread and the keeper of its checkpoints, closed with ``stack``."""
    swarm_id = manifest.swarm_id
    swarm_dir = config.swarm_directory(swarm_id)
    swarm_dir.mkdir(parents=True, exist_ok=True)
    write_manifest_copy(swarm_dir / "manifest.json", manifest)
    store = stack.enter_context(
        CheckpointStore(swarm_dir / "checkpoints", swarm_id=swarm_id, keep=config.keep_checkpoints)
    )
    writer = stack.enter_context(BackgroundWriter(store))
    return CheckpointKeeper(store, writer, retry_s=config.checkpoint_retry_s, emit=emit)


def write_manifest_copy(path: Path, manifest: SwarmManifest) -> None:
    """Keep the manifest beside the checkpoints (atomic: a torn copy never replaces one)."""
    data = manifest.to_bytes()
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def build_network(
    *,
    config: PeerConfig,
    session: Session,
    identity: Identity,
    manifest: SwarmManifest,
    diloco: DilocoState,
    codec: CodecConfig,
    evidence: Evidence,
    admission: Gate | None,
) -> SwarmNetwork:
    """The peer's network (not started), joining through the peers it remembers too."""
    remembered = session.remembered()
    node_config = config
    if remembered:
        node = dataclasses.replace(config.node, remembered=remembered)
        node_config = dataclasses.replace(config, node=node)
    aggregator = manifest_spec(manifest).averaging_aggregator
    return SwarmNetwork(
        identity=identity,
        manifest=manifest,
        config=node_config,
        averaging=averaging_config(config, codec, aggregator),
        schema=diloco.schema,
        evidence=evidence,
        admission=admission,
    )


def clock_warning(network: SwarmNetwork) -> str:
    """What to tell the user of this machine's clock, once the network measured it ("":
    nothing)."""
    skew = network.node.dht.clock_skew_s
    if abs(skew) <= network.node.dht.config.warn_clock_skew_s:
        return ""
    where = "behind" if skew > 0 else "ahead of"
    return f"clock {abs(skew):.0f} s {where} the swarm's (kept in step with it): set it right (NTP)"


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def log_ready(spec: RunSpec, signature: ModelSignature, *, swarm_id: str, peer_id: str,
              round: int, global_step: int) -> None:  # fmt: skip
    logger.info(
        "swarm %s: %s parameters, each of %d fragment(s) syncs every %d steps (overlap %d "
        "steps, mix %.2f); this peer (id %s) at round %d, global step %d",
        swarm_id[:12],
        f"{signature.numel:,}",
        spec.fragments,
        spec.sync_every,
        spec.delay,
        spec.alpha,
        peer_id,
        round,
        global_step,
    )
