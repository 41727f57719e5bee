"""The run spec: the hyperparameters every peer of a run shares (the manifest's ``run``).

One flat, frozen dataclass a user fills in (``RunSpec(sync_every=100, outer_lr=0.7)``),
with the nested configs the layers below take as properties. What is each peer's own
choice (the codec's backend) never enters the manifest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from swarmloco.core.aggregate import AggregatorConfig, Method
from swarmloco.core.codec import CodecConfig
from swarmloco.core.config import from_mapping, require, require_int
from swarmloco.core.fragments import StreamingConfig
from swarmloco.core.outer import OuterConfig

_LOCAL_CODEC_FIELDS = {"backend"}  # each peer's own choice: never in a manifest


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What every peer of a run shares: when and how it averages, and for how long."""

    sync_every: int = 50
    """H: inner steps between two syncs of the same fragment."""
    fragments: int = 1
    """F: Streaming DiLoCo fragments, synced at staggered times (1: plain DiLoCo)."""
    delay: int = 0
    """tau: inner steps a fragment's exchange overlaps before its outer step lands."""
    alpha: float = 0.0
    """On landing, local = lerp(global, local, alpha); 0 takes the global value."""
    outer_lr: float = 0.7
    """Outer (Nesterov) learning rate on the averaged pseudo-gradient."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum."""
    nesterov: bool = True
    """Nesterov look-ahead (False: heavy-ball momentum)."""
    codec: CodecConfig = dataclasses.field(default_factory=CodecConfig)
    """How updates are quantized on the wire (int8 blocks; error feedback)."""
    aggregator: AggregatorConfig | None = None
    """How each part's reducer combines the members' updates (mean, trimmed_mean,
    centered_clip); a string names the method with its defaults. None: the run's default,
    chosen when its manifest is made (:meth:`for_run`): the trimmed mean in a public run,
    where anyone may join, and the mean in a private one."""
    seed: int = 0
    """Seed of the initial weights (built-in tasks) and of every peer's data seed."""
    total_steps: int | None = None
    """The run's length in the swarm's inner steps (rounds x H / F); None: no end."""
    total_tokens: int | None = None
    """The run's length in tokens the swarm trained on; None: no end."""

    def __post_init__(self) -> None:
        if isinstance(self.aggregator, str):
            method: Method = self.aggregator  # type: ignore[assignment]
            object.__setattr__(self, "aggregator", AggregatorConfig(method=method))
        require(
            self.aggregator is None or isinstance(self.aggregator, AggregatorConfig),
            f"aggregator must be an AggregatorConfig or a method name, got {self.aggregator!r}",
        )
        require(
            isinstance(self.codec, CodecConfig), f"codec must be a CodecConfig, got {self.codec!r}"
        )
        require_int("seed", self.seed, minimum=0)
        if self.total_steps is not None:
            require_int("total_steps", self.total_steps, minimum=1)
        if self.total_tokens is not None:
            require_int("total_tokens", self.total_tokens, minimum=1)
        # Validated by the configs they make (a bad H, F, tau or alpha says which).
        self.streaming  # noqa: B018
        self.outer  # noqa: B018

    @property
    def streaming(self) -> StreamingConfig:
        return StreamingConfig(
            sync_every=self.sync_every, fragments=self.fragments, delay=self.delay, alpha=self.alpha
        )

    @property
    def outer(self) -> OuterConfig:
        return OuterConfig(lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.nesterov)

    def for_run(self, *, private: bool) -> RunSpec:
        """This spec with the run's default aggregator filled in (see ``aggregator``)."""
        if self.aggregator is not None:
            return self
        method: Method = "mean" if private else "trimmed_mean"
        return dataclasses.replace(self, aggregator=AggregatorConfig(method=method))

    @property
    def averaging_aggregator(self) -> AggregatorConfig:
        """The aggregator rounds use (a spec never made into a manifest: the mean)."""
        return self.aggregator or AggregatorConfig()

    @property
    def steps_per_round(self) -> float:
        """Inner steps of the swarm per round: some fragment syncs every H / F steps."""
        return self.sync_every / self.fragments

    def to_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "codec":
                value = {
                    k: v
                    for k, v in dataclasses.asdict(value).items()
                    if k not in _LOCAL_CODEC_FIELDS
                }
            elif field.name == "aggregator":
                value = dataclasses.asdict(self.averaging_aggregator)
            out[field.name] = value
        return out

    @classmethod
    def from_manifest(cls, values: Mapping[str, Any]) -> RunSpec:
        """The spec of a manifest's ``run`` mapping (unknown keys: ValueError)."""
        parsed = dict(values)
        if "codec" in parsed:
            parsed["codec"] = from_mapping(CodecConfig, parsed["codec"])
        if isinstance(parsed.get("aggregator"), Mapping):
            parsed["aggregator"] = from_mapping(AggregatorConfig, parsed["aggregator"])
        return from_mapping(cls, parsed)
