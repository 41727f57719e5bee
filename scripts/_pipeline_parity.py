"""The ``parity`` part of ``bench_pipeline.py``: a pipelined run against DiLoCo
data-parallel training over the same tokens.

Both arms train the same model (the GPT of the bench's settings, cut in two: what the
pipeline trains, untied head included) from the same weights, with the same run spec (H,
the outer optimizer, the int8 rounds overlapping one step) and the same micro-batches:

- **pipeline**: 2 stages x 2 replicas, each a real ``StagePeer`` on loopback gRPC in this
  process; each stage-0 peer drives its own stream of micro-batches through a stage-1
  replica it draws; each replica steps every two micro-batches' sequences and averages its
  stage with the other replica in rounds of its own;
- **data-parallel**: two library peers (``swarmloco.create`` / ``join``) over the whole
  model; peer k steps on micro-batches 2i and 2i+1 of stream k (the same sequences as
  stage-0 peer k's step i).

After the last micro-batch each arm's held-out loss is the mean, over its models (every
stage-0 replica with every stage-1 replica; each data-parallel peer), of the loss on
held-out text. ``pipeline_over_diloco`` is the pipeline's over data-parallel's (the median
of ``--parity-repeats`` runs of each; ``parity_tolerance`` is the most it may be); the report
says too whether the replicas of each stage held one digest in every round they averaged
together, and how many rounds each peer applied and aborted (with why).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import swarmloco
from swarmloco.core.runspec import RunSpec
from swarmloco.net.averaging import MatchmakingConfig
from swarmloco.net.identity import Identity
from swarmloco.net.node import NodeConfig
from swarmloco.pipeline.driver import PipelineError
from swarmloco.pipeline.manifest import pipeline_manifest
from swarmloco.pipeline.peer import StagePeer, StageWork
from swarmloco.pipeline.stages import GPTStage, gpt_stages
from swarmloco.pipeline.wire import Boundary
from swarmloco.train.spec import GPTConfig

LR = 3e-3
TOLERANCE = 1.05
"""A pipelined run trains to the loss of data-parallel DiLoCo over the same tokens when the
median of three or more runs of each gives a held-out loss at most this many times
data-parallel's (measured: 0.988, 2026-12-05, once the data-parallel arm's joiner paced
its rounds by its real tokens a step; 0.983 and 0.970 before, against an arm that averaged
more often than H said)."""
ONE_RUN_TOLERANCE = 1.10
"""The same for one run of each (what the issue's test asserts): a run's ratio moves with
how the rounds of each arm fall (17 single runs on this machine, quiet and beside busy
loops: 0.95 to 1.05)."""


class Whole(nn.Module):
    """The two stages as one model: what a data-parallel peer trains."""

    def __init__(self, stages: Sequence[GPTStage]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        first, last = self.stages
        return last(first(x), targets)


class Events:
    """The events of one peer, kept (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.seen.append(dict(event))

    def rounds(self) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.seen if e["event"] == "round"]

    def named(self, event: str) -> list[str]:
        """Events of this kind, each as its round and error."""
        with self.lock:
            return [f"{e['round']}: {e.get('error', '')}" for e in self.seen if e["event"] == event]


def peer_config(tmp: Path, name: str, peers: Sequence[str]) -> swarmloco.PeerConfig:
    return swarmloco.PeerConfig(
        data_dir=tmp / name,
        node=NodeConfig(peers=tuple(peers)),
        handle_signals=False,
        progress_interval_s=0.2,
        matchmaking=MatchmakingConfig(gather_s=1.0, poll_s=0.05, min_group_size=2),
        codec_backend="eager",
        eval_every=0,
    )


def held_out_loss(models: Sequence[nn.Module], held: Sequence[torch.Tensor]) -> float:
    with torch.no_grad():
        return statistics.fmean(
            float(model(rows[:, :-1], rows[:, 1:])) for model in models for rows in held
        )


def agreement(events: Sequence[Events]) -> dict[str, Any]:
    """The rounds the peers of one swarm averaged together, and whether each had one
    digest on every peer that applied it."""
    together: dict[int, set[str]] = {}
    for seen in events:
        for e in seen.rounds():
            if e["group"] == len(events):
                together.setdefault(e["round"], set()).add(e["digest"])
    return {
        "rounds_applied": [len(seen.rounds()) for seen in events],
        "aborted": [seen.named("aborted") for seen in events],
        "rounds_together": len(together),
        "one_digest": bool(together) and all(len(d) == 1 for d in together.values()),
    }


def pipeline_arm(
    spec: RunSpec, config: GPTConfig, streams: Sequence[Sequence[torch.Tensor]], tmp: Path
) -> tuple[list[nn.Module], dict[str, Any]]:
    micro = streams[0][0].shape[0]
    ids = Boundary(width=0, max_batch=micro, max_tokens=config.seq_len, vocab=config.vocab_size)
    acts = Boundary(width=config.n_embd, max_batch=micro, max_tokens=config.seq_len)
    run = pipeline_manifest(
        spec, gpt_stages(config, 2, seed=1), creator=Identity.generate().public_key.hex(),
        task="gpt-bytes", identity_work=0,
    )  # fmt: skip
    events = {name: Events() for name in ("a1", "a2", "b1", "b2")}

    def peer(name: str, stage: int, entry: Sequence[str]) -> StagePeer:
        module = gpt_stages(config, 2, seed=1)[stage]
        work = StageWork(
            module=module, optimizer=torch.optim.AdamW(module.parameters(), lr=LR),
            activations=acts, ids=ids, step_samples=2 * micro, tokens_per_sequence=config.seq_len,
        )  # fmt: skip
        return StagePeer(run, stage, work, config=peer_config(tmp, name, entry),
                         on_event=events[name], load_interval_s=0.2)  # fmt: skip

    lost = [0, 0]
    with contextlib.ExitStack() as stack:
        b1 = stack.enter_context(peer("b1", 1, ()))
        assert b1.peer is not None and b1.peer.network is not None
        entry = [b1.peer.network.node.endpoint]
        b2 = stack.enter_context(peer("b2", 1, entry))
        drivers = [stack.enter_context(peer(n, 0, entry)) for n in ("a1", "a2")]
        wait_for_replicas(drivers, 2)

        def drive(k: int) -> None:
            for rows in streams[k]:
                try:
                    drivers[k].drive(rows[:, :-1], rows[:, 1:], timeout=120)
                except PipelineError:
                    lost[k] += 1

        run_threads([lambda: drive(0), lambda: drive(1)])
        stack.close()
    heads = [b1.work.module, b2.work.module]
    models = [Whole([d.work.module, h]) for d in drivers for h in heads]  # type: ignore[list-item]
    report = {
        "lost_micro_batches": sum(lost),
        "served": {name: p.replica.served for name, p in (("b1", b1), ("b2", b2))},
        "stage0": agreement([events["a1"], events["a2"]]),
        "stage1": agreement([events["b1"], events["b2"]]),
    }
    return models, report


def wait_for_replicas(drivers: Sequence[StagePeer], replicas: int) -> None:
    """Until each driver read the records of ``replicas`` stage-1 replicas (so that the
    first micro-batches are drawn over both, as later ones are)."""
    for d in drivers:
        done = threading.Event()
        while not done.wait(0.1):
            if len([x for x in d.read_loads() if x.stage == 1 and x.endpoint]) >= replicas:
                done.set()


def diloco_arm(
    spec: RunSpec, config: GPTConfig, streams: Sequence[Sequence[torch.Tensor]], tmp: Path
) -> tuple[list[nn.Module], dict[str, Any]]:
    tokens = 2 * streams[0][0].shape[0] * config.seq_len
    models = [Whole(gpt_stages(config, 2, seed=1)) for _ in streams]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    events = [Events() for _ in streams]
    first = swarmloco.create(
        spec, models[0], optimizers[0], tokens_per_step=tokens, identity_work=0,
        config=peer_config(tmp, "p1", ()), on_event=events[0],
    )  # fmt: skip
    with first:
        # tokens_per_step on both: pacing counts each peer's steps by it (a joiner left
        # at the default, 1 token a step, made a round due every two steps of 0.5 s).
        second = swarmloco.join(
            first.swarm_id, models[1], optimizers[1], peers=[first.endpoint],
            tokens_per_step=tokens, config=peer_config(tmp, "p2", ()), on_event=events[1],
        )  # fmt: skip
        with second:
            swarms = [first, second]
            for s in swarms:
                s.wait_for_peers(2, timeout_s=60)

            def train(k: int) -> None:
                stream = streams[k]
                for i in range(0, len(stream) - 1, 2):
                    rows = torch.cat([stream[i], stream[i + 1]])
                    loss = models[k](rows[:, :-1], rows[:, 1:])
                    optimizers[k].zero_grad()
                    loss.backward()
                    optimizers[k].step()

            run_threads([lambda: train(0), lambda: train(1)])
    return list(models), {"peers": agreement(events)}


def run_threads(work: Sequence[Any]) -> None:
    """Run each callable in a thread of its own; raise the first error."""
    errors: list[BaseException] = []

    def guarded(fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def streams_of(
    batches: Any, config: GPTConfig, micro: int, count: int, seed: int
) -> list[list[torch.Tensor]]:
    return [batches(config, micro, count, seed=seed * 10 + k) for k in (1, 2)]


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="swarmloco-parity-") as tmp:
        yield Path(tmp)


def parity(
    config: GPTConfig, *, sync_every: int, micro: int, micro_batches: int, repeats: int,
    batches: Any, arms: Sequence[str] = ("pipeline", "diloco"),
) -> dict[str, Any]:  # fmt: skip
    """Both arms (or those of ``arms``) ``repeats`` times each, in turn (each repeat a
    stream pair of its own). The pipeline arm alone, repeated, measures how often the
    replicas of each stage average together."""
    spec = RunSpec(sync_every=sync_every, delay=1)
    held = batches(config, 16, 4, seed=999)
    untrained = held_out_loss([Whole(gpt_stages(config, 2, seed=1))], held)
    order = [a for a in (("pipeline", pipeline_arm), ("diloco", diloco_arm)) if a[0] in arms]
    runs: list[dict[str, Any]] = []
    for r in range(repeats):
        streams = streams_of(batches, config, micro, micro_batches, seed=r)
        run: dict[str, Any] = {}
        for arm, fn in order[:: 1 - 2 * (r % 2)]:
            with scratch() as tmp:
                models, report = fn(spec, config, streams, tmp)
            run[arm] = {"held_out_loss": round(held_out_loss(models, held), 5), **report}
        runs.append(run)
    settings = {"sync_every": sync_every, "micro_batch": micro, "micro_batches": micro_batches}
    out: dict[str, Any] = {
        "parity": {**settings, "arms": list(arms), "untrained_loss": round(untrained, 5),
                   "runs": runs},
    }  # fmt: skip
    if "diloco" in arms:
        out["parity"]["diloco_loss_median"] = statistics.median(
            r["diloco"]["held_out_loss"] for r in runs
        )
    if "pipeline" not in arms:
        return out
    pipe = statistics.median(r["pipeline"]["held_out_loss"] for r in runs)
    out["parity"]["pipeline_loss_median"] = pipe
    if "diloco" in arms:
        out["pipeline_over_diloco"] = round(pipe / out["parity"]["diloco_loss_median"], 4)
        out["parity_tolerance"] = TOLERANCE if repeats >= 3 else ONE_RUN_TOLERANCE
    together = {
        s: [r["pipeline"][s]["rounds_together"] for r in runs] for s in ("stage0", "stage1")
    }
    return {
        **out,
        "stage_digests_agree": all(
            r["pipeline"][s]["one_digest"] or not r["pipeline"][s]["rounds_together"]
            for r in runs
            for s in ("stage0", "stage1")
        ),
        "stages_averaged_together": all(n > 0 for counts in together.values() for n in counts),
        "stage_rounds_together": together,
        "aborted_attempts_per_run": round(
            statistics.fmean(
                sum(len(a) for s in ("stage0", "stage1") for a in r["pipeline"][s]["aborted"])
                for r in runs
            ),
            2,
        ),
    }
