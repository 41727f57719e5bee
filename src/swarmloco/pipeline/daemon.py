"""A pipelined run of a built-in task, as ``swarmloco create --stages S`` makes it and
``swarmloco join`` serves it (``docs/DESIGN.md`` section 10).

:func:`build_pipeline_manifest` is the task's manifest (its model, data and every
hyperparameter) declaring the cut of its model into stages. :func:`train_stage` runs one
peer of it: the stage it is told, else the one whose checkpoints its data directory holds
(:func:`served_before`: a restarted peer takes back its stage), else the one with the
fewest peers (:func:`choose_stage`, from the ``stage-load`` records: later stages first on
a tie, since drivers need them);
at stage 0 it draws micro-batches from the task's data and drives them through the
pipeline until stopped, elsewhere it serves until stopped. Each peer builds the whole
model to cut its stage from it (every peer's weights are the seed's): a model too large
for one peer's memory needs a cut built stage by stage, not done yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmloco.core.manifest import SwarmManifest
from swarmloco.errors import Stopped, SwarmlocoError
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.pipeline.driver import PipelineError
from swarmloco.pipeline.load import StageLoad, fresh, read_loads
from swarmloco.pipeline.manifest import (
    declare_pipeline,
    pipeline_of,
    stage_manifest,
    stage_signatures,
)
from swarmloco.pipeline.peer import StagePeer, StageWork
from swarmloco.pipeline.stages import cut_gpt
from swarmloco.pipeline.wire import Boundary
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.daemon import resolve_device
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.session import handle_signals
from swarmloco.runtime.start import describe_device
from swarmloco.train.data import BatchStream
from swarmloco.train.model import GPT
from swarmloco.train.spec import DataSpec
from swarmloco.train.tasks import (
    RunConfig,
    Task,
    build_manifest,
    build_task_model,
    run_from_manifest,
)

logger = logging.getLogger(__name__)

NO_REPLICA_PAUSE_S = 2.0  # a stage with no peer yet: how long a driver waits before trying again


def task_stages(
    task: Task, model: Mapping[str, Any], run: RunConfig, stages: int
) -> list[nn.Module]:
    """The task's model (as every peer builds it) cut into ``stages`` stages."""
    full = build_task_model(task, model, run)
    if not isinstance(full, GPT):
        raise SwarmlocoError(
            f"task {task.name} cannot be cut into stages yet (the built-in GPT of gpt-bytes can)"
        )
    return list(cut_gpt(full, stages))


def build_pipeline_manifest(
    task: str,
    preset: str,
    stages: int,
    *,
    creator: str,
    encoding: str = "int8",
    **options: Any,
) -> SwarmManifest:
    """:func:`~swarmloco.train.tasks.build_manifest`'s manifest (``options`` are its)
    declaring its model cut into ``stages`` stages."""
    manifest = build_manifest(task, preset, creator=creator, **options)
    t, model, _, run = run_from_manifest(manifest)
    cut = task_stages(t, model, run, stages)
    signatures = stage_signatures(run.spec, cut, t.layer_unit)
    return declare_pipeline(manifest, run.spec, signatures, encoding)


def choose_stage(loads: Sequence[StageLoad], stages: int) -> int:
    """The stage with the fewest peers in ``loads``; on a tie the later one (drivers are no
    use until every later stage has a peer)."""
    peers = [0] * stages
    for load in {(x.peer, x.stage): x for x in loads}.values():
        if 0 <= load.stage < stages:
            peers[load.stage] += 1
    return min(range(stages), key=lambda k: (peers[k], -k))


def served_before(manifest: SwarmManifest, stages: int, directory: Path) -> int | None:
    """The stage whose checkpoints ``directory`` holds (the newest, if several): a peer
    restarted without ``--stage`` takes back the stage it served, its work included."""
    newest: tuple[float, int] | None = None
    for k in range(stages):
        folder = directory / "swarms" / stage_manifest(manifest, k).swarm_id / "checkpoints"
        times = [p.stat().st_mtime for p in folder.glob("ckpt-*")] if folder.is_dir() else []
        if times and (newest is None or max(times) > newest[0]):
            newest = (max(times), k)
    return None if newest is None else newest[1]


def _read_loads(swarm_id: str, peers: Sequence[str], identity: Identity) -> list[StageLoad]:
    async def read() -> list[StageLoad]:
        config = NodeConfig(server=None, peers=tuple(peers))
        async with NetNode(identity=identity, config=config) as node:
            return fresh(await read_loads(node.dht, swarm_id), node.dht.clock())

    with LoopThread(name="swarmloco-choose-stage") as loop:
        return loop.run(read(), timeout=60.0)


@dataclasses.dataclass(frozen=True)
class StageSummary:
    """What a stage's peer did."""

    stage: int
    round: int
    steps: int
    micro_batches: int
    stopped_because: str


def train_stage(
    manifest: SwarmManifest,
    config: PeerConfig,
    *,
    identity: Identity,
    stage: int | None = None,
    device: str = "auto",
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> StageSummary:
    """Serve ``stage`` of the pipelined run ``manifest`` (None: :func:`served_before`, else
    :func:`choose_stage`) on ``device`` (``auto``: a GPU if torch sees one) until stopped
    (a signal, max rounds, the run's end)."""
    where = resolve_device(device)
    pipeline = pipeline_of(manifest)
    if pipeline is None:
        raise SwarmlocoError(f"swarm {manifest.swarm_id} is not a pipelined run")
    if stage is None:
        stage = served_before(manifest, pipeline.stages, config.directory)
        if stage is not None:
            logger.info(
                "serving stage %d of %d again (this data directory holds its checkpoints)",
                stage,
                pipeline.stages,
            )
    if stage is None:
        loads = _read_loads(manifest.swarm_id, config.node.peers, identity)
        stage = choose_stage(loads, pipeline.stages)
        logger.info(
            "serving stage %d of %d (the one with the fewest peers)", stage, pipeline.stages
        )
    if not 0 <= stage < pipeline.stages:
        raise SwarmlocoError(f"swarm {manifest.swarm_id} has stages 0 to {pipeline.stages - 1}")
    task, model, data, run = run_from_manifest(manifest)
    module = task_stages(task, model, run, pipeline.stages)[stage].to(where)
    logger.info("stage %d computes on %s", stage, describe_device(where))
    work = _work(module, model, run)
    peer = StagePeer(manifest, stage, work, config=config, identity=identity, on_event=on_event)
    driven = 0
    with contextlib.ExitStack() as stack:
        if config.handle_signals:
            handle_signals(stack, lambda why: _stop(peer, why))
        stack.enter_context(peer)
        if stage == 0:
            driven = _drive(peer, task, model, data, run, work, identity.peer_id_hex)
        else:
            while not peer.stopped.wait(0.5) and not _asked_to_stop(peer):
                pass
    assert peer.peer is not None
    k = peer.peer.kept
    return StageSummary(stage, peer.peer.diloco.round, k.progress.steps, driven, k.stop.reason)


def _work(module: nn.Module, model: Mapping[str, Any], run: RunConfig) -> StageWork:
    inner = run.inner
    sequences = inner.batch_size * inner.grad_accum
    micro = max(1, min(sequences, 8))
    seq_len, width, vocab = int(model["seq_len"]), int(model["n_embd"]), int(model["vocab_size"])
    optimizer = torch.optim.AdamW(
        module.parameters(),
        lr=inner.lr,
        betas=(inner.beta1, inner.beta2),
        weight_decay=inner.weight_decay,
        fused=next(module.parameters()).is_cuda,
    )
    return StageWork(
        module=module,
        optimizer=optimizer,
        activations=Boundary(width=width, max_batch=micro, max_tokens=seq_len),
        ids=Boundary(width=0, max_batch=micro, max_tokens=seq_len, vocab=vocab),
        step_samples=sequences,
        tokens_per_sequence=seq_len,
        lr_at=inner.lr_at,
        grad_clip=inner.grad_clip,
    )


def _stop(peer: StagePeer, why: str) -> None:
    if peer.peer is not None:
        peer.peer.kept.stop.stop(why)


def _asked_to_stop(peer: StagePeer) -> bool:
    return peer.peer is not None and peer.peer.kept.stop.is_set()


def _drive(
    peer: StagePeer,
    task: Task,
    model: Mapping[str, Any],
    data_spec: DataSpec,
    run: RunConfig,
    work: StageWork,
    peer_id: str,
) -> int:
    """Stage 0: micro-batches of the task's data through the pipeline until stopped."""
    data = task.load_data(model, data_spec)
    stream = BatchStream(
        data.train,
        seq_len=work.tokens_per_sequence,
        batch_size=work.ids.max_batch,
        vocab_size=data.vocab_size,
        seed=run.spec.seed,
        worker=int(peer_id[:8], 16),
    )
    driven = 0
    while not _asked_to_stop(peer):
        x, y = stream.next_batch()
        try:
            peer.drive(x, y)
        except Stopped:
            break
        except PipelineError as exc:  # a stage without a peer yet, or all of its gone
            logger.warning("%s; trying again in %.0f s", exc, NO_REPLICA_PAUSE_S)
            if peer.stopped.wait(NO_REPLICA_PAUSE_S):
                break
            continue
        driven += 1
    return driven
