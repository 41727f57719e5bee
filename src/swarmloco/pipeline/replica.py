"""One replica of one pipeline stage: its compute, the micro-batches in flight through
it, and its gradient accumulator (``docs/DESIGN.md`` section 10).

``forward`` computes the stage's output without autograd and keeps the micro-batch's input
(and the RNG state, so that dropout replays); ``backward`` recomputes the forward under
autograd from that input, adds the parameters' gradients to their ``.grad`` (the
accumulator) and returns the gradient with respect to the input. So a replica holds the
inputs of its micro-batches in flight, never their activations, and each backward runs
against the weights its forward used. The stage computes on its parameters' device (a
GPU, say): inputs go there, outputs and input gradients come back to the CPU for the
wire. A replica given an optimizer and ``step_samples``
steps once it has accumulated that many sequences, at the backward that leaves no
micro-batch in flight; it admits a forward only while the sequences accumulated and in
flight are fewer than that (so a step is on the run's batch, however many micro-batches
its drivers push at once), and forwards past it, or that come while the step is due,
wait for the step (at most ``due_wait_s``, then refused as busy: the micro-batches in
flight come back, or expire after ``inflight_s``), so the weights never change under a
micro-batch. An *owned* replica
leaves the due step to its owner's thread instead (:meth:`StageReplica.take_step`, then
:meth:`StageReplica.release`): a stage peer runs its DiLoCo rounds between the two while
forwards wait, so a round's outer step never lands under a micro-batch either. A retried
backward (its reply was lost) is answered again from the last results kept, never added
twice. One compute runs at a time (the accumulator is shared). A forward may name its
driver's session here (:meth:`StageReplica.open_session`): when the session ends (its
driver died or left) its inputs are dropped at once, and forwards naming it are refused.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from swarmloco.core.config import require, require_int, require_positive
from swarmloco.net.rejections import Rejection
from swarmloco.runtime.progress import Rate

logger = logging.getLogger(__name__)

SLOW_CALL_S = 5.0
"""A forward or backward that took longer than this here (waiting for the replica, and
computing) is logged with where its time went: a driver's deadline is tens of seconds."""
RATE_WARMUP = 4
"""A replica's first micro-batches are not in its rate: a peer that just joined or moved
warms up (allocations, caches) slower than it will run."""
TRIPS_KEPT = 64
"""Micro-batches whose time from forward to backward a replica keeps (``inflight_floor_s``)."""
ENDED_KEPT = 1024
"""Sessions a replica remembers as ended (16 bytes each)."""
RATE_SETTLE = 8
"""Micro-batches counted before a replica's rate is said at all (0 until then)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaConfig:
    max_inflight: int = 64
    """Micro-batches whose inputs a replica holds at most; more are refused as busy."""
    max_held_bytes: int = 4 << 30
    """Bytes of those inputs (in host memory) a replica holds at most; a micro-batch more
    is refused as busy (one is always taken when none is held)."""
    inflight_s: float = 120.0
    """A micro-batch whose backward has not come by then is dropped (its driver gave up,
    or died): the most a replica waits for one."""
    inflight_floor_s: float = 30.0
    """Before ``inflight_s``, a micro-batch is dropped once it has waited longer than this
    and four times the longest any of the last micro-batches took from forward to
    backward here: a driver that died (SIGKILL, a lost machine) can abandon nothing, and
    its micro-batches held here would otherwise keep a step from being taken, and every
    other driver's forwards out, for ``inflight_s`` (found 2026-12-07: stage 1's one
    replica stalled the pipeline 2 minutes after each kill of a stage-0 peer). One dropped
    too early fails its micro-batch at its backward (its sequences are read again)."""
    kept_results: int = 64
    """Backward results kept to answer a retried call again."""
    step_samples: int = 0
    """Sequences accumulated before the replica steps its optimizer (0: the owner calls
    :meth:`StageReplica.step` itself)."""
    due_wait_s: float = 10.0
    """A forward that finds a step due, or the step's sequences all admitted, waits this
    long at most for the step (the micro-batches in flight to come back, or expire), then
    is refused as busy: its driver pauses and tries again within its hop's deadline
    (``DriverConfig.hop_timeout_s``, 30 s), shunning nobody. Waiting longer, past that
    deadline, had the driver shun the replica as failed (doubling up to an hour): the one
    replica of a stage holding micro-batches of a driver that died (they expire only
    after ``inflight_s``) stalled the pipeline for many minutes."""
    session_beat_s: float = 2.0
    """How often a driver holding a session that beats (``Attend``) is asked to send a
    beat."""
    session_silence_s: float = 10.0
    """A session on which nothing came for this long ends, its inputs dropped: its
    driver's machine froze or dropped off its network (no connection closes then)."""
    silent_grace_s: float = 120.0
    """A driver whose session fell silent may come back (its machine thawed, its network
    returned): for this long after, the replica does not count as idle (``idle_s``, what
    ``--leave-idle`` reads), as while its session was open."""
    hold_wait_s: float = 2.0
    """An owned replica's owner holds it (a round between its steps): a forward waits
    this long at most, then is refused as busy, and its driver draws another replica
    (which keeps the stage's other replicas busy and stepping, so they come to the round)."""

    def __post_init__(self) -> None:
        require_int("max_inflight", self.max_inflight, minimum=1)
        require_int("max_held_bytes", self.max_held_bytes, minimum=1)
        require_positive("inflight_s", self.inflight_s)
        require_positive("inflight_floor_s", self.inflight_floor_s)
        require_positive("hold_wait_s", self.hold_wait_s)
        require_positive("session_beat_s", self.session_beat_s)
        require_positive("silent_grace_s", self.silent_grace_s)
        require(
            self.session_silence_s > self.session_beat_s,
            f"session_silence_s ({self.session_silence_s}) must be longer than "
            f"session_beat_s ({self.session_beat_s})",
        )
        require_positive("due_wait_s", self.due_wait_s)
        require_int("kept_results", self.kept_results, minimum=1)
        require_int("step_samples", self.step_samples, minimum=0)


@dataclasses.dataclass
class _Held:
    input: torch.Tensor  # as it came (off the wire: in host memory), never the card's copy
    targets: torch.Tensor | None
    rng: tuple[torch.Tensor, torch.Tensor | None]  # the CPU's generator, the GPU's
    at: float
    seconds: float  # its forward's compute
    session: bytes = b""  # its driver's session here (b"": none)
    step: int | None = None  # the step its driver said it drove it at (None: not said)


class StageReplica:
    """See the module. ``module(x)`` is the stage (``module(x, targets)``, the loss, at the
    last stage)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        first: bool,
        last: bool,
        config: ReplicaConfig | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        owned: bool = False,
        clock: Callable[[], float] = time.monotonic,
        autocast: torch.dtype | None = None,
    ) -> None:
        if autocast not in (None, torch.bfloat16):
            raise ValueError(
                f"a stage computes in fp32 or under bf16 autocast, not {autocast} (fp16 "
                "would need a loss scale across the stages)"
            )
        self.autocast = autocast
        """The dtype the stage's compute runs under autocast (None: fp32); parameters,
        gradients and what crosses the wire stay fp32."""
        self.module = module
        self.first, self.last = first, last
        self.config = config or ReplicaConfig()
        if self.config.step_samples and optimizer is None:
            raise ValueError("a replica that steps (step_samples) needs an optimizer")
        if owned and not self.config.step_samples:
            raise ValueError("an owned replica's owner takes its steps every step_samples")
        self.optimizer = optimizer
        self.owned = owned
        self.clock = clock
        self._held: collections.OrderedDict[bytes, _Held] = collections.OrderedDict()
        self._results: collections.OrderedDict[bytes, torch.Tensor | None] = (
            collections.OrderedDict()
        )
        self._lock = threading.Condition()
        self.micro_batches = 0
        """Micro-batches whose gradients are in the accumulator."""
        self.samples = 0
        """Their sequences."""
        self.dropped = 0
        """Micro-batches dropped at their deadline (their backward never came)."""
        self.orphaned = 0
        """Micro-batches of drivers whose session here ended (they died, or left): inputs
        dropped then, and forwards that came in after it (not held)."""
        self._ended: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        """The sessions that ended here last (``ENDED_KEPT``): a forward naming one is its
        dead driver's, counted in ``orphaned`` (one naming a session never open is not)."""
        self._sessions: set[bytes] = set()  # the drivers' sessions open here
        self._sessions_lock = threading.Lock()  # never held across a compute
        self.steps = 0
        """Optimizer steps this replica took on its own."""
        self.skipped = 0
        """Steps not taken: their mean gradient held NaN or Inf (dropped instead)."""
        self.served = 0
        """Micro-batches whose backward it ran, since it started."""
        self.waiting = 0
        """Forwards waiting for a due step now."""
        self.busy_s = 0.0
        """Seconds it has computed (forwards, backwards, audits) since it began: how busy
        its stage keeps it, first-hand (the rebalancer weighs the records against it)."""
        self.before_step: Callable[[], None] | None = None
        """Called before each optimizer step, on the mean gradient (the owner's learning
        rate and clipping)."""
        self.on_step: Callable[[list[bytes], bool], None] | None = None
        """Called at each step taken or skipped (under the replica's lock: it must not call
        back): the names of the micro-batches whose gradients it held, and whether the
        optimizer stepped on them (False: a mean gradient not finite, dropped). Stage 0 on
        a pinned dataset learns from it which sequences a step trained."""
        self.admits: Callable[[bytes], bool] | None = None
        """Asked (under the replica's lock, once any step due was taken) before a forward
        computes: False refuses the micro-batch as ``withdrawn``. Stage 0 on a pinned
        dataset withdraws one whose sequences landed meanwhile (a state it took holds them)."""
        self._accumulated: list[bytes] = []  # the names of the micro-batches in the accumulator
        self._claims: list[int] = []  # the steps their drivers said (those that said one)
        self._stepping: list[int] = []  # those of the step being taken (before_step reads)
        self._trips: collections.deque[float] = collections.deque(maxlen=TRIPS_KEPT)
        """Seconds the last micro-batches took here from forward to backward."""
        self.loss = float("nan")
        """The last loss this replica computed (the last stage's forward)."""
        self.rate = Rate(warmup=RATE_WARMUP, settle=RATE_SETTLE)
        """Sequences per second of this replica's compute (a micro-batch's forward and
        backward), recently: what it claims in its ``stage-load`` record (0, "not
        measured", until its warm-up is over: rebalancing judges no stage on it before)."""
        first_param = next(module.parameters(), None)
        self.device = first_param.device if first_param is not None else torch.device("cpu")
        """Where the stage computes: its parameters' device."""
        self._worked_at: float | None = None  # its last forward or backward (None: none yet)
        self._silent_at: float | None = None  # a driver's session last fell silent
        self._held_bytes = 0  # of the inputs (and targets) held
        self._due = False  # a step is due: forwards wait until it is taken
        self._closed = False
        self._draining = False  # moving or leaving: no new forwards, backwards go on
        self._holding = False  # the owner took the step and has not released it yet

    @property
    def closed(self) -> bool:
        """Whether it takes no more micro-batches (its peer leaves)."""
        return self._closed

    @property
    def inflight(self) -> int:
        return len(self._held)

    def close(self) -> None:
        """Take no more micro-batches (the peer leaves, or its owner stopped stepping):
        calls waiting for a step are refused now, later ones at once."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def drain(self, timeout: float) -> int:
        """Take no new micro-batch, and wait up to ``timeout`` seconds for the backwards
        of those in flight (the peer moves to another stage or leaves: what its drivers
        started here ends here). Returns how many were still in flight at the end (they
        expire)."""
        deadline = self.clock() + timeout
        with self._lock:
            self._draining = True
            self._lock.notify_all()
            while self._held and not self._closed and self.clock() < deadline:
                self._lock.wait(timeout=min(0.5, max(0.0, deadline - self.clock())))
                self._expire()
            return len(self._held)

    def _check_open(self) -> None:
        if self._closed:
            raise Rejection("busy", "this replica is leaving")

    def forward(
        self,
        micro_batch: bytes,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        seed: int = 0,
        session: bytes = b"",
        step: int | None = None,
    ) -> torch.Tensor:
        """The stage's output for ``x`` (the loss, at the last stage, with ``targets``);
        its randomness (dropout) drawn from ``seed`` (0: the replica's own generator).
        ``session``: its driver's session here (:meth:`open_session`); its input is
        dropped when that session ends (one not open now: refused as busy). ``step``: the
        step its driver drove it at (:meth:`claimed_step`; None: not said)."""
        if self.last and targets is None:
            raise Rejection("malformed", "the last stage needs the targets")
        arrived = time.perf_counter()
        with self._lock:
            locked = time.perf_counter()
            self._check_open()
            if self._draining:
                raise Rejection("busy", "this replica is moving to another stage or leaving")
            self._wait_for_a_due_step()
            stepped = time.perf_counter()
            if micro_batch in self._held or micro_batch in self._results:
                raise Rejection("malformed", "a micro-batch of that name came before")
            if session and not self._session_open(session):
                # It ended (its driver died, or its connection broke): nobody would come back.
                # (Its caller is likely gone: this refusal may reach nobody, nor any log.)
                with self._sessions_lock:
                    self.orphaned += session in self._ended
                raise Rejection("busy", "the session it names is not open here")
            if self.admits is not None and not self.admits(micro_batch):
                raise Rejection("withdrawn", "its sequences landed meanwhile")
            if len(self._held) >= self.config.max_inflight:
                raise Rejection("busy", f"{len(self._held)} micro-batches in flight here")
            size = x.nbytes + (0 if targets is None else targets.nbytes)
            if self._held and self._held_bytes + size > self.config.max_held_bytes:
                raise Rejection("busy", f"{self._held_bytes} bytes of inputs held here")
            started = time.perf_counter()
            on_device = x.to(self.device)
            with self._seeded(seed) as rng, torch.no_grad(), self._autocast():
                out = self._stage(on_device, _to(targets, self.device))
            out = out.detach().float().cpu()  # on a GPU: waits for the compute (timed with it)
            del on_device  # the card keeps nothing of a micro-batch between its two calls
            seconds = time.perf_counter() - started
            self.busy_s += seconds
            held = _Held(x, targets, rng, self.clock(), seconds, session, step)
            self._hold(micro_batch, held)
            self._worked_at = self.clock()
            if self.last:
                self.loss = float(out)
        self._note_slow(
            "forward", micro_batch, arrived,
            replica=locked - arrived, step=stepped - locked, compute=seconds,
        )  # fmt: skip
        return out

    def _note_slow(self, call: str, micro_batch: bytes, arrived: float, **parts: float) -> None:
        """Log a call that took longer than :data:`SLOW_CALL_S`, with where its time went
        (``replica``: waiting for another call's compute or a step; ``step``: for a due
        step; ``compute``: its own, input and output copies included)."""
        total = time.perf_counter() - arrived
        if total > SLOW_CALL_S:
            spent = ", ".join(f"{name} {value:.2f} s" for name, value in parts.items())
            logger.warning(
                "a %s of micro-batch %s took %.1f s on %s (%s)",
                call, micro_batch.hex()[:12], total, self.device, spent,
            )  # fmt: skip

    def _stage(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """The stage on ``x`` (on its device): its output, or the loss at the last stage."""
        return self.module(x, targets) if self.last else self.module(x)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The generators a forward draws from (dropout): the CPU's and, on a GPU, its."""
        on_gpu = self.device.type == "cuda"
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if on_gpu else None

    @contextlib.contextmanager
    def _seeded(self, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """The generators' state a forward starts from, yielded: with a ``seed``, drawn
        from it (the process's generators untouched), else the process's own (advanced)."""
        if not seed:
            yield self._rng_state()
            return
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            yield self._rng_state()

    def audit(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None,
        grad_output: torch.Tensor | None,
        *,
        seed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's output for ``x`` (the loss, at the last stage) and the gradient with
        respect to ``x`` of the output against ``grad_output`` (of the loss, at the last
        stage), with the randomness drawn from ``seed``: what another replica answered for
        a micro-batch, computed again for its driver to compare (``docs/DESIGN.md`` section
        10, "Audits"). Keeps nothing: no input held, no gradient added to the accumulator.
        Refused as busy while the owner holds the replica (a round may change the weights)."""
        if self.first:
            raise Rejection("malformed", "stage 0 is its driver's own: nobody audits it")
        if self.last and targets is None:
            raise Rejection("malformed", "the last stage needs the targets")
        if not self.last and grad_output is None:
            raise Rejection("malformed", "an audit of this stage needs the output's gradient")
        with self._lock:
            self._check_open()
            if self._holding:
                raise Rejection("busy", "this replica is between two steps (a round)")
            started = time.perf_counter()
            on_device = x.to(self.device).detach().requires_grad_(True)
            with self._seeded(seed), torch.enable_grad():
                with self._autocast():
                    out = self._stage(on_device, _to(targets, self.device))
                if self.last:
                    (grad,) = torch.autograd.grad(out, on_device)
                else:
                    assert grad_output is not None
                    if grad_output.shape != out.shape:
                        raise Rejection("bad-shape", "the gradient is not the output's shape")
                    (grad,) = torch.autograd.grad(
                        out, on_device, grad_output.to(self.device, out.dtype)
                    )
            answer = out.detach().float().cpu(), grad.float().cpu()
            self.busy_s += time.perf_counter() - started
            return answer

    def load(self) -> dict[str, float | int]:
        """What this replica's ``stage-load`` record says of it: its rate, the micro-batches
        held and waiting, and how many more it takes. Read without the lock (each figure
        is one atomic read): the event loop calls this, and must never wait for a compute."""
        held = len(self._held)
        return {
            "rate": float(self.rate.value),
            "queue": held + self.waiting,
            "free": 0 if self._draining else max(0, self.config.max_inflight - held),
        }

    def backward(self, micro_batch: bytes, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Add the gradients of ``micro_batch`` to the accumulator and return the gradient
        with respect to its input (None at stage 0: its input is token ids)."""
        arrived = time.perf_counter()
        with self._lock:
            locked = time.perf_counter()
            if micro_batch in self._results:
                return self._results[micro_batch]  # a retried call: answered again
            self._check_open()
            held = self._pop(micro_batch)
            if held is None:
                raise Rejection("unknown", "no forward of that micro-batch is held here")
            self._trips.append(self.clock() - held.at)
            x = held.input.to(self.device)
            if not self.first:
                x = x.detach().requires_grad_(True)
            targets = _to(held.targets, self.device)
            started = time.perf_counter()
            cpu_rng, gpu_rng = held.rng
            gpus = [self.device] if gpu_rng is not None else []
            with torch.random.fork_rng(devices=gpus):
                torch.set_rng_state(cpu_rng)
                if gpu_rng is not None:
                    torch.cuda.set_rng_state(gpu_rng, self.device)
                with torch.enable_grad():
                    with self._autocast():
                        out = self._stage(x, targets)
                    if self.last:
                        out.backward()
                    else:
                        if grad_output is None or grad_output.shape != out.shape:
                            self._hold(micro_batch, held)  # the caller may send it again
                            raise Rejection("bad-shape", "the gradient is not the output's shape")
                        out.backward(grad_output.to(self.device, out.dtype))
            grad_input = None if self.first or x.grad is None else x.grad.cpu()
            computed = time.perf_counter() - started
            self.busy_s += computed
            self.rate.add(int(held.input.shape[0]), held.seconds + computed)
            self.micro_batches += 1
            self._accumulated.append(micro_batch)
            if held.step is not None:
                self._claims.append(held.step)
            self.served += 1
            self._worked_at = self.clock()
            self.samples += int(held.input.shape[0])
            self._results[micro_batch] = grad_input
            if self._draining:
                self._lock.notify_all()  # drain() waits for the last one
            while len(self._results) > self.config.kept_results:
                self._results.popitem(last=False)
            step = self.config.step_samples
            if step and self.samples >= step:
                self._due = True
            if self._due and not self._held:
                if self.owned:
                    self._lock.notify_all()  # the owner takes it
                else:
                    self._step()
        self._note_slow(
            "backward", micro_batch, arrived, replica=locked - arrived, compute=computed
        )
        return grad_input

    def abandon(self, micro_batch: bytes) -> bool:
        """The micro-batch will not come back (its path broke): drop its input now (a
        step it held back may be taken, a forward waiting for room may come in). Returns
        whether it was held here."""
        with self._lock:
            return self._abandon(micro_batch)

    def try_abandon(self, micro_batch: bytes) -> bool:
        """:meth:`abandon` if no compute holds the replica now (the event loop must not
        wait for one); returns whether it could look."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._abandon(micro_batch)
            return True
        finally:
            self._lock.release()

    def claimed_step(self) -> int | None:
        """(In ``before_step``.) The step the step being taken is at, as its micro-batches'
        drivers said: the median (the lower of two) of the steps they drove them at; None
        when none said one."""
        claims = sorted(self._stepping)
        return claims[(len(claims) - 1) // 2] if claims else None

    def withdraw(self, micro_batch: bytes) -> bool:
        """The micro-batch failed further on (its caller gave up on it): drop its input if
        held, so no backward of it comes in from now on; returns whether its gradient is
        in the accumulator all the same (its backward ran here first: the next step holds
        it, and ``on_step`` names it)."""
        with self._lock:
            self._abandon(micro_batch)
            return micro_batch in self._accumulated

    def open_session(self, session: bytes) -> bool:
        """A driver's session opens here: the inputs its forwards name it with are dropped
        when it ends. False: one of that name is open already. Never waits for a compute
        (the event loop calls it)."""
        with self._sessions_lock:
            if not session or session in self._sessions:
                return False
            self._sessions.add(session)
            return True

    def _session_open(self, session: bytes) -> bool:
        with self._sessions_lock:
            return session in self._sessions

    def close_session(self, session: bytes) -> None:
        """A driver's session is no longer open: forwards naming it from now on are refused
        (:meth:`end_session` then drops the inputs held under it). Never waits."""
        with self._sessions_lock:
            if session in self._sessions:
                self._sessions.discard(session)
                self._ended[session] = None
                while len(self._ended) > ENDED_KEPT:
                    self._ended.popitem(last=False)

    def end_session(self, session: bytes) -> int:
        """A driver's session ended (its call ended: the driver died or left): drop the
        inputs of its micro-batches held here now (a step they held back may be taken).
        Returns how many."""
        if not session:
            return 0
        self.close_session(session)
        with self._lock:
            names = [name for name, held in self._held.items() if held.session == session]
            for name in names:
                self._pop(name)
            if names:
                self.orphaned += len(names)
                self._lock.notify_all()
                logger.info(
                    "a driver's session ended: %d micro-batch input(s) of it dropped (%d so far)",
                    len(names), self.orphaned,
                )  # fmt: skip
            return len(names)

    def idle_s(self) -> float:
        """Seconds since a micro-batch last came in or went back, with no driver's session
        open here since; 0 while it holds any, while a driver's session is open (a driver
        that pauses keeps it), within ``silent_grace_s`` of a session falling silent, and
        before any micro-batch ever came."""
        worked_at = self._worked_at
        if worked_at is None or self._held or self._sessions:
            return 0.0
        since = worked_at
        if self._silent_at is not None:  # its driver may come back: as if open a while
            since = max(since, self._silent_at + self.config.silent_grace_s)
        return max(0.0, self.clock() - since)

    def fell_silent(self, session: bytes) -> int:
        """A driver's session ended because nothing came on it for the silence: as
        :meth:`end_session`, and the replica is not idle for ``silent_grace_s`` (the driver
        may come back). Returns the inputs dropped."""
        self._silent_at = self.clock()
        return self.end_session(session)

    @property
    def sessions(self) -> int:
        """Drivers' sessions open here now."""
        return len(self._sessions)

    def _abandon(self, micro_batch: bytes) -> bool:
        held = self._pop(micro_batch) is not None
        if held:
            self._lock.notify_all()
        return held

    def step(self, optimizer: torch.optim.Optimizer) -> int:
        """One optimizer step on the mean gradient of the micro-batches accumulated;
        returns their count. Refused while a micro-batch is in flight (its backward must
        run against the weights its forward used)."""
        with self._lock:
            self._expire()
            if self._held:
                raise RuntimeError(f"{len(self._held)} micro-batch(es) in flight: not stepping")
            return self._step(optimizer)

    def take_step(self, timeout: float, *, now: bool = False) -> int | None:
        """(An owned replica's owner.) Wait until a step is due and no micro-batch is in
        flight, then take it: the optimizer steps on the mean gradient of the micro-batches
        accumulated. Returns their sequences (None: no step came due within ``timeout``).
        Forwards wait until :meth:`release`: what the owner does meanwhile (a round) lands
        under no micro-batch. ``now``: do not wait for a due step: step on what is
        accumulated (fewer sequences than a step, or none: then nothing steps) as soon as
        no micro-batch is in flight (the owner has a round to land and no step is coming)."""
        if not self.owned:
            raise RuntimeError("this replica takes its own steps")
        deadline = self.clock() + timeout
        with self._lock:
            was_due = self._due
            if now:
                self._due = True  # forwards wait from here on
            while not self._closed:
                self._expire()
                if self._due and not self._held:
                    samples = self.samples
                    self._apply_step(self.optimizer)
                    self._holding = True
                    return samples
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._lock.wait(timeout=min(1.0, left))
            if now and not was_due:  # nothing taken: the forwards that waited go on
                self._due = False
                self._lock.notify_all()
            return None

    def release(self) -> None:
        """(An owned replica's owner.) The step taken, the forwards waiting go on."""
        with self._lock:
            self._due = self._holding = False
            self._lock.notify_all()

    def _step(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        n = self._apply_step(optimizer or self.optimizer)
        self._due = False
        self._lock.notify_all()
        return n

    def _apply_step(self, optimizer: torch.optim.Optimizer | None) -> int:
        assert optimizer is not None and not self._held
        n = self.micro_batches
        names, self._accumulated = self._accumulated, []
        self._stepping, self._claims = self._claims, []
        stepped = False
        if n:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            for grad in grads:
                grad.div_(n)
            if grads and not bool(torch.isfinite(torch.nn.utils.get_total_norm(grads))):
                # What passed the wire's checks still made a gradient that is not finite:
                # this step's micro-batches are lost, not the replica's weights.
                self.skipped += 1
                logger.warning(
                    "the mean gradient of %d micro-batch(es) holds NaN or Inf: step not "
                    "taken (%d so far)", n, self.skipped,
                )  # fmt: skip
            else:
                if self.before_step is not None:
                    self.before_step()
                optimizer.step()
                self.steps += 1
                stepped = True
            optimizer.zero_grad(set_to_none=True)
        self.micro_batches = self.samples = 0
        if names and self.on_step is not None:
            self.on_step(names, stepped)
        return n

    def _hold(self, micro_batch: bytes, held: _Held) -> None:
        self._held[micro_batch] = held
        self._held_bytes += _nbytes(held)

    def _pop(self, micro_batch: bytes) -> _Held | None:
        held = self._held.pop(micro_batch, None)
        if held is not None:
            self._held_bytes -= _nbytes(held)
        return held

    def _full(self) -> bool:
        """Whether the micro-batches accumulated and in flight make a step already: a
        forward more waits for that step (no step is on more than the run's batch)."""
        step = self.config.step_samples
        if not step:
            return False
        held = sum(int(h.input.shape[0]) for h in self._held.values())
        return self.samples + held >= step

    def _wait_for_a_due_step(self) -> None:
        """While a step is due, or the step's sequences are all admitted already, wait for
        the micro-batches in flight to come back (or expire) and the step to be taken;
        refuse as busy past ``due_wait_s``."""
        deadline = self.clock() + min(self.config.due_wait_s, self.config.inflight_s)
        held_until = self.clock() + self.config.hold_wait_s
        self._expire()
        self.waiting += 1
        try:
            while self._due or self._full():
                self._check_open()
                if self._holding and self.clock() >= held_until:
                    raise Rejection("busy", "this replica is between two steps (a round)")
                if self.clock() >= deadline:
                    raise Rejection("busy", "a step is due and micro-batches are still in flight")
                if self._due and not self._held:
                    if not self.owned:  # the last ones in flight expired: take it here
                        self._step()
                        continue
                    self._lock.notify_all()  # the owner takes it
                self._lock.wait(timeout=min(0.1, self.config.hold_wait_s))
                self._expire()
        finally:
            self.waiting -= 1

    def _expire(self) -> None:
        wait = self.config.inflight_s
        if self._trips:  # (none measured yet: the most)
            wait = min(wait, max(self.config.inflight_floor_s, 4.0 * max(self._trips)))
        limit = self.clock() - wait
        while self._held:
            name, held = next(iter(self._held.items()))
            if held.at > limit:
                break
            self._pop(name)
            self.dropped += 1
            logger.warning(
                "micro-batch %s: no backward within %.0f s, its input dropped (its driver "
                "gave up or died; %d so far)", name.hex()[:12], wait, self.dropped,
            )  # fmt: skip


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _nbytes(held: _Held) -> int:
    return held.input.nbytes + (0 if held.targets is None else held.targets.nbytes)
