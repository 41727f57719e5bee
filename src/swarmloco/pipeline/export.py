"""A pipelined run's stages back into one model (``docs/DESIGN.md`` section 10, "Export").

:func:`export_run` takes each stage's latest global weights (downloaded from its stage
swarm through ``peers``, or from the stage's checkpoints in a peer's data directory) and
writes, for the built-in ``llama`` task, one ``model.safetensors`` under
``LlamaForCausalLM``'s names with a ``config.json`` (its head untied: the last stage
trained its own), so that ``from_pretrained`` loads the model the stages trained; for any
other model, one ``stage-<k>.safetensors`` a stage under the stage module's own names.
A run that is not pipelined is exported as :func:`swarmloco.runtime.export.export` does.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from swarmloco.core.config import from_mapping
from swarmloco.core.manifest import SwarmManifest, check_swarm_id
from swarmloco.errors import SwarmlocoError
from swarmloco.pipeline.manifest import pipeline_of, stage_manifest
from swarmloco.pipeline.stages import renumbered, split_evenly
from swarmloco.runtime.export import (
    Exported,
    Latest,
    export,
    from_checkpoint,
    from_swarm,
    local_manifest,
    local_swarm_dir,
    task_config,
    weights_of,
    write_atomic,
    write_export,
    write_manifest,
)
from swarmloco.runtime.swarm import manifest_signature, manifest_spec
from swarmloco.train.spec import LlamaConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExportedStages:
    """What :func:`export_run` wrote for a pipelined run."""

    directory: Path
    swarm_id: str
    rounds: tuple[int, ...]
    """Each stage's round (stages average in rounds of their own)."""
    digests: tuple[str, ...]
    sources: tuple[str, ...]
    files: tuple[str, ...]
    """The weight files written (one, or one a stage)."""


def export_run(
    swarm_id: str,
    out_dir: str | Path,
    *,
    data_dir: str | Path | None = None,
    peers: Sequence[str] = (),
    timeout_s: float = 300.0,
    membership: str = "",
) -> Exported | ExportedStages:
    """Export run ``swarm_id`` into ``out_dir``: a pipelined run's stages as one model (see
    the module), any other run as :func:`~swarmloco.runtime.export.export` does. With
    ``peers``, every stage's state is downloaded; without, each stage's newest checkpoint
    in ``data_dir`` is read, and a stage it lacks is named."""
    swarm_id = check_swarm_id(swarm_id)
    local = local_swarm_dir(data_dir, swarm_id)
    if peers:
        manifest, latest = from_swarm(
            swarm_id,
            _swarms_of,
            local=local,
            data_dir=data_dir,
            peers=peers,
            timeout_s=timeout_s,
            membership=membership,
        )
    else:
        kept = local_manifest(swarm_id, local)
        if kept is None or pipeline_of(kept) is None:  # a run of one stage: as ever
            return export(swarm_id, out_dir, data_dir=data_dir, membership=membership)
        manifest, latest = kept, [_from_local(kept, stage, data_dir) for stage in _swarms_of(kept)]
    if pipeline_of(manifest) is None:
        return _single(swarm_id, out_dir, manifest, latest[0])
    return _stages(manifest, latest, Path(out_dir))


def _swarms_of(manifest: SwarmManifest) -> list[SwarmManifest]:
    """The swarms whose weights make ``manifest``'s model: each stage's, or its own."""
    pipeline = pipeline_of(manifest)
    if pipeline is None:
        return [manifest]
    return [stage_manifest(manifest, k) for k in range(pipeline.stages)]


def _from_local(run: SwarmManifest, stage: SwarmManifest, data_dir: str | Path | None) -> Latest:
    local = local_swarm_dir(data_dir, stage.swarm_id)
    assert local is not None
    if not (local / "checkpoints").is_dir():
        k = _swarms_of(run).index(stage)
        raise SwarmlocoError(
            f"{data_dir} holds no checkpoint of stage {k} of run {run.swarm_id} (its peer "
            "served another stage): export with --peer HOST:PORT to take every stage from "
            "the run"
        )
    return from_checkpoint(stage, local)


def _single(
    swarm_id: str, out_dir: str | Path, manifest: SwarmManifest, latest: Latest
) -> Exported:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    block = manifest_spec(manifest).codec.block_size
    tensors = weights_of(manifest_signature(manifest), latest.theta, block)
    metadata = {"swarm_id": swarm_id, "round": str(latest.round), "digest": latest.digest}
    write_export(out, manifest, tensors, metadata, task_config(manifest))
    return Exported(out, swarm_id, latest.round, latest.digest, latest.source)


def _stages(manifest: SwarmManifest, latest: list[Latest], out: Path) -> ExportedStages:
    pipeline = pipeline_of(manifest)
    assert pipeline is not None
    block = manifest_spec(manifest).codec.block_size
    per_stage = [
        weights_of(signature, found.theta, block)
        for signature, found in zip(pipeline.signatures, latest, strict=True)
    ]
    metadata = {
        "swarm_id": manifest.swarm_id,
        "stage_rounds": ",".join(str(found.round) for found in latest),
        "stage_digests": ",".join(found.digest for found in latest),
    }
    out.mkdir(parents=True, exist_ok=True)
    if manifest.task == "llama":
        model = _llama_model(manifest)
        tensors = _llama_whole(per_stage, model["n_layer"])
        write_export(out, manifest, tensors, metadata, _llama_config(model))
        files: tuple[str, ...] = ("model.safetensors",)
    else:
        files = tuple(f"stage-{k:02d}.safetensors" for k in range(pipeline.stages))
        for k, (name, tensors) in enumerate(zip(files, per_stage, strict=True)):
            stage_metadata = {
                "format": "pt",
                "swarm_id": manifest.swarm_id,
                "stage": str(k),
                "round": str(latest[k].round),
                "digest": latest[k].digest,
            }
            write_atomic(out / name, _saver(tensors, stage_metadata))
        write_manifest(out, manifest, None)
    logger.info(
        "exported run %s's %d stages (rounds %s) to %s",
        manifest.swarm_id[:12],
        pipeline.stages,
        metadata["stage_rounds"],
        out,
    )
    return ExportedStages(
        out,
        manifest.swarm_id,
        tuple(found.round for found in latest),
        tuple(found.digest for found in latest),
        tuple(found.source for found in latest),
        files,
    )


def _saver(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Callable[[Path], None]:
    return lambda path: save_file(tensors, str(path), metadata=metadata)


def _llama_model(manifest: SwarmManifest) -> dict[str, Any]:
    """The Llama's config as the manifest's model holds it (without the pipeline's part)."""
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    model = {k: v for k, v in manifest.model.items() if k in fields}
    return dataclasses.asdict(from_mapping(LlamaConfig, model))


def _llama_whole(per_stage: list[dict[str, torch.Tensor]], n_layer: int) -> dict[str, torch.Tensor]:
    """Each stage's Llama parameters under the whole model's names (its layers numbered
    from the stage's first, the last stage's own head as ``lm_head.weight``)."""
    runs = split_evenly(n_layer, len(per_stage))
    whole: dict[str, torch.Tensor] = {}
    for tensors, layers in zip(per_stage, runs, strict=True):
        for name, tensor in tensors.items():
            named = renumbered(name, "model.layers", layers.start)
            if named in whole:
                raise SwarmlocoError(f"two stages hold {named}: not a cut of one Llama")
            whole[named] = tensor
    return whole


def _llama_config(model: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of the exported Llama: untied, whatever the run's config said (cut
    apart, the last stage trained a head of its own)."""
    from swarmloco.train.llama import hf_config

    config = from_mapping(LlamaConfig, model)
    return hf_config(dataclasses.replace(config, tie_embeddings=False))
