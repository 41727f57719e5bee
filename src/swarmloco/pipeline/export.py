"""A pipelined run's stages back into one model (``docs/DESIGN.md`` section 10, "Export").

:func:`export_run` takes each stage's latest global weights (downloaded from its stage
swarm through ``peers``, or from the stage's checkpoints in a peer's data directory) and
writes, for the built-in ``llama`` task, one ``model.safetensors`` under
``LlamaForCausalLM``'s names with a ``config.json`` (its head untied: the last stage
trained its own), so that ``from_pretrained`` loads the model the stages trained; for any
other model, one ``stage-<k>.safetensors`` a stage under the stage module's own names.
Each stage's weights are written as they come (:class:`StagesWriter`): the exporting
machine holds one stage's at a time, never the whole model's. A run that is not
pipelined is exported as :func:`swarmloco.runtime.export.export` does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from swarmloco.core.config import from_mapping
from swarmloco.core.manifest import SwarmManifest, check_swarm_id
from swarmloco.core.state import DTYPES
from swarmloco.errors import SwarmlocoError
from swarmloco.pipeline.manifest import pipeline_of, stage_manifest
from swarmloco.pipeline.stages import renumbered, split_evenly
from swarmloco.runtime.export import (
    WEIGHTS,
    Exported,
    Latest,
    export,
    export_latest,
    from_checkpoint,
    from_swarm,
    local_manifest,
    local_swarm_dir,
    weights_of,
    write_atomic,
    write_manifest,
)
from swarmloco.runtime.swarm import manifest_spec
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
    out = Path(out_dir)
    writers: list[StagesWriter] = []

    def each(manifest: SwarmManifest) -> Callable[[int, Latest], None] | None:
        if pipeline_of(manifest) is None:
            return None
        writers.append(StagesWriter(manifest, out))
        return writers[0].add

    try:
        if peers:
            manifest, latest = from_swarm(
                swarm_id,
                _swarms_of,
                local=local,
                data_dir=data_dir,
                peers=peers,
                timeout_s=timeout_s,
                membership=membership,
                each=each,
            )
            if not writers:
                return export_latest(swarm_id, out, manifest, latest[0])
            return writers[0].finish()
        kept = local_manifest(swarm_id, local)
        if kept is None or pipeline_of(kept) is None:  # a run of one stage: as ever
            return export(swarm_id, out, data_dir=data_dir, membership=membership)
        stages = _swarms_of(kept)
        for k, stage in enumerate(stages):  # every stage is there before anything is written
            _stage_dir(kept, k, stage, data_dir)
        writers.append(StagesWriter(kept, out))
        for k, stage in enumerate(stages):
            writers[0].add(k, from_checkpoint(stage, _stage_dir(kept, k, stage, data_dir)))
        return writers[0].finish()
    except BaseException:
        for writer in writers:  # a stage that failed to come: no half-written file left
            writer.abort()
        raise


def _swarms_of(manifest: SwarmManifest) -> list[SwarmManifest]:
    """The swarms whose weights make ``manifest``'s model: each stage's, or its own."""
    pipeline = pipeline_of(manifest)
    if pipeline is None:
        return [manifest]
    return [stage_manifest(manifest, k) for k in range(pipeline.stages)]


def _stage_dir(
    run: SwarmManifest, k: int, stage: SwarmManifest, data_dir: str | Path | None
) -> Path:
    """Where ``data_dir`` keeps stage ``k``'s checkpoints; SwarmlocoError naming the stage
    when it holds none."""
    local = local_swarm_dir(data_dir, stage.swarm_id)
    assert local is not None
    if not (local / "checkpoints").is_dir():
        raise SwarmlocoError(
            f"{data_dir} holds no checkpoint of stage {k} of run {run.swarm_id} (its peer "
            "served another stage): export with --peer HOST:PORT to take every stage from "
            "the run"
        )
    return local


class StagesWriter:
    """Writes a pipelined run's export a stage at a time, as each stage's weights come:
    only one stage's are in memory at once (see the module)."""

    def __init__(self, manifest: SwarmManifest, out: Path) -> None:
        pipeline = pipeline_of(manifest)
        assert pipeline is not None
        self.manifest = manifest
        self.pipeline = pipeline
        self.out = out
        self.block = manifest_spec(manifest).codec.block_size
        self.found: dict[int, Latest] = {}
        out.mkdir(parents=True, exist_ok=True)
        self.whole: WholeFile | None = None
        if manifest.task == "llama":
            model = _llama_model(manifest)
            runs = split_evenly(int(model["n_layer"]), pipeline.stages)
            self.first_layers = [layers.start for layers in runs]
            self.whole = WholeFile(out / WEIGHTS, self._whole_specs(), pipeline.stages)
            self.config = _llama_config(model)

    def _whole_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        specs, seen = [], set()
        for k, signature in enumerate(self.pipeline.signatures):
            for p in signature.params:
                name = renumbered(p.name, "model.layers", self.first_layers[k])
                if name in seen:
                    raise SwarmlocoError(f"two stages hold {name}: not a cut of one Llama")
                seen.add(name)
                specs.append((name, p.dtype, tuple(p.shape)))
        return specs

    def add(self, k: int, latest: Latest) -> None:
        """Stage ``k``'s weights: written now."""
        tensors = weights_of(self.pipeline.signatures[k], latest.theta, self.block)
        self.found[k] = dataclasses.replace(latest, theta=torch.empty(0))
        if self.whole is not None:
            for name, tensor in tensors.items():
                self.whole.write(renumbered(name, "model.layers", self.first_layers[k]), tensor)
            return
        metadata = {
            "format": "pt",
            "swarm_id": self.manifest.swarm_id,
            "stage": str(k),
            "round": str(latest.round),
            "digest": latest.digest,
        }
        write_atomic(self.out / _stage_file(k), _saver(tensors, metadata))

    def abort(self) -> None:
        """Drop what was written of the whole file (the stage files are written whole)."""
        if self.whole is not None:
            self.whole.abort()

    def finish(self) -> ExportedStages:
        """Every stage's weights written: the file(s) completed, the manifest and config."""
        stages = self.pipeline.stages
        if sorted(self.found) != list(range(stages)):
            missing = sorted(set(range(stages)) - set(self.found))
            raise SwarmlocoError(f"stages {missing} of run {self.manifest.swarm_id} are missing")
        found = [self.found[k] for k in range(stages)]
        rounds = ",".join(str(f.round) for f in found)
        if self.whole is not None:
            digests = ",".join(f.digest for f in found)
            self.whole.finish(
                {
                    "swarm_id": self.manifest.swarm_id,
                    "stage_rounds": rounds,
                    "stage_digests": digests,
                }
            )
            write_manifest(self.out, self.manifest, self.config)
            files: tuple[str, ...] = (WEIGHTS,)
        else:
            write_manifest(self.out, self.manifest, None)
            files = tuple(_stage_file(k) for k in range(stages))
        logger.info(
            "exported run %s's %d stages (rounds %s) to %s",
            self.manifest.swarm_id[:12],
            stages,
            rounds,
            self.out,
        )
        return ExportedStages(
            self.out,
            self.manifest.swarm_id,
            tuple(f.round for f in found),
            tuple(f.digest for f in found),
            tuple(f.source for f in found),
            files,
        )


def _stage_file(k: int) -> str:
    return f"stage-{k:02d}.safetensors"


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


class WholeFile:
    """One safetensors file written a tensor at a time, in any order: the layout is fixed
    first (every tensor's place, from the stages' signatures), the header last (its
    metadata, each stage's round and digest, known only then: room for it is kept at the
    front), then the file is renamed into place."""

    def __init__(
        self, path: Path, specs: Sequence[tuple[str, str, tuple[int, ...]]], stages: int
    ) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.header: dict[str, Any] = {}
        offset = 0
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
            self.header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        # Room for the header with its metadata at their longest (a round of 20 digits, a
        # digest of 64 hex digits a stage).
        widest = {
            "swarm_id": "f" * 40,
            "stage_rounds": ",".join(["9" * 20] * stages),
            "stage_digests": ",".join(["f" * 64] * stages),
        }
        self.room = len(self._header_bytes(widest)) + 8
        self.room += -self.room % 8
        self.written: set[str] = set()
        self._file = open(self.tmp, "wb")  # noqa: SIM115 (closed in finish)

    def _header_bytes(self, metadata: dict[str, str]) -> bytes:
        return json.dumps(
            {"__metadata__": {"format": "pt", **metadata}, **self.header}, separators=(",", ":")
        ).encode()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        start, stop = self.header[name]["data_offsets"]
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
        if len(data) != stop - start:
            raise SwarmlocoError(f"{name} has {len(data)} bytes, the layout {stop - start}")
        at, view = 8 + self.room + start, memoryview(data)
        while view:  # (one write call stops short of 2 GB on Linux)
            done = os.pwrite(self._file.fileno(), view, at)
            view, at = view[done:], at + done
        self.written.add(name)

    def finish(self, metadata: dict[str, str]) -> None:
        if self._file.closed:
            raise SwarmlocoError(f"{self.path} was aborted")
        missing = sorted(set(self.header) - self.written)
        if missing:
            raise SwarmlocoError(f"{len(missing)} tensors were not written: {missing[:3]}...")
        header = self._header_bytes(metadata)
        header += b" " * (self.room - len(header))
        os.pwrite(self._file.fileno(), len(header).to_bytes(8, "little") + header, 0)
        self._file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Close and remove the temporary file (the export failed)."""
        if not self._file.closed:
            self._file.close()
            self.tmp.unlink(missing_ok=True)


def _saver(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Callable[[Path], None]:
    return lambda path: save_file(tensors, str(path), metadata=metadata)


def _llama_model(manifest: SwarmManifest) -> dict[str, Any]:
    """The Llama's config as the manifest's model holds it (without the pipeline's part)."""
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    model = {k: v for k, v in manifest.model.items() if k in fields}
    return dataclasses.asdict(from_mapping(LlamaConfig, model))


def _llama_config(model: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of the exported Llama: untied, whatever the run's config said (cut
    apart, the last stage trained a head of its own)."""
    from swarmloco.train.llama import hf_config

    config = from_mapping(LlamaConfig, model)
    return hf_config(dataclasses.replace(config, tie_embeddings=False))
