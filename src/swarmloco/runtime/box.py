"""One peer on several ranks: the processes of a box train one model over
``torch.distributed`` (DDP, FSDP2 ``fully_shard``, or both) and join the swarm as one peer
(DESIGN section 4, "A box of ranks").

Rank 0 of the box is the peer: it holds the identity, the DHT presence, the averaging and
the checkpoints, exactly as a one-process peer does. The other ranks run the same training
loop; rank 0 tells them, at each step's end, what happens between this step and the next
(a fragment's parameters are read for a round or written after one, a checkpoint is taken,
the run stops) with one small broadcast, and they join the collectives that need them.

Averaging is layout independent: the pseudo-gradient is always over the canonical flat
vector (parameters by name, full shapes, the manifest's layout), so a box sharding its
model over 8 GPUs, a 2-rank DDP box and a laptop agree on every byte of every round. A
sharded parameter (a ``DTensor``) is gathered whole on rank 0 to be read, and distributed
back from it to be written; a replicated one (DDP) is read on rank 0 and broadcast from it.
Only rank 0 talks to the swarm: the box sends the bytes a one-process peer sends.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from swarmloco.core.flat import FlatLayout
from swarmloco.errors import Stopped, SwarmlocoError

logger = logging.getLogger(__name__)

_WIDTH = 6  # ints in one command


STOPPED_PREFIX = "stopped: "
"""What rank 0 shares from ``wait_for_peers`` when the peer was asked to stop meanwhile:
every rank then raises :class:`Stopped`, as rank 0 does."""


class BoxError(SwarmlocoError):
    """A rank of the box failed or is gone: the box's peer leaves the swarm."""


class Op(enum.IntEnum):
    """What rank 0 tells the other ranks to do."""

    END = 0
    """The step is over: ``[global_step, round, stopping, stopped_raised]``."""
    PARAMS = 1
    """Read and/or write parameters: ``[fragment (-1: all), read, write]``."""
    SAVE = 2
    """Send this rank's part of a checkpoint to rank 0."""
    LOAD = 3
    """Take this rank's part of a checkpoint from rank 0."""
    MANIFEST = 4
    """The swarm's manifest follows (the layout of the flat vector)."""
    READY = 5
    """Entered: the peer's facts follow (swarm id, peer id, data seed, round...)."""
    EXIT = 6
    """Rank 0 left the swarm (after its last checkpoint)."""
    ABORT = 7
    """Rank 0 failed: its message follows."""
    RESET = 8
    """Clear the optimizer's state (NaN was discarded; the parameters follow)."""
    STEP = 9
    """Train a step on what follows: each rank's part, scattered (a pinned dataset's
    ranges, dealt by rank 0)."""
    IDLE = 10
    """Rank 0 has no batch yet (it does the swarm's work between steps): wait on."""


def is_sharded(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


class Box:
    """The ranks of ``group`` (default: the default process group) as one peer."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise SwarmlocoError(
                "a box needs torch.distributed initialized first (torchrun sets the "
                "environment; call torch.distributed.init_process_group())"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.source = dist.get_global_rank(group, 0) if group is not None else 0
        """The global rank of the box's rank 0."""
        if dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.broken = False
        """A collective failed (a rank died): nothing more is asked of the others."""

    @property
    def leader(self) -> bool:
        """Whether this process is rank 0, the peer."""
        return self.rank == 0

    def __repr__(self) -> str:
        return f"Box(rank {self.rank} of {self.size})"

    # -- commands ----------------------------------------------------------------------------

    def tell(self, op: Op, *args: int) -> None:
        """Rank 0: broadcast one command to the other ranks."""
        values = [int(op), *(int(a) for a in args)]
        values += [0] * (_WIDTH - len(values))
        self._collective(dist.broadcast, torch.tensor(values, device=self.device))

    def hear(self) -> tuple[Op, list[int]]:
        """The other ranks: the next command of rank 0."""
        t = torch.zeros(_WIDTH, dtype=torch.int64, device=self.device)
        self._collective(dist.broadcast, t)
        values = [int(v) for v in t.tolist()]
        return Op(values[0]), values[1:]

    def share(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self._collective(dist.broadcast_object_list, box)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.size if self.leader else None
        self._call(lambda: dist.gather_object(obj, out, dst=self.source, group=self.group))
        return out

    def scatter(self, objs: Sequence[Any] | None) -> Any:
        """Rank 0 gives ``objs[r]`` to rank r; each rank gets its own."""
        out: list[Any] = [None]
        self._call(
            lambda: dist.scatter_object_list(
                out, list(objs) if self.leader and objs is not None else None,
                src=self.source, group=self.group,
            )
        )  # fmt: skip
        return out[0]

    def _collective(self, fn: Callable[..., Any], arg: Any) -> None:
        self._call(lambda: fn(arg, src=self.source, group=self.group))

    def _call(self, fn: Callable[[], Any]) -> None:
        if self.broken:
            raise BoxError("a rank of this box is gone")
        try:
            fn()
        except (RuntimeError, ValueError, OSError) as exc:  # dist's errors are RuntimeErrors
            self.broken = True
            raise BoxError(f"a rank of this box failed or is gone: {exc}") from exc


class BoxLead:
    """Rank 0's side of the lock-step, around what its ``Swarm`` does: the box is told when
    the peer is ready (with the facts every rank reads), at the end of each step (the
    global step, the round, whether to stop, whether the step raised), and when rank 0
    failed (the others raise too). Without a box (``box`` None) it does nothing."""

    def __init__(self, box: Box | None) -> None:
        self.box = box
        self.told_stopping = False
        """Whether the last step's end told the box to stop (every rank leaves together)."""

    def ready(self, facts: dict[str, Any]) -> None:
        if self.box is not None:
            self.box.tell(Op.READY)
            self.box.share(facts)

    def abort(self, exc: BaseException) -> None:
        """Tell the box's other ranks that this one failed (they raise too)."""
        if self.box is None or self.box.broken:
            return
        try:
            self.box.tell(Op.ABORT)
            self.box.share(f"{type(exc).__name__}: {exc}")
        except BoxError:
            pass

    def end_step(self, global_step: int, round: int, stopping: bool, *, raised: bool) -> None:
        """Tell the box's other ranks that the step is over, and whether to stop."""
        if self.box is not None:
            self.told_stopping = stopping
            self.box.tell(Op.END, global_step, round, stopping, raised)

    def deal(self, parts: Sequence[Any]) -> Any:
        """Tell the box's other ranks to train a step, each on its part of ``parts`` (one a
        rank, rank 0's first); rank 0's own part."""
        assert self.box is not None
        self.box.tell(Op.STEP)
        return self.box.scatter(parts)

    def idle(self) -> None:
        """Tell the box's other ranks that rank 0 has no batch yet: they wait on (a word
        now and then keeps their wait within the process group's timeout)."""
        if self.box is not None:
            self.box.tell(Op.IDLE)

    def around_step(self, work: Callable[[], None], end: Callable[[bool], None]) -> None:
        """Run ``work`` (what rank 0 does between two steps), then ``end(raised)``: the
        step's end told to the box, also when ``work`` stopped the peer; any other failure
        is told as one."""
        if self.box is None:
            work()
            return
        try:
            work()
        except Stopped:
            end(True)
            raise
        except BaseException as exc:
            self.abort(exc)
            raise
        end(False)


def whole_values(box: Box | None, model: torch.nn.Module) -> list[torch.Tensor] | None:
    """Every rank: the whole values of ``model``'s parameters in model order (sharded ones
    gathered, a collective), or None when nothing is sharded or there is no box."""
    params = [p for _, p in model.named_parameters()]
    if box is None or box.size == 1 or not any(is_sharded(p) for p in params):
        return None
    out: list[torch.Tensor] = []

    def gather() -> None:
        with torch.no_grad():
            for p in params:
                out.append(p.full_tensor() if is_sharded(p) else p)  # type: ignore[attr-defined]

    box._call(gather)
    return out


class BoxParams:
    """A model's parameters in a layout's order, read and written whole on rank 0 however
    the box lays them out (one process: the parameters themselves)."""

    def __init__(self, params: Sequence[torch.Tensor], layout: FlatLayout, box: Box | None):
        self.params = list(params)
        self.layout = layout
        self.box = box if box is not None and box.size > 1 else None
        self.sharded = any(is_sharded(p) for p in self.params)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @contextlib.contextmanager
    def view(
        self, fragment: int | None, *, read: bool, write: bool = False
    ) -> Iterator[list[torch.Tensor]]:
        """Rank 0: whole tensors for the parameters of ``fragment`` (None: all), in the
        layout's order, holding their values if ``read``; what is written into them reaches
        every rank's parameters on leaving if ``write``."""
        if self.box is None:
            yield self.params
            return
        self.box.tell(Op.PARAMS, -1 if fragment is None else fragment, read, write)
        whole = self._open(fragment, read)
        yield whole
        if write:
            self._close(fragment, whole)

    def serve(self, args: list[int]) -> None:
        """The other ranks: take part in what :meth:`view` does on rank 0."""
        fragment = None if args[0] < 0 else args[0]
        self._open(fragment, bool(args[1]))
        if args[2]:
            self._close(fragment, self.params)

    def _mine(self, fragment: int | None) -> Iterator[tuple[int, torch.Tensor]]:
        for i, (slot, p) in enumerate(zip(self.layout.slots, self.params, strict=True)):
            if fragment is None or slot.fragment == fragment:
                yield i, p

    @torch.no_grad()
    def _open(self, fragment: int | None, read: bool) -> list[torch.Tensor]:
        assert self.box is not None
        whole = list(self.params)
        for i, p in self._mine(fragment):
            if not is_sharded(p):
                continue  # replicated: rank 0's own is whole
            if read:
                whole[i] = self._checked(p.full_tensor)  # type: ignore[attr-defined]
            elif self.box.leader:
                whole[i] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        return whole

    @torch.no_grad()
    def _close(self, fragment: int | None, whole: list[torch.Tensor]) -> None:
        assert self.box is not None
        for i, p in self._mine(fragment):
            if is_sharded(p):
                source = (
                    whole[i]
                    if self.box.leader
                    else torch.empty(p.shape, dtype=p.dtype, device=p.device)
                )
                mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
                local = self._checked(
                    functools.partial(_distributed_shard, source, mesh, placements)
                )
                p.to_local().copy_(local)  # type: ignore[attr-defined]
            else:
                self.box._collective(dist.broadcast, p.data)

    def _checked(self, fn: Callable[[], Any]) -> Any:
        assert self.box is not None
        out: list[Any] = []
        self.box._call(lambda: out.append(fn()))
        return out[0]


def _distributed_shard(source: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(source, mesh, placements).to_local()


# -- checkpoints ------------------------------------------------------------------------------


def local_state(value: Any) -> Any:
    """``value`` with every DTensor replaced by this rank's shard (a checkpoint holds the
    shards; :func:`sharded_like` makes DTensors of them again)."""
    if is_sharded(value):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [local_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(local_state(v) for v in value)
    return value


def _as_param(local: Any, p: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    if not is_sharded(p) or not isinstance(local, torch.Tensor) or local.dim() == 0:
        return local
    return DTensor.from_local(
        local.to(p.device),  # type: ignore[attr-defined]
        p.device_mesh,  # type: ignore[attr-defined]
        p.placements,  # type: ignore[attr-defined]
        shape=p.shape,
        stride=p.stride(),
        run_check=False,
    )


def load_model_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """``model.load_state_dict`` of a state saved with :func:`local_state`."""
    named = dict(model.named_parameters())
    model.load_state_dict(
        {k: _as_param(v, named[k]) if k in named else v for k, v in state.items()}
    )


# Per-parameter optimizer states that torch's optimizers keep element by element (Adam's
# moments, SGD's momentum, RMSprop's averages, Adagrad's sum): of another shape than their
# parameter, they would fail the first step after a restore, not the restore. Other keys
# may legitimately have other shapes (factored second moments), so only these are checked.
_ELEMENTWISE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer", "square_avg"}
    | {"acc_delta", "grad_avg", "sum", "ax", "prev"}
)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` of a state saved with :func:`local_state`: a per-
    parameter tensor of a sharded parameter's shape becomes a DTensor like it again.
    ValueError when an element-wise state does not have its parameter's shape."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for k, per in state.get("state", {}).items():
        p = params[int(k)]
        if is_sharded(p):
            continue  # a shard's shape is this rank's, not the parameter's
        for name, v in per.items():
            if name in _ELEMENTWISE and isinstance(v, torch.Tensor) and v.shape != p.shape:
                raise ValueError(
                    f"optimizer state {name!r} of parameter {k} has shape {tuple(v.shape)}, "
                    f"the parameter {tuple(p.shape)}"
                )
    restored = dict(state)
    # Copied: torch's optimizers keep a tensor of the right type and device as it is, and a
    # checkpoint's tensors are mapped from its file (which must not outlive its pruning).
    restored["state"] = {
        k: {name: _as_param(_own(v), params[int(k)]) for name, v in per.items()}
        for k, per in state.get("state", {}).items()
    }
    optimizer.load_state_dict(restored)


def _own(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def ignore_stop_signals() -> Callable[[], None]:
    """The other ranks leave the stopping to rank 0 (which stops them all at a step's end):
    SIGINT and SIGTERM are logged, not acted on. Returns what restores the handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def noted(signum: int, _frame: object) -> None:
        logger.info("signal %s: rank 0 of the box stops the run", signal.Signals(signum).name)

    for s in previous:
        signal.signal(s, noted)

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    return restore


class BoxRank:
    """A rank other than 0 of a box: the surface of :class:`~.swarm.Swarm` that a training
    loop uses, run in step with rank 0 (which is the peer)."""

    def __init__(
        self,
        box: Box,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        hook: bool = True,
    ) -> None:
        self.box = box
        self.model = model
        self.optimizer = optimizer
        self.hook = hook
        self.objects: dict[str, Any] = {}
        self.swarm_id = ""
        self.peer_id = ""
        self.endpoint = ""
        self.spec: Any = None
        self._data_seed = 0
        self._round = 0
        self._global_step = 0
        self._stopping = False
        self._exited = False  # rank 0's EXIT was heard (waiting for a step's part)
        self._entered = False
        self._params: BoxParams | None = None
        self._hook: Any = None
        self._restore_signals: Callable[[], None] = lambda: None
        self.steps = 0
        self.evaluate: Any = None
        self.lr_at: Callable[[int], float] | None = None
        """Unused here: rank 0 judges downloads."""

    # -- what the loop reads -----------------------------------------------------------------

    @property
    def round(self) -> int:
        return self._round

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def data_seed(self) -> int:
        """The box's data seed: combine it with this rank to read a shard of its own."""
        return self._data_seed

    def register(self, name: str, obj: Any) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name!r} has no state_dict/load_state_dict to checkpoint")
        if self._entered:
            raise SwarmlocoError("register objects before entering the swarm (with swarm:)")
        self.objects[name] = obj

    def lr_lambda(self, schedule: Callable[[int], float]) -> Callable[[int], float]:
        return lambda _: schedule(self.global_step)

    def scheduler(self, schedule: Callable[[int], float]) -> torch.optim.lr_scheduler.LambdaLR:
        sched = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_lambda(schedule))
        if not self._entered and "scheduler" not in self.objects:
            self.register("scheduler", sched)
        return sched

    def log(self, *, loss: float | None = None) -> None:
        """Losses are rank 0's to report."""

    def load_global_into(self, module: torch.nn.Module) -> None:
        raise SwarmlocoError("the global model is rank 0's: evaluate and export there")

    def stop(self, reason: str = "asked to stop") -> None:
        logger.info("rank %d: %s (rank 0 of the box stops the run)", self.box.rank, reason)

    # -- in step with rank 0 -----------------------------------------------------------------

    def __enter__(self) -> BoxRank:
        self._restore_signals = ignore_stop_signals()
        try:
            op, _ = self._serve()
        except BaseException:
            self._restore_signals()
            raise
        assert op is Op.READY
        facts = self.box.share()
        self.swarm_id = facts["swarm_id"]
        self.peer_id = facts["peer_id"]
        self.endpoint = facts["endpoint"]
        self._data_seed = int(facts["data_seed"])
        self._round = int(facts["round"])
        self._global_step = int(facts["global_step"])
        if self.hook:
            self._hook = self.optimizer.register_step_post_hook(lambda *_: self.step())
        self._entered = True
        return self

    def step(self, tokens: int | None = None) -> None:
        """One optimizer step happened (the hook calls this): wait for rank 0's word."""
        self.steps += 1
        op, args = self._serve()
        if op is Op.EXIT:
            self._stopping = self._exited = True
            raise Stopped("rank 0 of the box left the swarm")
        self._global_step, self._round = args[0], args[1]
        self._stopping = bool(args[2])
        if args[3]:
            raise Stopped("the box's peer stopped")

    def dealt(self) -> Any:
        """This rank's part of the next step, as rank 0 deals it (:meth:`BoxLead.deal`),
        serving what rank 0 asks meanwhile; None once rank 0 left the swarm (the loop
        ends: :attr:`stopping`)."""
        op, _ = self._serve()
        if op is Op.EXIT:
            self._stopping = self._exited = True
            return None
        if op is not Op.STEP:
            raise BoxError(f"rank 0 of the box said {op.name} where a step's part was due")
        return self.box.scatter(None)

    def wait_for_peers(self, n: int, *, timeout_s: float = 600.0) -> int:
        """Rank 0 waits for the swarm's peers; this rank for its word."""
        error = self.box.share()
        if error.startswith(STOPPED_PREFIX):
            raise Stopped(error[len(STOPPED_PREFIX) :])
        if error:
            raise SwarmlocoError(error)
        return n

    def discard_local(self, why: str) -> None:
        """NaN/Inf: every rank calls it at the same point; rank 0 restarts the box from the
        global state."""
        self._serve()

    def __exit__(self, exc_type: type[BaseException] | None, exc: Any, tb: Any) -> bool:
        try:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if exc_type is None or issubclass(exc_type, Stopped):
                while not self.box.broken and not self._exited:
                    op, _ = self._serve()
                    if op is Op.EXIT:
                        break
        finally:
            self._restore_signals()
        return exc_type is not None and issubclass(exc_type, Stopped)

    def _serve(self) -> tuple[Op, list[int]]:
        """Do what rank 0 asks until it ends the step (or enters, or leaves)."""
        while True:
            op, args = self.box.hear()
            if op is Op.PARAMS:
                assert self._params is not None, "parameters before the manifest"
                self._params.serve(args)
            elif op is Op.MANIFEST:
                self._manifest(self.box.share())
            elif op is Op.SAVE:
                self.box.gather(self._state())
            elif op is Op.LOAD:
                self._load(self.box.scatter(None))
            elif op is Op.RESET:
                self.optimizer.state.clear()
            elif op is Op.IDLE:
                pass
            elif op is Op.ABORT:
                message = self.box.share()
                raise SwarmlocoError(f"rank 0 of the box failed: {message}")
            else:
                return op, args

    def _manifest(self, data: bytes) -> None:
        from swarmloco.core.manifest import SwarmManifest
        from swarmloco.core.signature import parameters_in_order
        from swarmloco.runtime.swarm import manifest_signature, manifest_spec

        manifest = SwarmManifest.from_bytes(data)
        self.spec = manifest_spec(manifest)
        signature = manifest_signature(manifest)
        layout = signature.layout(self.spec.codec.block_size)
        params = parameters_in_order(unwrap(self.model), signature.params)
        self._params = BoxParams(params, layout, self.box)

    def _state(self) -> dict[str, Any]:
        assert self._params is not None
        state: dict[str, Any] = {
            "objects": {name: obj.state_dict() for name, obj in self.objects.items()},
            "rng": torch.get_rng_state(),
        }
        if self._params.sharded:
            state["model"] = local_state(unwrap(self.model).state_dict())
            state["optimizer"] = local_state(self.optimizer.state_dict())
        return state

    def _load(self, state: dict[str, Any]) -> None:
        load_model_state(unwrap(self.model), state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        objects = state.get("objects", {})
        for name, obj in self.objects.items():
            if name in objects:
                obj.load_state_dict(objects[name])
        if "rng" in state:
            torch.set_rng_state(state["rng"])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel (its parameters, without ``module.``)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model
