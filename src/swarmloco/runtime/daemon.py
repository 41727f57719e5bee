"""The peer daemon: what ``swarmloco create/join`` run for built-in and entry-point tasks.

A short loop over the public :class:`~swarmloco.runtime.swarm.Swarm`, as a user's own
script would be: build the task's model (seeded as every peer does), its AdamW inner loop
and its data stream from the manifest, register what a checkpoint must carry, schedule
the learning rate on the swarm's global step, and train until the peer is asked to stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from swarmloco.core.manifest import SwarmManifest
from swarmloco.dataset.fetch import LazyDataset
from swarmloco.dataset.leases import DealtData, LeasedData, read_batch
from swarmloco.dataset.ledger import Range, Sequences
from swarmloco.errors import SwarmlocoError
from swarmloco.net.identity import Identity
from swarmloco.net.server import Service
from swarmloco.runtime.box import Box, BoxRank
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.swarm import EventSink, Summary, Swarm
from swarmloco.train.data import BatchStream, eval_windows
from swarmloco.train.fit import (
    Fit,
    choose_fit,
    estimate_profile,
    measure_profile,
    peak_bf16_flops,
)
from swarmloco.train.inner import CompileMode, InnerConfig, InnerLoop, Precision, evaluate
from swarmloco.train.spec import DataSpec, GPTConfig, LlamaConfig
from swarmloco.train.tasks import RunConfig, Task, build_task_model, run_from_manifest
from swarmloco.train.tasks import model_config as model_config_of

logger = logging.getLogger(__name__)

IDLE_WAKE_S = 0.5
"""How often a peer with no batch to train looks again (sooner when a shard is leased)."""

_PRECISION_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """How the daemon runs a task's peer: the peer's choices and the inner loop's."""

    peer: PeerConfig
    """The peer (network, rounds, checkpoints, dashboard)."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    compile: CompileMode | None = None
    """Override the inner loop's torch.compile choice (auto, on, off)."""
    precision: Precision | None = None
    """Override the inner loop's precision (auto, fp32, bf16, fp16)."""
    memory_budget_gb: float | None = None
    """Device memory the inner loop may use, in GB: the micro-batch is fitted to it (on
    CUDA by default: the card's memory, measured; elsewhere only when given)."""
    dataset_copies: tuple[Path, ...] = ()
    """Local copies of a pinned dataset (``--dataset DIR``), read before its mirrors."""
    max_epochs: int | None = None
    """On a pinned dataset: leave once this many epochs landed whole (None: go on)."""
    lease_s: float = 60.0
    """On a pinned dataset: how long this peer's leases live unless renewed."""
    lease_idle_s: float = 1800.0
    """On a pinned dataset: how long a shard other peers list may show no work (nothing of
    it landed, no lister averaged with this peer) before this peer reads it
    (``dataset.leases.IDLE_S``)."""
    read_log: Path | None = None
    """On a pinned dataset: append the ranges each batch reads to this file (audits and
    benchmarks: what was trained and never landed)."""

    def __post_init__(self) -> None:
        if self.compile not in (None, "auto", "on", "off"):
            raise ValueError(f"compile must be auto, on or off, got {self.compile!r}")
        if self.precision not in (None, "auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {self.precision!r}")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError(
                f"memory budget must be a positive number of GB, got {self.memory_budget_gb!r}"
            )
        if self.max_epochs is not None and self.max_epochs < 1:
            raise ValueError(f"max epochs must be at least 1, got {self.max_epochs!r}")
        if not self.lease_s >= 4.0:
            raise ValueError(f"a lease lives at least 4 s, got {self.lease_s!r}")
        if not self.lease_idle_s >= 2 * self.lease_s:
            raise ValueError(
                f"a listed shard may idle at least two lease lives ({2 * self.lease_s:g} s) "
                f"before it is read, got {self.lease_idle_s!r}"
            )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name} was asked for, but torch sees no CUDA device")
    return device


class _WithWeights(torch.nn.Module):
    """``module`` called with ``weights`` (by parameter name) in place of its own."""

    def __init__(self, module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.inner = module
        self.weights = weights

    def forward(self, *args: Any) -> Any:
        return torch.func.functional_call(self.inner, self.weights, args)


class _LoopState:
    """The inner loop's own state (loss scale, step) for the swarm's checkpoints; the
    optimizer's the swarm checkpoints itself."""

    def __init__(self, loop: InnerLoop) -> None:
        self.loop = loop

    def state_dict(self) -> dict[str, Any]:
        return self.loop.loop_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loop.load_loop_state_dict(state)


def train_task(
    manifest: SwarmManifest | None,
    config: DaemonConfig,
    *,
    identity: Identity | None,
    on_event: EventSink | None = None,
    box: Box | None = None,
) -> Summary | None:
    """Train as a peer of ``manifest``'s task until stopped, the run's end or max rounds.

    In a ``box`` of several ranks (data parallel: DDP), rank 0 passes the manifest and its
    identity and is the peer; the other ranks pass None for both, get the manifest from
    rank 0, train the same loop on their own data, and return None."""
    manifest, box = _shared_manifest(manifest, box)
    task, model_config, data_spec, run = _task_of(manifest)
    inner = _own_choices(run.inner, config)
    device = resolve_device(config.device)
    if box is not None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU
    # The module itself, whatever wraps it for training.
    plain_model = build_task_model(task, model_config, run)
    loop = InnerLoop(_for_training(plain_model, device, box), inner, device)
    seq_len = int(model_config["seq_len"])
    fit = None
    if box is None and (device.type == "cuda" or config.memory_budget_gb is not None):
        fit = fit_batch(loop, model_config, device, config.memory_budget_gb)
        inner = loop.config
    services: list[Service] = []  # more the peer's server carries
    with contextlib.ExitStack() as stack:
        leased: LeasedData | None = None
        dealt: DealtData | None = None
        if data_spec.source == "dataset":
            val_fraction = data_spec.val_fraction
            vocab = int(model_config["vocab_size"])
            data_spec, server, lazy = pinned_dataset(
                stack, manifest.swarm_id, data_spec, config, vocab, box
            )
            services.append(server.service())
            sequences = dataset_sequences(lazy, seq_len, val_fraction)
            if box is None or box.leader:  # rank 0 leases for the box
                leased = leased_data(sequences, vocab, config, run, inner.batch_size)
            else:
                dealt = DealtData(sequences, vocab_size=vocab)
        data = task.load_data(model_config, data_spec)
        evalset = eval_windows(data.val, seq_len=seq_len, count=data_spec.eval_sequences)
        ranks = box.size if box is not None else 1
        peer = dataclasses.replace(
            config.peer, tokens_per_step=ranks * inner.batch_size * inner.grad_accum * seq_len
        )

        def evaluate_global() -> float:
            # The training model's modules with the global weights in place of its own: no
            # eval copy of the model (on a GPU, the weights visit it for the evaluation).
            assert isinstance(swarm, Swarm)
            weights = {k: v.to(device) for k, v in swarm.global_parameters().items()}
            # In micro-batches of training's size: what fits the device's memory for a step
            # fits an evaluation (a batch of 32 at 2,048 tokens is 13 GB of logits at 135M).
            return evaluate(
                _WithWeights(plain_model, weights),
                evalset,
                device,
                loop.amp_dtype,
                batch_size=loop.config.batch_size,
            )

        swarm, data_seed = _peer(
            manifest,
            loop,
            peer,
            box,
            identity=identity,
            on_event=_telling_ready(on_event, _how_it_trains(loop, inner, device, fit)),
            evaluate=evaluate_global,
            services=services,
            ranges=leased,
        )
        stream: BatchStream | LeasedData | DealtData
        if leased is not None:
            stream = leased
            leased.stop_peer = swarm.stop
            if isinstance(swarm, Swarm):
                swarm.sheet.data = leased.progress
        elif dealt is not None:
            stream = dealt
        else:
            stream = BatchStream(
                data.train,
                seq_len=seq_len,
                batch_size=inner.batch_size,
                vocab_size=data.vocab_size,
                seed=run.spec.seed,
                worker=data_seed,
            )
        if isinstance(swarm, Swarm):
            _describe_compute(swarm, model_config_of(task.name, model_config), fit, device, loop)
        swarm.register("inner", _LoopState(loop))
        swarm.register("data", stream)
        loop.lr_step = lambda: swarm.global_step  # the learning rate follows the swarm
        swarm.lr_at = inner.lr_at  # and the swarm knows the schedule (to judge downloads)
        _train(swarm, loop, stream, box)
        return swarm.summary if isinstance(swarm, Swarm) else None


def pinned_dataset(
    stack: contextlib.ExitStack,
    swarm_id: str,
    spec: DataSpec,
    config: DaemonConfig,
    vocab_size: int,
    box: Box | None = None,
) -> tuple[DataSpec, Any, LazyDataset]:
    """The run's pinned dataset on this peer, as the task reads it (``dataset/fetch.py``:
    from its copies, the swarm's peers, the mirrors); the server of this peer's dataset
    files to the others (``dataset/peers.py``; the peers of ``swarm_id`` serve them to
    each other); and the dataset whose shards it fetches as
    it leases them (the first few at once: the evaluation set's; ``dataset/leases.py``).
    In a box, rank 0 leases and fetches for the box, into the cache its ranks share: the
    others start once it has the first shards, and find each shard it deals them there
    (fetched from the copies and mirrors only if it is not)."""
    from swarmloco.dataset.peers import FileServer, holdings_in
    from swarmloco.net.rejections import RejectionLog

    cache = config.peer.directory / "datasets"
    server = FileServer(holdings_in(config.dataset_copies, cache), rejections=RejectionLog(logger))
    follower = box is not None and not box.leader
    lazy = LazyDataset(
        spec,
        cache,
        config.dataset_copies,
        peers=() if follower else config.peer.node.peers,
        swarm_id=swarm_id,
        vocab_size=vocab_size,
    )
    if follower:
        assert box is not None
        box.share()  # rank 0 has the index and the first shards in the cache
    stack.enter_context(lazy)
    tokens, _ = lazy.start()
    if box is not None and box.leader:
        box.share(True)
    return tokens, server, lazy


def dataset_sequences(lazy: LazyDataset, seq_len: int, val_fraction: float) -> Sequences:
    """The training sequences of the pinned dataset, each shard fetched when first read."""
    index = lazy.cache.index()
    return Sequences(
        seq_len=seq_len,
        val_fraction=val_fraction,
        tokens=[s.tokens for s in index.shards],
        opener=lazy.shard_tokens,
    )


def leased_data(
    sequences: Sequences,
    vocab_size: int,
    config: DaemonConfig,
    run: RunConfig,
    batch_size: int,
) -> LeasedData:
    """The reader of a pinned dataset's shards through leases, every sequence landing once
    (``dataset/leases.py``)."""
    return LeasedData(
        sequences,
        batch_size=batch_size,
        vocab_size=vocab_size,
        seed=run.spec.seed,
        fragments=run.spec.fragments,
        audit=config.peer.directory / "audit.jsonl",
        max_epochs=config.max_epochs,
        lease_s=config.lease_s,
        idle_s=config.lease_idle_s,
        read_log=config.read_log,
    )


def _shared_manifest(
    manifest: SwarmManifest | None, box: Box | None
) -> tuple[SwarmManifest, Box | None]:
    """The manifest every rank of a box of several trains (rank 0's), and the box; a box
    of one rank is no box."""
    if box is not None and box.size > 1:
        shared = box.share(manifest.to_bytes() if box.leader and manifest else None)
        manifest = SwarmManifest.from_bytes(shared)
    else:
        box = None
    assert manifest is not None
    return manifest, box


def _task_of(manifest: SwarmManifest) -> tuple[Task, dict[str, Any], DataSpec, RunConfig]:
    """The registered task ``manifest`` trains, with its model, data and run."""
    try:
        return run_from_manifest(manifest)
    except ValueError as exc:
        if manifest.task == "custom":
            raise SwarmlocoError(
                f"swarm {manifest.swarm_id} trains a model defined in its creator's own script, "
                "not a registered task: join it from that script (swarmloco.join)"
            ) from exc
        raise


def _own_choices(inner: InnerConfig, config: DaemonConfig) -> InnerConfig:
    """The run's inner loop with this peer's own choices of compile and precision."""
    if config.compile is not None:
        inner = dataclasses.replace(inner, compile=config.compile)
    if config.precision is not None:
        inner = dataclasses.replace(inner, precision=config.precision)
    return inner


def _for_training(model: torch.nn.Module, device: torch.device, box: Box | None) -> torch.nn.Module:
    """``model`` as it trains: itself, or wrapped in DDP across the ranks of ``box``."""
    if box is None:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model.to(device), device_ids=[device.index] if device.type == "cuda" else None
    )


def _peer(
    manifest: SwarmManifest,
    loop: InnerLoop,
    peer: PeerConfig,
    box: Box | None,
    *,
    identity: Identity | None,
    on_event: EventSink,
    evaluate: Callable[[], float],
    services: Sequence[Service] = (),
    ranges: LeasedData | None = None,
) -> tuple[Swarm | BoxRank, int]:
    """This rank's side of the peer and the worker id of its data stream: rank 0 (or a
    peer alone) is the :class:`Swarm`, the other ranks of a box follow it; in a box, each
    rank reads a stream of its own."""
    swarm: Swarm | BoxRank
    if box is None or box.leader:
        assert identity is not None
        swarm = Swarm(
            manifest,
            loop.model,
            loop.optimizer,
            peer,
            identity=identity,
            on_event=on_event,
            evaluate=evaluate,
            box=box,
            services=services,
            ranges=ranges,
        )
        data_seed = swarm.data_seed
    else:
        swarm = BoxRank(box, loop.model, loop.optimizer)
        data_seed = 0
    if box is not None:
        data_seed = box.share(data_seed) + box.rank  # each rank a stream of its own
    return swarm, data_seed


def _how_it_trains(
    loop: InnerLoop, inner: InnerConfig, device: torch.device, fit: Fit | None
) -> dict[str, Any]:
    """What the ``ready`` event tells of this peer's training: precision, device, whether
    it runs compiled, the micro-batch and accumulation, activation checkpointing."""
    return {
        "precision": _PRECISION_NAMES[loop.amp_dtype],
        "device": str(device),
        "compiled": loop.compiled,
        "micro_batch": inner.batch_size,
        "grad_accum": inner.grad_accum,
        "checkpointing": bool(fit and fit.checkpointing),
    }


def _telling_ready(on_event: EventSink | None, ready: dict[str, Any]) -> EventSink:
    """``on_event`` with the ``ready`` event also telling how this peer trains."""

    def events(event: dict[str, Any]) -> None:
        if event["event"] == "ready":
            event.update(ready)
        if on_event is not None:
            on_event(event)

    return events


def _describe_compute(
    swarm: Swarm,
    shape: GPTConfig | LlamaConfig | None,
    fit: Fit | None,
    device: torch.device,
    loop: InnerLoop,
) -> None:
    """Tell the swarm how this peer's step is fitted and what it computes (for its MFU)."""
    swarm.describe_compute(
        fit=fit.short() if fit is not None else "",
        flops_per_token=shape.flops_per_token() if shape is not None else None,
        peak_flops=peak_bf16_flops(device) if loop.amp_dtype is not None else None,
    )


def _train(
    swarm: Swarm | BoxRank,
    loop: InnerLoop,
    stream: BatchStream | LeasedData | DealtData,
    box: Box | None,
) -> None:
    """Train until the peer is asked to stop; a step that meets NaN/Inf is discarded (by
    every rank of a box, or none). On leased shards, while no batch is to be had (every
    shard left leased by others) the peer idles: the round in flight lands, the swarm's
    work goes on. In a box on leased shards, rank 0 deals each rank its ranges before
    each step (the others wait for them, serving rank 0 while it idles)."""
    accum = loop.config.grad_accum
    batches = iter(stream) if isinstance(stream, BatchStream) else iter(())
    with swarm:
        while not swarm.stopping:
            if isinstance(stream, LeasedData):
                assert isinstance(swarm, Swarm)
                ranks = box.size if box is not None else 1
                if not stream.ready(accum * ranks):
                    swarm.idle(flush=stream.exhausted)
                    stream.changed.wait(IDLE_WAKE_S)
                    stream.changed.clear()
                    continue
                if box is None:
                    batches = iter(stream)
                else:
                    mine = swarm.deal([_wire(part) for part in stream.deal(ranks, accum)])
                    batches = _dealt_batches(stream, mine)
            elif isinstance(stream, DealtData):
                assert isinstance(swarm, BoxRank)
                mine = swarm.dealt()
                if mine is None:  # rank 0 left the swarm
                    break
                batches = _dealt_batches(stream, mine)
            try:
                loss = loop.train_step(batches)
                failed = ""
            except FloatingPointError as exc:
                failed = str(exc)
            if box is not None:
                failed = _any_rank(box, failed)  # every rank discards, or none
            if failed:
                swarm.discard_local(failed)
                continue
            swarm.log(loss=loss)


def _wire(part: list[list[Range]]) -> list[list[list[int]]]:
    """A rank's ranges as plain lists (what the box scatters)."""
    return [[r.to_list() for r in ranges] for ranges in part]


def _dealt_batches(
    stream: LeasedData | DealtData, part: list[list[list[int]]]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of the ranges dealt to this rank."""
    for ranges in part:
        yield read_batch(stream.sequences, [Range.from_list(r) for r in ranges], stream.vocab_size)


def fit_batch(
    loop: InnerLoop, model_config: dict[str, Any], device: torch.device, budget_gb: float | None
) -> Fit:
    """Fit the loop's step to the device (train/fit.py): measured on CUDA, estimated from
    the model's shape elsewhere; the loop's micro-batch and accumulation are set to the
    fit's, the run's sequences per step unchanged."""
    inner = loop.config
    model = loop.model
    if device.type == "cuda":
        state = 2 * sum(p.numel() * 4 for p in model.parameters())  # AdamW's two moments
        profile = measure_profile(
            model,
            seq_len=int(model_config["seq_len"]),
            vocab_size=int(model_config["vocab_size"]),
            device=device,
            autocast=loop._autocast,
            optimizer_state_bytes=state,
        )
        if budget_gb is None:
            free, _ = torch.cuda.mem_get_info(device)
            budget = free + torch.cuda.memory_allocated(device)  # the weights are ours
        else:
            budget = int(budget_gb * 1e9)
    else:
        assert budget_gb is not None
        needed = ("n_layer", "n_embd", "seq_len", "vocab_size")
        if any(key not in model_config for key in needed):
            raise SwarmlocoError(
                "--memory-budget off CUDA needs the model's shape (n_layer, n_embd, seq_len, "
                "vocab_size): this task's model does not say it"
            )
        profile = estimate_profile(
            sum(p.numel() for p in model.parameters()),
            n_layer=int(model_config["n_layer"]),
            n_embd=int(model_config["n_embd"]),
            seq_len=int(model_config["seq_len"]),
            vocab_size=int(model_config["vocab_size"]),
            activation_bytes=2 if loop.amp_dtype is not None else 4,
        )
        budget = int(budget_gb * 1e9)
    fit = choose_fit(inner.batch_size * inner.grad_accum, profile, budget)
    if fit.checkpointing:
        setattr(model, "checkpointing", True)  # noqa: B010 (a plain attribute)
    loop.config = dataclasses.replace(inner, batch_size=fit.micro_batch, grad_accum=fit.grad_accum)
    logger.info("fitted to %s: %s", device, fit.describe())
    return fit


def _any_rank(box: Box, failed: str) -> str:
    """The failure of any rank of the box this step ("" if none), on every rank."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if failed else 0.0], device=box.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=box.group)
    if flag.item() and not failed:
        return "another rank of the box met NaN/Inf"
    return failed
