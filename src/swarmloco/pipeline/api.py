"""A pipelined run of your own model, through the library (``docs/DESIGN.md`` section 10;
``examples/pipeline_own_stages.py`` runs one)::

    from swarmloco.pipeline import Boundary, StagePeer, StageWork, create_pipeline, fetch_pipeline

    stages = build_stages()               # your nn.Modules, the same weights on every peer
    run = create_pipeline(spec, stages, data_dir="peer0")        # the creator: print run.swarm_id
    run = fetch_pipeline(swarm_id, ["host:port"])                # everyone else
    work = StageWork(module=stages[k], optimizer=AdamW(stages[k].parameters()), ...)
    with StagePeer(run, k, work, config=PeerConfig(data_dir="peer0")) as peer:
        peer.drive(x, targets)            # at stage 0, one micro-batch through the pipeline
        future = peer.submit(x, targets)  # or several at once: each step still on the run's batch

What a stage module must do: stage 0 takes token ids ``(batch, tokens)``; every stage but
the last returns activations ``(batch, tokens, width)`` (one ``width`` for every boundary,
``StageWork.activations``), which the next stage takes; the last stage's ``forward(x,
targets)`` returns the mean loss over the targets ``(batch, tokens)``. The manifest holds
every stage's signature (its parameters' names and shapes) and the run spec; a peer whose
stage module differs is refused, naming each difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import nn

from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.runspec import RunSpec
from swarmloco.errors import SwarmlocoError
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.swarm import fetch_manifest
from swarmloco.pipeline.manifest import pipeline_manifest, pipeline_of
from swarmloco.runtime.api import CUSTOM_TASK
from swarmloco.runtime.loop_thread import LoopThread


def create_pipeline(
    spec: RunSpec,
    stages: Sequence[nn.Module],
    *,
    data_dir: str | Path,
    name: str = "",
    encoding: str = "int8",
    identity_work: int | None = None,
) -> SwarmManifest:
    """A new pipelined run of ``stages`` (each as every peer builds it: its weights now are
    its initial ones), created by the key in ``data_dir`` (made there if none is).
    ``spec.delay`` must be at least 1 (a stage's rounds overlap its steps); ``encoding``:
    how activations and their gradients travel (int8, bf16 or f32); ``identity_work``:
    bits of work each key proves to take part (default: a public run's)."""
    identity = Identity.load_or_create(Path(data_dir))
    return pipeline_manifest(
        spec,
        stages,
        creator=identity.public_key.hex(),
        task=CUSTOM_TASK,
        name=name,
        encoding=encoding,
        identity_work=identity_work,
    )


def fetch_pipeline(
    swarm_id: str, peers: Sequence[str], *, timeout_s: float = 60.0
) -> SwarmManifest:
    """The verified manifest of the pipelined run ``swarm_id``, fetched through ``peers``
    (``ManifestError`` when none of them has it; ``SwarmlocoError`` when it is not a
    pipelined run)."""

    async def fetch() -> SwarmManifest:
        config = NodeConfig(server=None, peers=tuple(peers))
        async with NetNode(identity=Identity.generate(), config=config) as node:
            return await fetch_manifest(node.dht, swarm_id)

    with LoopThread(name="swarmloco-fetch-pipeline") as loop:
        manifest = loop.run(fetch(), timeout=timeout_s)
    if pipeline_of(manifest) is None:
        raise SwarmlocoError(
            f"swarm {swarm_id} is not a pipelined run: every peer trains the whole model "
            "(swarmloco.join serves it)"
        )
    return manifest
