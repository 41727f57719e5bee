"""One stage replica alone: inputs held within a bound, each backward added once and
against the weights its forward used, the step refused while a micro-batch is in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarmloco.net.rejections import Rejection
from swarmloco.pipeline.replica import ReplicaConfig, StageReplica


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def replica(**config: object) -> tuple[StageReplica, torch.nn.Linear, Clock]:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    clock = Clock()
    return StageReplica(module, first=False, last=False, config=ReplicaConfig(**config),
                        clock=clock), module, clock  # fmt: skip


def test_a_retried_backward_is_answered_again_and_added_once():
    r, module, _ = replica()
    x, dy = torch.randn(2, 4), torch.ones(2, 4)
    r.forward(b"a" * 16, x)
    first = r.backward(b"a" * 16, dy)
    grad = module.weight.grad.clone()
    again = r.backward(b"a" * 16, dy)
    assert again is first and torch.equal(module.weight.grad, grad)
    assert r.micro_batches == 1 and r.samples == 2
    torch.testing.assert_close(first, dy @ module.weight)
    with pytest.raises(Rejection) as refused:
        r.forward(b"a" * 16, x)  # a name never comes twice
    assert refused.value.code == "malformed"


def test_inputs_are_held_within_the_bound_and_expire():
    r, _, clock = replica(max_inflight=2, inflight_s=10.0)
    r.forward(b"a" * 16, torch.randn(1, 4))
    r.forward(b"b" * 16, torch.randn(1, 4))
    with pytest.raises(Rejection) as refused:
        r.forward(b"c" * 16, torch.randn(1, 4))
    assert refused.value.code == "busy"
    clock.now = 11.0
    r.forward(b"c" * 16, torch.randn(1, 4))  # the two before expired
    assert r.inflight == 1 and r.dropped == 2
    with pytest.raises(Rejection) as refused:
        r.backward(b"a" * 16, torch.ones(1, 4))
    assert refused.value.code == "unknown"


def test_a_dead_drivers_micro_batch_is_dropped_once_it_waited_far_longer_than_any_other():
    """A driver that died can abandon nothing: its micro-batch is dropped past the floor
    and four times the longest forward-to-backward here (not the whole ``inflight_s``),
    and only once there is such a measure."""
    r, _, clock = replica(inflight_s=120.0, inflight_floor_s=30.0)
    r.forward(b"a" * 16, torch.randn(1, 4))
    clock.now = 100.0
    r.forward(b"b" * 16, torch.randn(1, 4))  # nothing measured yet: a is held on
    assert r.inflight == 2 and r.dropped == 0
    r.backward(b"a" * 16, torch.ones(1, 4))  # 100 s from forward to backward
    r.forward(b"c" * 16, torch.randn(1, 4))  # b waited 0 s: held
    clock.now = 219.0
    r.forward(b"d" * 16, torch.randn(1, 4))
    assert r.inflight == 3 and r.dropped == 0  # 4 x 100 s is past inflight_s: 120 s
    clock.now = 221.0
    r.forward(b"e" * 16, torch.randn(1, 4))  # b and c waited past 120 s
    assert r.inflight == 2 and r.dropped == 2
    r.backward(b"d" * 16, torch.ones(1, 4))  # 2 s: the longest of the last is still 100 s
    s, _, clock = replica(inflight_s=120.0, inflight_floor_s=30.0)
    s.forward(b"a" * 16, torch.randn(1, 4))
    clock.now = 2.0
    s.backward(b"a" * 16, torch.ones(1, 4))  # the round trip here: 2 s
    s.forward(b"b" * 16, torch.randn(1, 4))  # its driver dies
    clock.now = 31.0
    s.forward(b"c" * 16, torch.randn(1, 4))
    assert s.inflight == 2 and s.dropped == 0  # 29 s: within the floor
    clock.now = 32.5
    s.forward(b"d" * 16, torch.randn(1, 4))
    assert s.dropped == 1  # b: past 30 s and 4 x 2 s
    with pytest.raises(Rejection) as refused:
        s.backward(b"b" * 16, torch.ones(1, 4))  # a backward too late fails its micro-batch
    assert refused.value.code == "unknown"


def test_a_sessions_end_drops_its_inputs_at_once_and_what_they_held_back_goes_on():
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    clock = Clock()  # never moves: nothing expires here
    config = ReplicaConfig(step_samples=2)
    r = StageReplica(module, first=False, last=False, config=config, optimizer=opt, clock=clock)
    alive, dead = b"L" * 16, b"D" * 16
    assert r.open_session(alive) and r.open_session(dead) and r.sessions == 2
    assert not r.open_session(dead) and not r.open_session(b"")  # one of a name at a time
    r.forward(b"a" * 16, torch.randn(1, 4), session=dead)  # its driver dies before the backward
    r.forward(b"b" * 16, torch.randn(1, 4), session=alive)
    r.backward(b"b" * 16, torch.ones(1, 4))
    # The step's two sequences are b's and a's: a forward more waits for a, which never comes.
    came: list[torch.Tensor] = []
    waiting = threading.Thread(
        target=lambda: came.append(r.forward(b"c" * 16, torch.randn(1, 4), session=alive))
    )
    waiting.start()
    assert r.end_session(dead) == 1 and r.orphaned == 1 and r.dropped == 0
    waiting.join(timeout=60)
    assert len(came) == 1 and r.inflight == 1  # c came in: a's place was free at once
    r.backward(b"c" * 16, torch.ones(1, 4))
    assert r.steps == 1  # on b and c
    with pytest.raises(Rejection) as refused:
        r.backward(b"a" * 16, torch.ones(1, 4))
    assert refused.value.code == "unknown"
    # A forward naming a session that ended (or was never open here) is not held.
    with pytest.raises(Rejection, match="session") as refused:
        r.forward(b"d" * 16, torch.randn(1, 4), session=dead)
    assert refused.value.code == "busy" and r.sessions == 1
    assert r.orphaned == 2  # a's input, and d: its dead driver's forward, not held
    with pytest.raises(Rejection, match="session"):
        r.forward(b"f" * 16, torch.randn(1, 4), session=b"N" * 16)  # never open here
    assert r.orphaned == 2 and r.inflight == 0
    r.forward(b"e" * 16, torch.randn(1, 4))
    assert r.end_session(alive) == 0 and r.inflight == 1  # e named no session: kept


def test_inputs_held_are_bounded_in_bytes_too_and_one_is_always_taken():
    r, _, clock = replica(max_held_bytes=64, inflight_s=10.0)  # two inputs of 2 x 4 fp32
    r.forward(b"a" * 16, torch.randn(2, 4))
    r.forward(b"b" * 16, torch.randn(2, 4))
    with pytest.raises(Rejection) as refused:
        r.forward(b"c" * 16, torch.randn(2, 4))
    assert refused.value.code == "busy" and "64 bytes" in refused.value.reason
    r.backward(b"a" * 16, torch.ones(2, 4))
    r.forward(b"c" * 16, torch.randn(2, 4))  # room again
    assert r.abandon(b"b" * 16)
    clock.now = 11.0
    r.forward(b"d" * 16, torch.randn(16, 4))  # c expired: nothing held, a big one is taken
    assert r.inflight == 1 and r.dropped == 1
    with pytest.raises(Rejection, match="bytes of inputs held"):
        r.forward(b"e" * 16, torch.randn(1, 4))
    r.backward(b"d" * 16, torch.ones(16, 4))
    r.forward(b"e" * 16, torch.randn(1, 4))


def test_try_abandon_drops_at_once_or_says_a_compute_holds_the_replica():
    r, _, _ = replica()
    r.forward(b"a" * 16, torch.randn(2, 4))
    looked: list[bool] = []
    with r._lock:  # a compute holds the replica: the event loop must not wait for it
        other = threading.Thread(target=lambda: looked.append(r.try_abandon(b"a" * 16)))
        other.start()
        other.join(timeout=30)
    assert looked == [False] and r.inflight == 1
    assert r.try_abandon(b"a" * 16) and r.inflight == 0


def test_no_step_while_a_micro_batch_is_between_its_forward_and_backward():
    r, module, _ = replica()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for name in (b"a" * 16, b"b" * 16):
        r.forward(name, torch.randn(3, 4))
    r.backward(b"a" * 16, torch.ones(3, 4))
    before = module.weight.detach().clone()
    with pytest.raises(RuntimeError, match="in flight"):
        r.step(opt)
    assert torch.equal(module.weight, before)
    r.backward(b"b" * 16, torch.ones(3, 4))
    grad = module.weight.grad.clone() / 2  # the mean of the two micro-batches
    assert r.step(opt) == 2
    torch.testing.assert_close(module.weight.detach(), before - 0.1 * grad)
    assert module.weight.grad is None and r.micro_batches == 0


def stepping(lr: float = 0.1, **config: object) -> tuple[StageReplica, torch.nn.Linear]:
    """A replica that steps SGD itself every ``step_samples`` (in ``config``)."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    config = ReplicaConfig(**config)  # type: ignore[arg-type]
    return StageReplica(module, first=False, last=False, optimizer=opt, config=config), module


def park(
    r: StageReplica, name: bytes, x: torch.Tensor, seen: list[torch.Tensor]
) -> threading.Thread:
    """A forward on a thread of its own, returned once it waits for a step."""
    call = threading.Thread(target=lambda: seen.append(r.forward(name, x)))
    call.start()
    deadline = time.monotonic() + 30
    while r.waiting == 0 and call.is_alive() and time.monotonic() < deadline:
        call.join(timeout=0.01)
    assert r.waiting == 1 and not seen
    return call


def test_a_replica_admits_a_steps_sequences_and_holds_the_next_forward_until_the_step():
    """Admission by step samples: a forward past the step's sequences (accumulated plus
    in flight) waits for the step, which is on exactly the run's batch, and then runs
    against the new weights."""
    r, module = stepping(step_samples=4, inflight_s=30.0, due_wait_s=30.0)
    stepped_on: list[int] = []
    r.before_step = lambda: stepped_on.append(r.samples)
    x = torch.randn(2, 4)
    for name in (b"a" * 16, b"b" * 16):
        r.forward(name, x)
    seen: list[torch.Tensor] = []
    late = park(r, b"c" * 16, x, seen)  # 4 sequences in flight: a step's worth
    r.backward(b"a" * 16, torch.ones(2, 4))
    late.join(timeout=0.2)
    assert late.is_alive() and r.steps == 0 and not seen  # b is still in flight
    before = module.weight.detach().clone()
    r.backward(b"b" * 16, torch.ones(2, 4))  # the step's last one back: it steps
    late.join(timeout=30)
    assert not late.is_alive() and r.steps == 1 and stepped_on == [4]
    assert not torch.equal(module.weight, before)
    torch.testing.assert_close(seen[0], module(x).detach())  # the new weights
    assert r.inflight == 1 and r.samples == 0


def test_an_abandoned_micro_batch_lets_the_step_and_the_waiting_forward_go_on():
    r, _ = stepping(step_samples=4, inflight_s=600.0, due_wait_s=600.0)
    x = torch.randn(2, 4)
    r.forward(b"a" * 16, x)
    r.forward(b"b" * 16, x)
    r.backward(b"a" * 16, torch.ones(2, 4))
    seen: list[torch.Tensor] = []
    late = park(r, b"c" * 16, x, seen)
    assert r.abandon(b"b" * 16) and not r.abandon(b"b" * 16)  # its path broke later on
    late.join(timeout=30)  # room for it now: 2 accumulated, 2 in flight
    assert not late.is_alive() and len(seen) == 1 and r.steps == 0
    r.backward(b"c" * 16, torch.ones(2, 4))
    assert r.steps == 1 and r.inflight == 0


def test_however_many_callers_push_at_once_no_step_is_on_more_than_a_micro_batch_over():
    """Eight callers, micro-batches of 1 to 3 sequences, a step of 6: each step is on 6
    to 8 sequences (admitted while fewer than 6 were), never one caller's worth more."""
    r, _ = stepping(lr=0.01, step_samples=6, inflight_s=600.0, due_wait_s=600.0)
    stepped_on: list[int] = []
    r.before_step = lambda: stepped_on.append(r.samples)
    failures: list[BaseException] = []

    def caller(k: int) -> None:
        try:
            for i in range(12):
                n = 1 + (k + i) % 3
                name = bytes([k, i]) * 8
                r.forward(name, torch.randn(n, 4))
                r.backward(name, torch.ones(n, 4))
        except BaseException as exc:  # reported below
            failures.append(exc)

    callers = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=120)
    assert not failures and not any(c.is_alive() for c in callers)
    assert stepped_on and all(6 <= n <= 8 for n in stepped_on), stepped_on
    assert sum(stepped_on) + r.samples == sum(1 + (k + i) % 3 for k in range(8) for i in range(12))


def test_an_owned_replicas_owner_takes_its_steps_while_new_forwards_wait():
    """A stage peer's thread takes each due step and runs its rounds before releasing the
    replica: forwards that come meanwhile wait, so nothing the owner does between
    ``take_step`` and ``release`` lands under a micro-batch."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="owner takes its steps"):
        StageReplica(module, first=False, last=False, optimizer=opt, owned=True)
    r = StageReplica(module, first=False, last=False, optimizer=opt, owned=True,
                     config=ReplicaConfig(step_samples=4, inflight_s=600.0,
                                          hold_wait_s=600.0))  # fmt: skip
    x = torch.randn(2, 4)
    assert r.take_step(timeout=0.0) is None  # nothing due
    for name in (b"a" * 16, b"b" * 16):
        r.forward(name, x)
        r.backward(name, torch.ones(2, 4))
    grad = module.weight.grad.clone() / 2
    before = module.weight.detach().clone()
    assert r.steps == 0  # due, but the owner steps, not the backward
    assert r.take_step(timeout=30.0) == 4
    torch.testing.assert_close(module.weight.detach(), before - 0.1 * grad)
    seen: list[torch.Tensor] = []
    waiting = threading.Thread(target=lambda: seen.append(r.forward(b"c" * 16, x)))
    waiting.start()
    deadline = time.monotonic() + 30
    while r.waiting == 0 and waiting.is_alive() and time.monotonic() < deadline:
        waiting.join(timeout=0.01)  # until the forward is parked on the step in hand
    assert r.waiting == 1 and not seen
    with torch.no_grad():
        module.weight.add_(1.0)  # what the owner's round does to the weights
    r.release()
    waiting.join(timeout=30)
    assert not waiting.is_alive() and r.steps == 1
    torch.testing.assert_close(seen[0], module(x).detach())  # computed after the round


def test_a_forward_held_up_by_its_owners_round_is_refused_as_busy_after_a_while():
    """A round between two steps may take long: a forward waits ``hold_wait_s`` at most,
    then its driver is told to draw another replica."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    r = StageReplica(module, first=False, last=False, optimizer=opt, owned=True,
                     config=ReplicaConfig(step_samples=2, hold_wait_s=0.05))  # fmt: skip
    x = torch.randn(2, 4)
    r.forward(b"a" * 16, x)
    r.backward(b"a" * 16, torch.ones(2, 4))
    assert r.take_step(timeout=30.0) == 2  # ... and the owner never releases it
    with pytest.raises(Rejection) as refused:
        r.forward(b"b" * 16, x)
    assert refused.value.code == "busy" and "between two steps" in refused.value.reason
    r.release()
    r.forward(b"b" * 16, x)  # once released, it takes micro-batches again
    r.close()
    with pytest.raises(Rejection, match="leaving"):
        r.forward(b"c" * 16, x)
    assert r.take_step(timeout=30.0) is None  # closed: the owner stops waiting at once


def test_the_owner_sees_the_mean_gradient_before_each_step():
    """``before_step`` runs on the mean gradient, before the optimizer steps: where a stage
    peer sets its learning rate and clips."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    r = StageReplica(module, first=False, last=False, optimizer=opt,
                     config=ReplicaConfig(step_samples=4))  # fmt: skip
    seen: list[torch.Tensor] = []

    def before() -> None:
        seen.append(module.weight.grad.clone())
        opt.param_groups[0]["lr"] = 0.0  # a schedule at zero: the step changes nothing

    r.before_step = before
    before_weights = module.weight.detach().clone()
    x = torch.randn(2, 4)
    for name in (b"a" * 16, b"b" * 16):
        r.forward(name, x)
        r.backward(name, torch.ones(2, 4))
    assert r.steps == 1 and len(seen) == 1
    torch.testing.assert_close(seen[0], torch.ones(2, 4).T @ x)  # the mean of two equal ones
    assert torch.equal(module.weight.detach(), before_weights)


def test_a_step_is_at_the_median_of_the_steps_its_micro_batches_drivers_said():
    """A later stage's learning rate follows stage 0's step, as the drivers of a step's
    micro-batches said it: the median (a lone liar among three moves nothing); one that did
    not come back, or said none, counts for nothing; a step none said one for has none."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    r = StageReplica(module, first=False, last=False, optimizer=opt,
                     config=ReplicaConfig(step_samples=8))  # fmt: skip
    seen: list[int | None] = []
    r.before_step = lambda: seen.append(r.claimed_step())
    x = torch.randn(2, 4)
    r.forward(b"z" * 16, x, step=0)  # abandoned: its step is not the step's
    r.abandon(b"z" * 16)
    for name, step in ((b"a", 40), (b"b", 2**64 - 1), (b"c", None), (b"d", 42)):
        r.forward(name * 16, x, step=step)
        r.backward(name * 16, torch.ones(2, 4))
    for name in (b"e", b"f", b"g", b"h"):
        r.forward(name * 16, x)
        r.backward(name * 16, torch.ones(2, 4))
    assert r.steps == 2 and seen == [42, None]


def test_a_slow_call_is_logged_with_where_its_time_went(monkeypatch, caplog):
    """A driver's deadline is tens of seconds; a call that comes near it says whether it
    waited for the replica, for a due step, or computed (here every call counts as slow)."""
    from swarmloco.pipeline import replica as replica_module

    monkeypatch.setattr(replica_module, "SLOW_CALL_S", 0.0)
    r, _, _ = replica()
    with caplog.at_level("WARNING", logger="swarmloco.pipeline.replica"):
        r.forward(b"a" * 16, torch.randn(2, 4))
        r.backward(b"a" * 16, torch.ones(2, 4))
    forward, backward = (rec.getMessage() for rec in caplog.records)
    assert forward.startswith(f"a forward of micro-batch {(b'a' * 16).hex()[:12]} took")
    assert "on cpu (replica " in forward and ", step " in forward and ", compute " in forward
    assert backward.startswith("a backward of micro-batch") and ", compute " in backward


def test_under_bf16_autocast_a_backward_recomputes_what_its_forward_sent():
    """A GPU stage computes under bf16 autocast: the output crosses the wire as fp32, the
    backward's recompute runs under the same autocast (its gradients are those of the
    output that was sent), and parameters and gradients stay fp32."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    r = StageReplica(module, first=False, last=False, autocast=torch.bfloat16)
    x, dy = torch.randn(3, 8), torch.randn(3, 8)
    out = r.forward(b"a" * 16, x)
    assert out.dtype == torch.float32
    grad_input = r.backward(b"a" * 16, dy)
    want_x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = module(want_x)
    assert torch.equal(out, want.detach().float())  # what was sent is what was recomputed
    grads = torch.autograd.grad(want, [want_x, *module.parameters()], dy.to(want.dtype))
    assert grad_input is not None and grad_input.dtype == torch.float32
    torch.testing.assert_close(grad_input, grads[0].float())
    for p, g in zip(module.parameters(), grads[1:], strict=True):
        assert p.dtype == p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, g.float())
    plain = module(x)  # fp32: close to the bf16 compute, not equal
    assert 0 < (plain - out).abs().max() < 0.1
    with pytest.raises(ValueError, match="fp16"):
        StageReplica(module, first=False, last=False, autocast=torch.float16)


def test_a_step_whose_gradient_is_not_finite_is_not_taken():
    """One micro-batch whose gradient overflowed (what the wire's checks let through can
    still overflow a layer) costs its step, not the replica's weights."""
    r, module, _ = replica()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    weights = module.weight.detach().clone()
    r.forward(b"a" * 16, torch.randn(2, 4))
    r.forward(b"b" * 16, torch.randn(2, 4))
    r.backward(b"a" * 16, torch.ones(2, 4))
    r.backward(b"b" * 16, torch.full((2, 4), float("inf")))
    assert r.step(optimizer) == 2
    assert torch.equal(module.weight, weights) and r.skipped == 1 and r.steps == 0
    assert module.weight.grad is None and r.micro_batches == 0
    r.forward(b"c" * 16, torch.randn(2, 4))
    r.backward(b"c" * 16, torch.ones(2, 4))
    r.step(optimizer)  # the next one steps
    assert r.steps == 1 and bool(torch.isfinite(module.weight).all())
    assert not torch.equal(module.weight, weights)


class Dropped(torch.nn.Module):
    """A stage with dropout: its answers depend on the generator its forward draws from."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.linear(x))


def test_an_audit_computes_what_forward_and_backward_gave_and_keeps_nothing():
    """A second replica with the same weights, audited with the micro-batch's seed, answers
    exactly what the first did (dropout included), holds no input, adds no gradient, and
    leaves the process's generator where it was; the seed, not the generator, decides."""
    torch.manual_seed(0)
    used, auditor = Dropped(), Dropped()
    auditor.load_state_dict(used.state_dict())
    a = StageReplica(used, first=False, last=False)
    b = StageReplica(auditor, first=False, last=False)
    x, dy = torch.randn(3, 4), torch.randn(3, 4)
    out = a.forward(b"a" * 16, x, seed=1234)
    grad = a.backward(b"a" * 16, dy)
    generator = torch.get_rng_state()
    again, grad_again = b.audit(x, None, dy, seed=1234)
    assert torch.equal(torch.get_rng_state(), generator)
    torch.testing.assert_close(again, out)
    torch.testing.assert_close(grad_again, grad)
    assert b.inflight == 0 and b.micro_batches == 0
    assert all(p.grad is None for p in auditor.parameters())
    other, _ = b.audit(x, None, dy, seed=99)  # another seed: other units dropped
    assert not torch.equal(other, out)
    with pytest.raises(Rejection) as refused:
        b.audit(x, None, torch.randn(3, 5), seed=1)
    assert refused.value.code == "bad-shape"
    with pytest.raises(Rejection) as refused:
        b.audit(x, None, None)
    assert refused.value.code == "malformed"


def test_an_audit_is_refused_while_the_owner_holds_the_replica():
    """Between a step and its release the owner's round may change the weights: an audit
    then would compare answers of weights that never served a micro-batch."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    r = StageReplica(module, first=False, last=False, optimizer=opt, owned=True,
                     config=ReplicaConfig(step_samples=2))  # fmt: skip
    x = torch.randn(2, 4)
    r.forward(b"a" * 16, x)
    r.backward(b"a" * 16, torch.ones(2, 4))
    assert r.take_step(timeout=30.0) == 2
    with pytest.raises(Rejection) as refused:
        r.audit(x, None, torch.ones(2, 4))
    assert refused.value.code == "busy"
    r.release()
    out, _ = r.audit(x, None, torch.ones(2, 4))
    torch.testing.assert_close(out, module(x).detach())


def test_a_replica_is_idle_once_work_came_and_went_with_no_drivers_session_open():
    r, _, clock = replica()
    clock.now = 100.0
    assert r.idle_s() == 0.0  # no micro-batch ever came: its drivers have yet to start
    r.forward(b"a" * 16, torch.randn(1, 4))
    clock.now = 110.0
    assert r.idle_s() == 0.0  # it holds one
    r.backward(b"a" * 16, torch.ones(1, 4))
    clock.now = 115.0
    assert r.idle_s() == 5.0
    assert r.open_session(b"S" * 16)
    assert r.idle_s() == 0.0  # a driver that pauses keeps its session
    r.end_session(b"S" * 16)
    assert r.idle_s() == 5.0  # counted from the last micro-batch
    # A session that fell silent (its driver froze, or its network went away) may come
    # back: not idle for the grace after (120 s by default), as if it were still open.
    assert r.open_session(b"T" * 16)
    clock.now = 130.0
    r.fell_silent(b"T" * 16)
    assert r.sessions == 0 and r.idle_s() == 0.0
    clock.now = 130.0 + 119.0
    assert r.idle_s() == 0.0
    clock.now = 130.0 + 125.0
    assert r.idle_s() == 5.0
