"""`swarmloco simulate`: N DiLoCo workers in one process, and the synchronous baseline.

No network: the workers take turns on this machine, and the exchange is computed with the
same codec and the same arithmetic as the real all-reduce (each worker's update quantized,
the reducer's weighted sum re-quantized, every worker using the decoded mean). It answers
"does this configuration learn, and how close does it get to data-parallel training at equal
tokens?" before anything touches a network.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch

from swarmloco.core.codec import (
    CodecConfig,
    ErrorFeedback,
    dequantize,
    dequantize_accumulate_,
    quantize,
)
from swarmloco.core.config import require, require_int
from swarmloco.core.flat import FlatLayout
from swarmloco.core.fragments import FragmentSchedule, assign_fragments
from swarmloco.core.outer import OuterOptimizer
from swarmloco.progress import Progress
from swarmloco.train.data import BatchStream, TokenData, eval_windows
from swarmloco.train.inner import InnerLoop, evaluate
from swarmloco.train.spec import DataSpec
from swarmloco.train.tasks import RunConfig, Task

Exchange = Literal["int8", "fp32"]
SYNC_WORKER_ID = 1_000_000  # the baseline's data stream, apart from every worker's


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """How long and how wide a simulation runs."""

    workers: int = 4
    """Number of DiLoCo workers (the baseline uses this many times the batch)."""
    steps: int = 300
    """Inner steps per worker (the baseline takes as many steps, each N times larger)."""
    exchange: Exchange = "int8"
    """How pseudo-gradients travel: int8 (the codec) or fp32 (exact mean)."""
    eval_every: int = 50
    """Evaluate the global model every this many steps (and at the end)."""
    device: str = "cpu"
    """Where the workers train (cpu, cuda, cuda:1, ...)."""

    def __post_init__(self) -> None:
        require_int("workers", self.workers, minimum=1)
        require_int("steps", self.steps, minimum=1)
        require(
            self.exchange in ("int8", "fp32"),
            f"exchange must be int8 or fp32, got {self.exchange!r}",
        )
        require_int("eval_every", self.eval_every, minimum=1)


@dataclasses.dataclass
class ArmResult:
    """What one arm of a simulation measured."""

    name: str
    final_eval_loss: float
    eval_curve: list[tuple[int, float]]
    final_train_loss: float
    tokens: int
    seconds: float
    outer_rounds: int = 0
    bytes_per_worker: int = 0

    def summary(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for _, p in model.named_parameters()]


def exchange_mean(
    deltas: list[torch.Tensor],
    weights: list[float],
    how: Exchange,
    codec: CodecConfig,
    feedback: list[ErrorFeedback] | None = None,
) -> torch.Tensor:
    """The weighted mean the all-reduce would deliver for these block-aligned updates."""
    total = sum(weights)
    if how == "fp32":
        mean = torch.zeros_like(deltas[0])
        for d, w in zip(deltas, weights, strict=True):
            mean.add_(d, alpha=w / total)
        return mean
    acc = torch.zeros_like(deltas[0])
    for i, (d, w) in enumerate(zip(deltas, weights, strict=True)):
        q, s = feedback[i].encode(d) if feedback else quantize(d, codec)
        dequantize_accumulate_(acc, q, s, w / total, codec)
    q, s = quantize(acc, codec)
    return dequantize(q, s, codec.block_size, codec.backend)


def run_diloco(
    task: Task,
    model_config: dict[str, Any],
    data: TokenData,
    run: RunConfig,
    sim: SimulationConfig,
    *,
    label: str = "diloco",
    progress: bool = True,
) -> ArmResult:
    """N workers, inner AdamW, outer Nesterov on fragments per the streaming schedule."""
    device = torch.device(sim.device)
    torch.manual_seed(run.seed)
    template = task.build_model(model_config)
    names = [n for n, _ in template.named_parameters()]
    shapes = [(n, tuple(p.shape)) for n, p in template.named_parameters()]
    fragment_of = assign_fragments([task.layer_unit(n) for n in names], run.streaming.fragments)
    layout = FlatLayout(shapes, fragment_of, run.codec.block_size)
    theta_g = layout.gather(_params(template), layout.zeros())
    outer = [OuterOptimizer(b - a, run.outer) for a, b in layout.fragment_ranges]
    schedule = FragmentSchedule(run.streaming)
    seq_len = int(model_config["seq_len"])
    workers = [InnerLoop(copy.deepcopy(template), run.inner, device) for _ in range(sim.workers)]
    streams: list[Iterator[tuple[torch.Tensor, torch.Tensor]]] = [
        iter(
            BatchStream(
                data.train,
                seq_len=seq_len,
                batch_size=run.inner.batch_size,
                vocab_size=data.vocab_size,
                seed=run.seed,
                worker=i,
            )
        )
        for i in range(sim.workers)
    ]
    feedback = None
    if sim.exchange == "int8" and run.codec.error_feedback:
        feedback = [
            [ErrorFeedback(b - a, run.codec) for _ in workers] for a, b in layout.fragment_ranges
        ]
    evalset = eval_windows(data.val, seq_len=seq_len, count=_eval_count(data, run))
    eval_model = copy.deepcopy(template).to(device)

    def eval_global() -> float:
        layout.scatter(theta_g, _params(eval_model))
        return evaluate(eval_model, evalset, device, workers[0].amp_dtype)

    scratch = [layout.zeros() for _ in workers]
    last_start = [0] * layout.num_fragments
    rounds = 0
    wire = 0

    def sync(fragment: int) -> None:
        nonlocal rounds, wire
        g = layout.fragment(theta_g, fragment)
        deltas = []
        for w, buf in zip(workers, scratch, strict=True):
            layout.gather(_params(w.model), buf, fragment)
            local = layout.fragment(buf, fragment)
            torch.sub(g, local, out=local)  # delta = theta_g - theta (DiLoCo, Alg. 1)
            deltas.append(local)
        weights = [1.0] * len(workers)  # equal tokens per worker in a simulation
        mean = exchange_mean(
            deltas, weights, sim.exchange, run.codec, feedback[fragment] if feedback else None
        )
        outer[fragment].step(g, mean)
        rounds += 1
        wire += run.codec.wire_bytes(g.numel()) if sim.exchange == "int8" else 4 * g.numel()

    def land(fragment: int) -> None:
        for w in workers:
            layout.lerp_into(theta_g, _params(w.model), run.streaming.alpha, fragment)

    curve: list[tuple[int, float]] = [(0, eval_global())]
    bar = Progress(sim.steps, label, enabled=progress)
    started = time.monotonic()
    loss = float("nan")
    for step in range(1, sim.steps + 1):
        loss = sum(w.train_step(s) for w, s in zip(workers, streams, strict=True)) / len(workers)
        for f in schedule.starts_after(step):
            sync(f)
            last_start[f] = step
        for f in schedule.lands_after(step):
            land(f)
        if step % sim.eval_every == 0 and step < sim.steps:
            curve.append((step, eval_global()))
        bar.update(1, loss=loss, eval=curve[-1][1])
    # Finish: sync every fragment that trained since its last sync, so that the global
    # model holds the workers' last steps. A fragment whose exchange is still in flight
    # (started less than tau steps ago) is already in theta_g: syncing it again would count
    # the outer step twice.
    for f in range(layout.num_fragments):
        in_flight = last_start[f] > 0 and last_start[f] + run.streaming.delay > sim.steps
        if last_start[f] < sim.steps and not in_flight:
            sync(f)
    final = eval_global()
    curve.append((sim.steps, final))
    bar.update(0, loss=loss, eval=final)
    bar.close()
    tokens = sim.workers * sim.steps * run.inner.batch_size * run.inner.grad_accum * seq_len
    return ArmResult(
        name=label,
        final_eval_loss=final,
        eval_curve=curve,
        final_train_loss=loss,
        tokens=tokens,
        seconds=time.monotonic() - started,
        outer_rounds=rounds,
        bytes_per_worker=wire,
    )


def run_sync(
    task: Task,
    model_config: dict[str, Any],
    data: TokenData,
    run: RunConfig,
    sim: SimulationConfig,
    *,
    label: str = "sync",
    progress: bool = True,
) -> ArmResult:
    """The data-parallel baseline: one model, N times the batch, as many steps."""
    device = torch.device(sim.device)
    torch.manual_seed(run.seed)
    model = task.build_model(model_config)
    inner = dataclasses.replace(run.inner, grad_accum=run.inner.grad_accum * sim.workers)
    loop = InnerLoop(model, inner, device)
    seq_len = int(model_config["seq_len"])
    stream = iter(
        BatchStream(
            data.train,
            seq_len=seq_len,
            batch_size=inner.batch_size,
            vocab_size=data.vocab_size,
            seed=run.seed,
            worker=SYNC_WORKER_ID,
        )
    )
    evalset = eval_windows(data.val, seq_len=seq_len, count=_eval_count(data, run))
    curve: list[tuple[int, float]] = [(0, loop.evaluate(evalset))]
    bar = Progress(sim.steps, label, enabled=progress)
    started = time.monotonic()
    loss = float("nan")
    for step in range(1, sim.steps + 1):
        loss = loop.train_step(stream)
        if step % sim.eval_every == 0 and step < sim.steps:
            curve.append((step, loop.evaluate(evalset)))
        bar.update(1, loss=loss, eval=curve[-1][1])
    final = loop.evaluate(evalset)
    curve.append((sim.steps, final))
    bar.update(0, loss=loss, eval=final)
    bar.close()
    tokens = sim.steps * inner.batch_size * inner.grad_accum * seq_len
    return ArmResult(
        name=label,
        final_eval_loss=final,
        eval_curve=curve,
        final_train_loss=loss,
        tokens=tokens,
        seconds=time.monotonic() - started,
    )


def _eval_count(data: TokenData, run: RunConfig) -> int:
    spec_count = getattr(data, "eval_sequences", None)
    return int(spec_count) if spec_count else DataSpec().eval_sequences
