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
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from swarmloco.core.aggregate import AggregatorConfig, aggregate
from swarmloco.core.codec import (
    CodecConfig,
    ErrorFeedback,
    dequantize,
    dequantize_accumulate_,
    quantize,
    settle_backend,
)
from swarmloco.core.config import require, require_int
from swarmloco.core.fragments import FragmentSchedule
from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import (
    LayerUnit,
    default_layer_unit,
    parameters_in_order,
    signature_of,
)
from swarmloco.progress import Progress
from swarmloco.train.data import BatchStream, TokenData, eval_windows
from swarmloco.train.diloco import DilocoState
from swarmloco.train.inner import InnerLoop, evaluate, resolve_precision
from swarmloco.train.spec import DataSpec
from swarmloco.train.tasks import RunConfig, Task, build_task_model

Exchange = Literal["int8", "fp32"]
Attack = Literal["huge", "flipped", "steady", "reversed"]
ATTACKS: tuple[Attack, ...] = ("huge", "flipped", "steady", "reversed")
SYNC_WORKER_ID = 1_000_000  # the baseline's data stream, apart from every worker's
WARM_WORKER_ID = 2_000_000  # the shared warm start's stream, seen by no arm after it


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """A synchronous checkpoint that every arm continues from (as the DiLoCo paper's runs
    do): the weights, the AdamW state and the step, so the schedule goes on from there."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    step: int

    def load_into(self, loop: InnerLoop) -> None:
        """Put this state into ``loop`` (its model, optimizer and step)."""
        loop.model.load_state_dict(self.model)
        loop.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        loop.step = self.step


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
    eval_windows: int | None = None
    """Held-out windows the eval loss is the mean of (None: the data spec's default)."""
    liars: int = 0
    """DiLoCo arms: how many workers (the last ones) send ``attack`` instead of their
    update each round. With liars, every round is bounded as a real one is (see
    :func:`lie`)."""
    attack: Attack = "steady"
    """What the liars send: ``huge`` (their update x1e30, declaring its honest norm),
    ``flipped`` (x -1000, declared as it is), ``steady`` (one fixed direction at just
    under the bound, declaring an honest norm) or ``reversed`` (their update reversed and
    stretched to just under the bound, declaring an honest norm: the strongest push
    against training that passes the norm check)."""

    def __post_init__(self) -> None:
        require_int("workers", self.workers, minimum=1)
        require_int("steps", self.steps, minimum=1)
        require_int("liars", self.liars, minimum=0)
        require(self.liars < self.workers, "liars must leave at least one honest worker")
        require(self.attack in ATTACKS, f"attack must be one of {ATTACKS}, got {self.attack!r}")
        if self.eval_windows is not None:
            require_int("eval_windows", self.eval_windows, minimum=1)
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
    final_model: nn.Module | None = dataclasses.field(default=None, repr=False)
    """The model scored last (the global model of a DiLoCo arm), for a closer look."""

    def summary(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "final_model"
        }


def lie(
    deltas: list[torch.Tensor], liars: int, attack: Attack, norm_clip: float
) -> tuple[list[torch.Tensor], list[float]]:
    """What a round of real peers would average when the last ``liars`` members send
    ``attack``: every member declares a norm, the bound is ``norm_clip`` times the lower
    median of the declared norms, an honest update above it is scaled down to it, and a
    liar's update above it is struck by every reducer (``norm_clip`` 0: no bound). Returns
    the updates that count and their weights (1 each; 0 for a struck one)."""
    honest = len(deltas) - liars
    sent = list(deltas[:honest])
    declared = [float(d.double().norm()) for d in deltas]
    for d in deltas[honest:]:
        if attack == "huge":  # declares the norm of its real update
            sent.append(d * 1e30)
        elif attack == "flipped":
            sent.append(d * -1000.0)
        else:
            sent.append(d.clone())  # scaled once the bound is known
    if attack == "flipped":  # declares what it sends; huge and steady liars look honest
        for i in range(honest, len(deltas)):
            declared[i] = float(sent[i].double().norm())
    bound = norm_clip * sorted(declared)[(len(declared) - 1) // 2] if norm_clip else 0.0
    size = 0.999 * (bound if norm_clip else max(declared[:honest]))
    for i in range(honest, len(deltas)):
        if attack == "steady":
            sent[i] = torch.full_like(sent[i], size / sent[i].numel() ** 0.5)
        elif attack == "reversed":
            sent[i] = sent[i] * (-size / max(float(sent[i].double().norm()), 1e-30))
    weights = [1.0] * len(sent)
    if norm_clip:
        for i, update in enumerate(sent):
            norm = declared[i] if i < honest else float(update.double().norm())
            if norm <= bound:
                continue
            if i < honest:
                sent[i] = update * (bound / norm * (1 - 1e-6))
            else:
                weights[i] = 0.0
    return sent, weights


def exchange_mean(
    deltas: list[torch.Tensor],
    weights: list[float],
    how: Exchange,
    codec: CodecConfig,
    feedback: list[ErrorFeedback] | None = None,
    aggregator: AggregatorConfig | None = None,
) -> torch.Tensor:
    """The mean the all-reduce would deliver for these block-aligned updates: weighted, or
    by ``aggregator`` (a robust one combines the decoded updates, as a reducer would).
    A weight of 0 leaves an update out (a member struck from the round)."""
    if any(w == 0.0 for w in weights):
        kept = [i for i, w in enumerate(weights) if w != 0.0]
        deltas = [deltas[i] for i in kept]
        feedback = [feedback[i] for i in kept] if feedback else None
        weights = [weights[i] for i in kept]
    total = sum(weights)
    if aggregator is not None and aggregator.method != "mean":
        decoded = []
        for i, d in enumerate(deltas):
            if how == "fp32":
                decoded.append(d)
                continue
            q, s = feedback[i].encode(d) if feedback else quantize(d, codec)
            decoded.append(dequantize(q, s, codec.block_size, codec.backend))
        mean = aggregate(decoded, weights, aggregator)
        if how == "fp32":
            return mean
        q, s = quantize(mean, codec)
        return dequantize(q, s, codec.block_size, codec.backend)
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


@dataclasses.dataclass
class SimWorker:
    """One simulated peer: its model and one inner step of its own loop (returns the loss)."""

    model: nn.Module
    step: Callable[[], float]


def diloco_arm(
    spec: RunSpec,
    template: nn.Module,
    workers: Sequence[SimWorker],
    evaluate: Callable[[nn.Module], float],
    *,
    steps: int,
    exchange: Exchange = "int8",
    eval_every: int = 50,
    tokens_per_step: int = 1,
    layer_unit: LayerUnit = default_layer_unit,
    label: str = "diloco",
    progress: bool = True,
    liars: int = 0,
    attack: Attack = "steady",
) -> ArmResult:
    """DiLoCo over ``workers`` (each starting from ``template``'s weights): inner steps in
    turn, outer Nesterov on fragments per the streaming schedule, the exchange computed as
    the all-reduce would (``exchange_mean``). The same :class:`DilocoState` and schedule as
    a real peer's; ``evaluate`` scores the global model. ``liars``: the last workers send
    ``attack`` each round instead of their update (:func:`lie`)."""
    outer = _SimulatedOuter(
        spec,
        template,
        workers,
        evaluate,
        exchange=exchange,
        layer_unit=layer_unit,
        liars=liars,
        attack=attack,
    )
    schedule = FragmentSchedule(spec.streaming)
    curve: list[tuple[int, float]] = [(0, outer.evaluate())]
    bar = Progress(steps, label, enabled=progress)
    started = time.monotonic()
    loss = float("nan")
    for step in range(1, steps + 1):
        loss = sum(w.step() for w in workers) / len(workers)
        for f in schedule.starts_after(step):
            outer.start(f, step)
        for f in schedule.lands_after(step):
            outer.land(f)
        if step % eval_every == 0 and step < steps:
            curve.append((step, outer.evaluate()))
        bar.update(1, loss=loss, eval=curve[-1][1])
    outer.finish(steps)
    final = outer.evaluate()
    curve.append((steps, final))
    bar.update(0, loss=loss, eval=final)
    bar.close()
    return ArmResult(
        name=label,
        final_eval_loss=final,
        eval_curve=curve,
        final_train_loss=loss,
        tokens=len(workers) * steps * tokens_per_step,
        seconds=time.monotonic() - started,
        outer_rounds=outer.state.round,
        bytes_per_worker=outer.wire,
        final_model=outer.eval_model,
    )


class _SimulatedOuter:
    """The outer side of a simulated swarm: the global model in the same
    :class:`DilocoState` as a real peer's, each worker's parameters, the exchange as the
    all-reduce would compute it (the last ``liars`` workers sending ``attack``, as
    :func:`lie` says), and the bytes one worker sent."""

    def __init__(
        self,
        spec: RunSpec,
        template: nn.Module,
        workers: Sequence[SimWorker],
        evaluate: Callable[[nn.Module], float],
        *,
        exchange: Exchange,
        layer_unit: LayerUnit,
        liars: int,
        attack: Attack,
    ) -> None:
        signature = signature_of(
            template,
            fragments=spec.fragments,
            block_size=spec.codec.block_size,
            layer_unit=layer_unit,
        )
        layout = signature.layout(spec.codec.block_size)
        self.spec = spec
        self.exchange = exchange
        self.codec = settle_backend(spec.codec, layout.numel)  # as a peer settles it
        self.state = DilocoState(layout, spec.outer, self.codec)
        self.state.set_global(parameters_in_order(template, signature.params))
        self.params = [parameters_in_order(w.model, signature.params) for w in workers]
        self.feedback: list[list[ErrorFeedback]] | None = None
        if exchange == "int8" and self.codec.error_feedback:
            self.feedback = [
                [ErrorFeedback(b - a, self.codec) for _ in workers]
                for a, b in self.state.layout.fragment_ranges
            ]
        self.eval_model = copy.deepcopy(template).to(next(workers[0].model.parameters()).device)
        self._eval_params = parameters_in_order(self.eval_model, signature.params)
        self._evaluate = evaluate
        self._scratch = [self.state.layout.zeros() for _ in workers]
        self._last_start = [0] * self.state.fragments
        self._liars = liars
        self._attack = attack
        self.wire = 0

    def evaluate(self) -> float:
        """The global model's score."""
        self.state.layout.scatter(self.state.theta_g, self._eval_params)
        return self._evaluate(self.eval_model)

    def start(self, fragment: int, step: int) -> None:
        """Exchange ``fragment`` after ``step`` and take the outer step on it."""
        self._sync(fragment)
        self._last_start[fragment] = step

    def land(self, fragment: int) -> None:
        """Every worker takes in the global ``fragment`` (mixed by alpha)."""
        for p in self.params:
            self.state.land(fragment, p, self.spec.alpha)

    def finish(self, steps: int) -> None:
        """Sync every fragment that trained since its last sync, so that the global model
        holds the workers' last steps."""
        # A fragment whose exchange is still in flight (started less than tau steps ago) is
        # already in theta_g: syncing it again would count the outer step twice.
        for f in range(self.state.fragments):
            started = self._last_start[f]
            in_flight = started > 0 and started + self.spec.delay > steps
            if started < steps and not in_flight:
                self._sync(f)

    def _sync(self, fragment: int) -> None:
        state = self.state
        deltas = [
            state.delta(fragment, p, out=state.layout.fragment(buf, fragment))
            for p, buf in zip(self.params, self._scratch, strict=True)
        ]
        weights = [1.0] * len(self.params)  # equal tokens per worker in a simulation
        if self._liars:
            aggregator = self.spec.averaging_aggregator or AggregatorConfig()
            deltas, weights = lie(deltas, self._liars, self._attack, aggregator.norm_clip)
        mean = exchange_mean(
            deltas,
            weights,
            self.exchange,
            self.codec,
            self.feedback[fragment] if self.feedback else None,
            aggregator=self.spec.averaging_aggregator,
        )
        state.apply(fragment, state.round + 1, mean)
        n = mean.numel()
        self.wire += self.codec.wire_bytes(n) if self.exchange == "int8" else 4 * n


def sync_arm(
    model: nn.Module,
    step: Callable[[], float],
    evaluate: Callable[[nn.Module], float],
    *,
    steps: int,
    eval_every: int = 50,
    tokens: int = 0,
    label: str = "sync",
    progress: bool = True,
) -> ArmResult:
    """The data-parallel baseline: ``step`` takes one step of N workers' batches."""
    curve: list[tuple[int, float]] = [(0, evaluate(model))]
    bar = Progress(steps, label, enabled=progress)
    started = time.monotonic()
    loss = float("nan")
    for i in range(1, steps + 1):
        loss = step()
        if i % eval_every == 0 and i < steps:
            curve.append((i, evaluate(model)))
        bar.update(1, loss=loss, eval=curve[-1][1])
    final = evaluate(model)
    curve.append((steps, final))
    bar.update(0, loss=loss, eval=final)
    bar.close()
    return ArmResult(
        name=label,
        final_eval_loss=final,
        eval_curve=curve,
        final_train_loss=loss,
        tokens=tokens,
        seconds=time.monotonic() - started,
        final_model=model,
    )


def run_diloco(
    task: Task,
    model_config: dict[str, Any],
    data: TokenData,
    run: RunConfig,
    sim: SimulationConfig,
    *,
    label: str = "diloco",
    progress: bool = True,
    start: WarmStart | None = None,
) -> ArmResult:
    """A built-in task's DiLoCo arm: N workers with the task's AdamW loop and data. With
    ``start``, every worker (and the global model) begins at that checkpoint and the arm
    runs the schedule's remaining ``sim.steps - start.step`` steps."""
    device = torch.device(sim.device)
    template = build_task_model(task, model_config, run)
    if start is not None:
        template.load_state_dict(start.model)
    seq_len = int(model_config["seq_len"])
    workers = []
    for i in range(sim.workers):
        loop = InnerLoop(copy.deepcopy(template), run.inner, device)
        if start is not None:
            start.load_into(loop)
        stream = iter(
            BatchStream(
                data.train,
                seq_len=seq_len,
                batch_size=run.inner.batch_size,
                vocab_size=data.vocab_size,
                seed=run.spec.seed,
                worker=i,
            )
        )
        workers.append(SimWorker(loop.model, functools.partial(loop.train_step, stream)))
    evalset = eval_windows(data.val, seq_len=seq_len, count=_eval_count(data, sim))
    amp = resolve_precision(run.inner.precision, device)
    return diloco_arm(
        run.spec,
        template,
        workers,
        lambda m: evaluate(m, evalset, device, amp),
        steps=sim.steps - (start.step if start is not None else 0),
        exchange=sim.exchange,
        eval_every=sim.eval_every,
        tokens_per_step=run.inner.batch_size * run.inner.grad_accum * seq_len,
        layer_unit=task.layer_unit,
        label=label,
        progress=progress,
        liars=sim.liars,
        attack=sim.attack,
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
    start: WarmStart | None = None,
) -> ArmResult:
    """A built-in task's data-parallel baseline: one model, N times the batch (from
    ``start`` when given, for the schedule's remaining steps)."""
    loop, stream = _sync_loop(task, model_config, data, run, sim, SYNC_WORKER_ID)
    if start is not None:
        start.load_into(loop)
    steps = sim.steps - loop.step
    inner = loop.config
    seq_len = int(model_config["seq_len"])
    evalset = eval_windows(data.val, seq_len=seq_len, count=_eval_count(data, sim))
    return sync_arm(
        loop.model,
        functools.partial(loop.train_step, stream),
        lambda m: evaluate(m, evalset, loop.device, loop.amp_dtype),
        steps=steps,
        eval_every=sim.eval_every,
        tokens=steps * inner.batch_size * inner.grad_accum * seq_len,
        label=label,
        progress=progress,
    )


def warm_start(
    task: Task,
    model_config: dict[str, Any],
    data: TokenData,
    run: RunConfig,
    sim: SimulationConfig,
    steps: int,
    *,
    progress: bool = True,
) -> WarmStart:
    """The first ``steps`` of the synchronous baseline (N times the batch, a data stream
    no arm uses afterwards): the checkpoint every arm of a warm-started comparison
    continues from."""
    require_int("steps", steps, minimum=1)
    require(steps < sim.steps, f"a warm start of {steps} steps leaves nothing of {sim.steps}")
    loop, stream = _sync_loop(task, model_config, data, run, sim, WARM_WORKER_ID)
    bar = Progress(steps, "warm start", enabled=progress)
    for _ in range(steps):
        bar.update(1, loss=loop.train_step(stream))
    bar.close()
    return WarmStart(
        model={k: v.detach().clone() for k, v in loop.model.state_dict().items()},
        optimizer=copy.deepcopy(loop.optimizer.state_dict()),
        step=loop.step,
    )


def _sync_loop(
    task: Task,
    model_config: dict[str, Any],
    data: TokenData,
    run: RunConfig,
    sim: SimulationConfig,
    worker: int,
) -> tuple[InnerLoop, Any]:
    """The baseline's loop (one model, N times the batch) and data stream ``worker``."""
    model = build_task_model(task, model_config, run)
    inner = dataclasses.replace(run.inner, grad_accum=run.inner.grad_accum * sim.workers)
    loop = InnerLoop(model, inner, torch.device(sim.device))
    stream = iter(
        BatchStream(
            data.train,
            seq_len=int(model_config["seq_len"]),
            batch_size=inner.batch_size,
            vocab_size=data.vocab_size,
            seed=run.spec.seed,
            worker=worker,
        )
    )
    return loop, stream


def _eval_count(data: TokenData, sim: SimulationConfig) -> int:
    if sim.eval_windows is not None:
        return sim.eval_windows
    spec_count = getattr(data, "eval_sequences", None)
    return int(spec_count) if spec_count else DataSpec().eval_sequences


# --------------------------------------------------------------------------- any model


@dataclasses.dataclass
class SimulationResult:
    """What :func:`simulate` measured: the DiLoCo arm and (optionally) the baseline."""

    diloco: ArmResult
    sync: ArmResult | None

    @property
    def diloco_over_sync(self) -> float | None:
        """DiLoCo's final eval loss over the synchronous baseline's (1.0: as good)."""
        if self.sync is None:
            return None
        return self.diloco.final_eval_loss / self.sync.final_eval_loss

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"diloco": self.diloco.summary()}
        if self.sync is not None:
            out["sync"] = self.sync.summary()
            out["diloco_over_sync"] = self.diloco_over_sync
        return out


def simulate(
    spec: RunSpec,
    *,
    model: Callable[[], nn.Module],
    optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    batches: Callable[[int], Iterable[Any]],
    evaluate: Callable[[nn.Module], float],
    workers: int = 4,
    steps: int = 300,
    exchange: Exchange = "int8",
    eval_every: int = 50,
    baseline: bool = True,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    grad_clip: float = 0.0,
    layer_unit: LayerUnit = default_layer_unit,
    progress: bool = False,
) -> SimulationResult:
    """Simulate a run of ``spec`` on your own model before going live: ``workers`` peers in
    this process, each with its own optimizer and data, averaging exactly as a swarm
    would; and the synchronous baseline (one model, each step on ``workers`` batches) at
    equal tokens. Tune H (``sync_every``) and the outer learning rate here.

    ``model()``: a new model (called once, after ``torch.manual_seed(spec.seed)``; every
    worker starts from a copy). ``optimizer(model)``: its optimizer. ``loss(model,
    batch)``: the loss of a batch (the simulator runs backward and the step).
    ``batches(i)``: data stream ``i`` (workers use 0..N-1, the baseline N..2N-1).
    ``evaluate(model)``: the held-out loss. ``scheduler(optimizer)``: an LR scheduler,
    stepped after each optimizer step. ``grad_clip``: clip the gradient norm (0: not).
    """
    require_int("workers", workers, minimum=1)
    require_int("steps", steps, minimum=1)
    torch.manual_seed(spec.seed)
    template = model()

    stepper = functools.partial(
        _stepper, optimizer=optimizer, loss=loss, scheduler=scheduler, grad_clip=grad_clip
    )
    sims = []
    for i in range(workers):
        net = copy.deepcopy(template)
        sims.append(SimWorker(net, stepper(net, [iter(batches(i))])))
    diloco = diloco_arm(
        spec,
        template,
        sims,
        evaluate,
        steps=steps,
        exchange=exchange,
        eval_every=eval_every,
        layer_unit=layer_unit,
        label=f"diloco-{exchange}",
        progress=progress,
    )
    sync = None
    if baseline:
        net = copy.deepcopy(template)
        streams = [iter(batches(workers + i)) for i in range(workers)]
        sync = sync_arm(
            net,
            stepper(net, streams),
            evaluate,
            steps=steps,
            eval_every=eval_every,
            tokens=steps * workers,
            progress=progress,
        )
    return SimulationResult(diloco, sync)


def _stepper(
    net: nn.Module,
    streams: list[Any],
    *,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    scheduler: Callable[[torch.optim.Optimizer], Any] | None,
    grad_clip: float,
) -> Callable[[], float]:
    """One optimizer step of ``net`` on a batch of each of ``streams`` (their mean loss),
    with an optimizer and scheduler of its own."""
    opt = optimizer(net)
    sched = scheduler(opt) if scheduler is not None else None

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for stream in streams:
            value = loss(net, next(stream)) / len(streams)
            value.backward()
            total += float(value.detach())
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip)
        opt.step()
        if sched is not None:
            sched.step()
        return total

    return step
