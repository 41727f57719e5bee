"""Tasks: what model a run trains on what data, and the manifest that pins it all down.

The built-in task is ``gpt-bytes``: a small byte-level GPT on the Python standard library's
own source files by default. Other packages can register tasks under the ``swarmloco.tasks``
entry-point group (an object with the :class:`Task` methods), so that every peer of a public
run builds the same model from the manifest alone.

This module imports torch only inside the functions that build models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from swarmloco.core.config import from_mapping
from swarmloco.core.manifest import SwarmManifest, identity_work_for
from swarmloco.core.runspec import RunSpec
from swarmloco.train.inner import InnerConfig
from swarmloco.train.spec import GPT_PRESETS, LLAMA_PRESETS, DataSpec, GPTConfig, LlamaConfig

if TYPE_CHECKING:
    from torch import nn

    from swarmloco.train.data import TokenData

_LOCAL_INNER_FIELDS = {"precision", "compile"}  # each peer's own choices: never in a manifest


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The hyperparameters every peer of a built-in task's run shares: the inner loop (the
    daemon builds each peer's optimizer from it) and the run spec."""

    inner: InnerConfig = dataclasses.field(default_factory=InnerConfig)
    """The local AdamW loop."""
    spec: RunSpec = dataclasses.field(default_factory=RunSpec)
    """When and how the peers average (H, F, tau, alpha, outer step, codec, aggregator),
    the seed, and the run's length."""

    def to_manifest(self) -> dict[str, Any]:
        inner = {
            k: v for k, v in dataclasses.asdict(self.inner).items() if k not in _LOCAL_INNER_FIELDS
        }
        return {"inner": inner, "run": self.spec.to_manifest()}

    @classmethod
    def from_manifest(cls, hparams: Mapping[str, Any]) -> RunConfig:
        unknown = sorted(set(hparams) - {"inner", "run"})
        if unknown:
            raise ValueError(
                f"unknown RunConfig option(s): {', '.join(unknown)}; known options: inner, run"
            )
        return cls(
            inner=from_mapping(InnerConfig, hparams.get("inner", {})),
            spec=RunSpec.from_manifest(hparams.get("run", {})),
        )


class Task(Protocol):
    """What a task provides. Register one under the ``swarmloco.tasks`` entry-point group."""

    name: str

    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        """Named model configs."""
        ...

    def default_run(self, preset: str) -> RunConfig:
        """Sensible hyperparameters for a preset."""
        ...

    def build_model(self, model: Mapping[str, Any]) -> nn.Module:
        """A freshly initialised model (the caller seeds torch first)."""
        ...

    def load_data(self, model: Mapping[str, Any], data: DataSpec) -> TokenData:
        """The token stores of a data spec."""
        ...

    def layer_unit(self, param_name: str) -> str:
        """The layer a parameter belongs to (for strided Streaming DiLoCo fragments)."""
        ...


class GPTBytes:
    """The built-in task: a byte-level GPT; default data is the Python standard library."""

    name = "gpt-bytes"

    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        return {k: dataclasses.asdict(v) for k, v in GPT_PRESETS.items()}

    def default_run(self, preset: str) -> RunConfig:
        # Warmup spans several rounds of H = 50: the first pseudo-gradients then carry no
        # burst of the initial loss drop for outer momentum to keep re-applying (tiny, from
        # scratch, 4 workers: DiLoCo's gap to data-parallel 18.7% with 50, 16.3% with 150).
        if preset == "tiny":
            inner = InnerConfig(lr=3e-3, warmup_steps=150, total_steps=2000, batch_size=16)
        elif preset == "small":
            inner = InnerConfig(lr=6e-4, warmup_steps=200, total_steps=20_000, batch_size=32)
        else:
            inner = InnerConfig(lr=4e-4, warmup_steps=1000, total_steps=100_000, batch_size=16)
        # The run ends where the cosine schedule does.
        return RunConfig(inner=inner, spec=RunSpec(total_steps=inner.total_steps))

    def build_model(self, model: Mapping[str, Any]) -> nn.Module:
        from swarmloco.train.model import GPT

        return GPT(from_mapping(GPTConfig, model))

    def load_data(self, model: Mapping[str, Any], data: DataSpec) -> TokenData:
        from swarmloco.train.data import load_tokens

        return load_tokens(data, vocab_size=int(model["vocab_size"]))

    def layer_unit(self, param_name: str) -> str:
        from swarmloco.train.model import layer_unit

        return layer_unit(param_name)


class Llama:
    """The Llama architecture (presets with published models' shapes); exports load in
    Hugging Face transformers."""

    name = "llama"

    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        return {k: dataclasses.asdict(v) for k, v in LLAMA_PRESETS.items()}

    def default_run(self, preset: str) -> RunConfig:
        if preset == "tiny":
            inner = InnerConfig(lr=3e-3, warmup_steps=150, total_steps=2000, batch_size=16)
            return RunConfig(inner=inner, spec=RunSpec(total_steps=inner.total_steps))
        # Rounds of H = 500 (DiLoCo's), a warmup of two rounds; the learning rates of
        # models of these sizes (SmolLM2, TinyLlama), with sequences of the preset's length.
        lr, batch = {"20m": (1e-3, 16), "135m": (6e-4, 16), "360m": (4e-4, 16)}.get(
            preset, (3e-4, 8)
        )
        inner = InnerConfig(lr=lr, warmup_steps=1000, total_steps=100_000, batch_size=batch)
        return RunConfig(inner=inner, spec=RunSpec(sync_every=500, total_steps=100_000))

    def build_model(self, model: Mapping[str, Any]) -> nn.Module:
        from swarmloco.train.llama import Llama as LlamaModel

        return LlamaModel(from_mapping(LlamaConfig, model))

    def load_data(self, model: Mapping[str, Any], data: DataSpec) -> TokenData:
        from swarmloco.train.data import load_tokens

        return load_tokens(data, vocab_size=int(model["vocab_size"]))

    def layer_unit(self, param_name: str) -> str:
        from swarmloco.train.llama import layer_unit

        return layer_unit(param_name)

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        """The Hugging Face ``config.json`` of the model (``swarmloco export`` writes it)."""
        from swarmloco.train.llama import hf_config

        return hf_config(from_mapping(LlamaConfig, model))


_BUILTIN: dict[str, Task] = {GPTBytes.name: GPTBytes(), Llama.name: Llama()}
_CONFIGS: dict[str, type[GPTConfig] | type[LlamaConfig]] = {
    GPTBytes.name: GPTConfig,
    Llama.name: LlamaConfig,
}


def model_config(task: str, model: Mapping[str, Any]) -> GPTConfig | LlamaConfig | None:
    """A built-in task's model config, checked (None for a task of another package)."""
    config = _CONFIGS.get(task)
    return from_mapping(config, model) if config is not None else None


def _count(n: float) -> str:
    """1,234 -> "1.2K", 837,888 -> "0.84M", 128,441,856 -> "128M"."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= 0.5 * size:
            value = n / size
            return f"{value:.2g}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(int(n))


def _rounds(spec: RunSpec) -> str:
    if spec.total_steps is None:
        return "no end (until stopped)"
    rounds = spec.total_steps / spec.steps_per_round
    return f"{spec.total_steps:,} steps, {rounds:,.0f} rounds"


def describe_tasks() -> str:
    """The built-in tasks' presets and what each picks, for ``swarmloco create --help``
    (imports torch: only when the help is asked for)."""
    lines = ["tasks and presets (--task, --preset; the options above override each value):"]
    for name, task in _BUILTIN.items():
        lines.append(f"  {name}: {(type(task).__doc__ or '').strip().splitlines()[0]}")
        for preset, model in task.presets().items():
            config = model_config(name, model)
            assert config is not None
            run = task.default_run(preset)
            inner, spec = run.inner, run.spec
            lines.append(
                f"    {preset:<6} {_count(config.parameters)} parameters ({config.n_layer} "
                f"layers, {config.n_embd} wide, {config.seq_len} tokens of context); "
                f"H={spec.sync_every}, batch {inner.batch_size}, lr {inner.lr:g} "
                f"(warmup {inner.warmup_steps}), {_rounds(spec)}"
            )
    others = sorted({ep.name for ep in entry_points(group="swarmloco.tasks")} - set(_BUILTIN))
    if others:
        lines.append(f"  installed: {', '.join(others)} (their presets: their own docs)")
    return "\n".join(lines)


def describe_manifest(manifest: SwarmManifest, parameters: int | None = None) -> str:
    """A few lines saying what a run trains and how, for ``swarmloco join --dry-run``
    (``parameters``: the model's size, when the caller knows it)."""
    run = RunConfig.from_manifest(manifest.hparams)
    inner, spec = run.inner, run.spec.for_run(private=manifest.private)
    preset = manifest.model.get("preset")
    model = f"{manifest.task}" + (f", preset {preset}" if preset else "")
    if parameters is not None:
        model += f": {parameters:,} parameters"
    data = manifest.data
    source = data.get("source", "stdlib")
    where = {
        "stdlib": "the Python standard library's .py files (every peer has them)",
        "text": "text files: " + ", ".join(map(str, data.get("paths", []))),
        "tokens": "token files: " + ", ".join(map(str, data.get("paths", []))),
        "dataset": f"dataset {data.get('dataset', '')} (prepared; from "
        + (", ".join(map(str, data.get("mirrors", []))) or "its peers")
        + (" and the peers" if data.get("mirrors") else "")
        + ")",
    }.get(str(source), str(source))
    streaming = (
        f"; {spec.fragments} fragments, each overlapping {spec.delay} steps"
        if spec.fragments > 1
        else ""
    )
    aggregator = spec.averaging_aggregator.method
    joins = (
        "admitted keys only (a private run: `swarmloco admit`)"
        if manifest.private
        else "anyone"
        + (
            f", each key proving {manifest.identity_work} bits of work once"
            if manifest.identity_work
            else ""
        )
    )
    lines = [
        f"swarm {manifest.swarm_id}" + (f" ({manifest.name})" if manifest.name else ""),
        f"  model:   {model}",
        f"  data:    {where}",
        f"  rounds:  every {spec.sync_every} inner steps{streaming}; the run ends after "
        + _rounds(spec),
        f"  inner:   AdamW, lr {inner.lr:g} (warmup {inner.warmup_steps} steps, cosine to "
        f"{inner.min_lr_ratio:g}x), batch {inner.batch_size}",
        f"  outer:   Nesterov, lr {spec.outer_lr:g}, momentum {spec.outer_momentum:g}; "
        f"updates combined by {aggregator}",
        f"  joins:   {joins}",
    ]
    if manifest.created_at:
        lines.append(f"  created: {manifest.created_at}")
    return "\n".join(lines)


def get_task(name: str) -> Task:
    """The task registered as ``name`` (built in, or from the swarmloco.tasks entry points)."""
    if name in _BUILTIN:
        return _BUILTIN[name]
    for ep in entry_points(group="swarmloco.tasks"):
        if ep.name == name:
            loaded = ep.load()
            return loaded() if isinstance(loaded, type) else loaded
    known = sorted(set(_BUILTIN) | {ep.name for ep in entry_points(group="swarmloco.tasks")})
    raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(known)}")


def resolve_model(
    task: Task, preset: str, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    presets = task.presets()
    if preset not in presets:
        raise ValueError(
            f"unknown preset {preset!r} for task {task.name}; presets: {', '.join(presets)}"
        )
    model = dict(presets[preset])
    model.update(overrides or {})
    config = model_config(task.name, model)  # validate
    if config is not None:
        model = dataclasses.asdict(config)
    return model


def build_manifest(
    task: str,
    preset: str,
    *,
    creator: str,
    name: str = "",
    data: DataSpec | None = None,
    run: RunConfig | None = None,
    model_overrides: Mapping[str, Any] | None = None,
    admission: str = "",
    identity_work: int | None = None,
) -> SwarmManifest:
    """The manifest of a new run of ``task`` at ``preset`` (unknown names: ValueError).
    ``admission``: ``certificate`` for a private run (default: a public one).
    ``identity_work``: bits of work each key proves (default: 8 public, 0 private)."""
    t = get_task(task)
    model = resolve_model(t, preset, model_overrides)
    data = data or DataSpec()
    run = run or t.default_run(preset)
    run = dataclasses.replace(run, spec=run.spec.for_run(private=bool(admission)))
    data_dict = dataclasses.asdict(data)
    return SwarmManifest(
        task=t.name,
        model={"preset": preset, **model, "signature": task_signature(t, model, run)},
        data=data_dict,
        hparams=run.to_manifest(),
        creator=creator,
        name=name,
        admission=admission,
        identity_work=identity_work_for(identity_work, private=bool(admission)),
    )


def build_task_model(task: Task, model: Mapping[str, Any], run: RunConfig) -> nn.Module:
    """The task's model with the run's initial weights (every peer builds the same)."""
    import torch

    torch.manual_seed(run.spec.seed)
    return task.build_model(model)


def task_signature(task: Task, model: Mapping[str, Any], run: RunConfig) -> dict[str, Any]:
    """The manifest's model signature of a task's model (see ``core/signature.py``)."""
    from swarmloco.core.signature import signature_of

    signature = signature_of(
        build_task_model(task, model, run),
        fragments=run.spec.fragments,
        block_size=run.spec.codec.block_size,
        layer_unit=task.layer_unit,
    )
    return signature.to_manifest()


def run_from_manifest(manifest: SwarmManifest) -> tuple[Task, dict[str, Any], DataSpec, RunConfig]:
    """Everything a peer needs to train from a manifest: task, model config, data, hparams."""
    task = get_task(manifest.task)
    # (A pipelined run's stages are no part of the model's config: pipeline/manifest.py.)
    model = {
        k: v
        for k, v in manifest.model.items()
        if k not in ("preset", "signature", "pipeline", "stage")
    }
    data_values = dict(manifest.data)
    for key in ("paths", "suffixes", "mirrors"):
        if key in data_values:
            data_values[key] = tuple(data_values[key])
    data = from_mapping(DataSpec, data_values)
    return task, model, data, RunConfig.from_manifest(manifest.hparams)
