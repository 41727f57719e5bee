"""The manifest of a pipelined run, and each stage's own (``docs/DESIGN.md`` section 10,
"Partition").

The run's manifest holds, under ``model["pipeline"]``, the signature of every stage (its
parameters' names, shapes and dtypes, its initial digest) in order and how activations
travel; the swarm id is the manifest's hash, so it covers the cut. The replicas of stage k
are a DiLoCo swarm of their own over that stage's parameters: :func:`stage_manifest`
derives its manifest from the run's (the stage's signature, the run's spec, data and
creator, and the run's id), the same bytes on every peer, so its id names the stage's DHT
records (progress, rounds, digests) apart from every other stage's and run's, and
``Peer`` runs a stage with nothing of its own to know about pipelines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.signature import LayerUnit, ModelSignature, default_layer_unit, signature_of
from swarmloco.errors import SwarmlocoError
from swarmloco.net.records import MAX_STAGES

if TYPE_CHECKING:  # (the manifest is read without torch: the dashboard reads it)
    from torch import nn

    from swarmloco.core.runspec import RunSpec

ENCODINGS = ("int8", "bf16", "f32")
"""How activations and their gradients may travel between stages."""


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """What a run's manifest says of its stages."""

    signatures: tuple[ModelSignature, ...]
    """Each stage's, in order (stage 0 draws the data, the last computes the loss)."""
    encoding: str
    """How activations and their gradients travel (one of :data:`ENCODINGS`)."""

    @property
    def stages(self) -> int:
        return len(self.signatures)


def pipeline_manifest(
    spec: RunSpec,
    stages: Sequence[nn.Module],
    *,
    creator: str,
    task: str,
    name: str = "",
    model: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    encoding: str = "int8",
    admission: str = "",
    identity_work: int | None = None,
    layer_unit: LayerUnit = default_layer_unit,
) -> SwarmManifest:
    """The manifest of a run of ``stages`` (each as every peer builds it: its weights now
    are its initial ones), each stage averaged by the DiLoCo of ``spec``, whose rounds
    overlap the steps (``spec.delay`` >= 1)."""
    from swarmloco.runtime.api import run_manifest

    signatures = stage_signatures(spec, stages, layer_unit)
    # The run's own signature is its first stage's (what a tool that knows nothing of
    # pipelines reads); the stages' are under "pipeline".
    made = run_manifest(
        spec,
        signatures[0],
        creator=creator,
        task=task,
        name=name,
        model=model,
        data=data,
        admission=admission,
        identity_work=identity_work,
    )
    return declare_pipeline(made, spec, signatures, encoding)


def stage_signatures(
    spec: RunSpec, stages: Sequence[nn.Module], layer_unit: LayerUnit = default_layer_unit
) -> list[ModelSignature]:
    """Each stage's signature, in the layout of ``spec``."""
    return [
        signature_of(
            stage, fragments=spec.fragments, block_size=spec.codec.block_size, layer_unit=layer_unit
        )
        for stage in stages
    ]


def declare_pipeline(
    manifest: SwarmManifest,
    spec: RunSpec,
    signatures: Sequence[ModelSignature],
    encoding: str = "int8",
) -> SwarmManifest:
    """``manifest`` (of a run of ``spec``) declaring the stages of these ``signatures``."""
    if not 2 <= len(signatures) <= MAX_STAGES:
        raise ValueError(f"a pipelined run has 2 to {MAX_STAGES} stages, not {len(signatures)}")
    if encoding not in ENCODINGS:
        raise ValueError(f"activations travel as one of {', '.join(ENCODINGS)}, not {encoding!r}")
    if spec.delay < 1:
        raise ValueError(
            "a pipelined run's rounds overlap its steps (delay >= 1): a stage whose replicas "
            "paused for their round would stall every other stage, and keep the replicas "
            "that should join the round from stepping"
        )
    declared = {"stages": [s.to_manifest() for s in signatures], "encoding": encoding}
    return dataclasses.replace(manifest, model={**manifest.model, "pipeline": declared})


def pipeline_of(manifest: SwarmManifest) -> Pipeline | None:
    """The stages ``manifest`` declares (None: not a pipelined run); a declaration that
    cannot be read raises a clear error."""
    declared = manifest.model.get("pipeline")
    if declared is None:
        return None
    where = f"swarm {manifest.swarm_id}'s pipeline"
    if not isinstance(declared, Mapping):
        raise SwarmlocoError(f"{where} is not a mapping")
    stages, encoding = declared.get("stages"), declared.get("encoding")
    if not isinstance(stages, list) or not 2 <= len(stages) <= MAX_STAGES:
        raise SwarmlocoError(f"{where} must list 2 to {MAX_STAGES} stages")
    if encoding not in ENCODINGS:
        raise SwarmlocoError(f"{where}: activations travel as one of {', '.join(ENCODINGS)}")
    signatures = []
    for k, stage in enumerate(stages):
        try:
            if not isinstance(stage, Mapping):
                raise TypeError("not a mapping")
            signatures.append(ModelSignature.from_manifest(stage))
        except (TypeError, SwarmlocoError) as exc:
            raise SwarmlocoError(f"{where}: stage {k}'s signature cannot be read: {exc}") from exc
    return Pipeline(tuple(signatures), str(encoding))


def stage_manifest(manifest: SwarmManifest, stage: int) -> SwarmManifest:
    """The manifest of the swarm of ``stage``'s replicas in the pipelined run
    ``manifest``: the same bytes on every peer (its id names the stage's records)."""
    pipeline = pipeline_of(manifest)
    if pipeline is None:
        raise SwarmlocoError(f"swarm {manifest.swarm_id} is not a pipelined run")
    if not 0 <= stage < pipeline.stages:
        raise SwarmlocoError(
            f"swarm {manifest.swarm_id} has stages 0 to {pipeline.stages - 1}, not {stage}"
        )
    model = {
        key: value for key, value in manifest.model.items() if key not in ("pipeline", "signature")
    }
    model |= {
        "signature": pipeline.signatures[stage].to_manifest(),
        "stage": {"index": stage, "of": pipeline.stages, "run": manifest.swarm_id},
    }
    return dataclasses.replace(
        manifest,
        model=model,
        name=f"{manifest.name or manifest.swarm_id[:12]} stage {stage}",
    )
