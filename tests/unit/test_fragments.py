import pytest
import torch

from swarmloco.core.flat import FlatLayout
from swarmloco.core.fragments import FragmentSchedule, StreamingConfig, assign_fragments
from swarmloco.train.model import GPT, layer_unit
from swarmloco.train.spec import GPTConfig


def _gpt() -> GPT:
    return GPT(GPTConfig(n_layer=6, n_embd=32, n_head=2, seq_len=16))


@pytest.mark.parametrize("fragments", [1, 2, 3, 4, 8])
def test_every_parameter_in_exactly_one_fragment(fragments):
    model = _gpt()
    names = [n for n, _ in model.named_parameters()]
    frag = assign_fragments([layer_unit(n) for n in names], fragments)
    assert len(frag) == len(names)
    assert set(frag) == set(range(fragments))
    # Strided: block i sits in fragment (i + 1) % F (unit 0 is the embeddings).
    for name, f in zip(names, frag):
        if name.startswith("blocks."):
            assert f == (int(name.split(".")[1]) + 1) % fragments
    layout = FlatLayout([(n, tuple(p.shape)) for n, p in model.named_parameters()], frag, 64)
    covered = torch.zeros(layout.numel, dtype=torch.int32)
    for slot in layout.slots:
        covered[slot.start : slot.start + slot.numel] += 1
        a, b = layout.fragment_ranges[slot.fragment]
        assert a <= slot.start and slot.start + slot.numel <= b
    assert int(covered.max()) == 1
    assert int(covered.sum()) == sum(p.numel() for p in model.parameters())
    for a, b in layout.fragment_ranges:
        assert a % 64 == 0 and b % 64 == 0


def test_too_many_fragments_is_a_clear_error():
    with pytest.raises(ValueError, match="too few for 9 fragments"):
        assign_fragments(["a", "b", "a", "c"] * 2, 9)


@pytest.mark.parametrize("h,f,tau", [(50, 1, 0), (50, 3, 5), (10, 10, 0), (12, 4, 11), (7, 2, 3)])
def test_each_fragment_syncs_once_per_period(h, f, tau):
    sched = FragmentSchedule(StreamingConfig(sync_every=h, fragments=f, delay=tau))
    horizon = 10 * h
    starts = {i: [] for i in range(f)}
    lands = {i: [] for i in range(f)}
    for step in range(1, horizon + 1):
        for frag in sched.starts_after(step):
            starts[frag].append(step)
        for frag in sched.lands_after(step):
            lands[frag].append(step)
    for frag in range(f):
        assert len(starts[frag]) == 10
        gaps = {b - a for a, b in zip(starts[frag], starts[frag][1:])}
        assert gaps == {h}
        assert starts[frag][0] <= h
        assert [s + tau for s in starts[frag] if s + tau <= horizon] == lands[frag]
        assert sched.next_start(frag, starts[frag][0] - 1) == starts[frag][0]
        assert sched.next_start(frag, starts[frag][0]) == starts[frag][1]
    # Staggered: no two fragments start at the same step.
    all_starts = [s for v in starts.values() for s in v]
    assert len(all_starts) == len(set(all_starts))
    # Plain DiLoCo syncs after steps H, 2H, ...
    if f == 1:
        assert starts[0][:3] == [h, 2 * h, 3 * h]


def test_schedule_validation():
    with pytest.raises(ValueError, match="delay"):
        StreamingConfig(sync_every=10, delay=10)
    with pytest.raises(ValueError, match="fragments"):
        StreamingConfig(sync_every=4, fragments=5)
    with pytest.raises(ValueError, match="alpha"):
        StreamingConfig(alpha=1.5)


def test_gather_scatter_lerp_round_trip():
    model = _gpt()
    params = [p for _, p in model.named_parameters()]
    names = [n for n, _ in model.named_parameters()]
    layout = FlatLayout(
        [(n, tuple(p.shape)) for n, p in model.named_parameters()],
        assign_fragments([layer_unit(n) for n in names], 3),
        64,
    )
    flat = layout.gather(params, layout.zeros())
    other = _gpt()
    other_params = [p for _, p in other.named_parameters()]
    layout.scatter(flat, other_params, fragment=1)
    for slot, a, b in zip(layout.slots, params, other_params):
        assert torch.equal(a, b) == (slot.fragment == 1) or torch.equal(a, b)
    layout.scatter(flat, other_params)
    assert all(torch.equal(a, b) for a, b in zip(params, other_params))
    with torch.no_grad():
        for p in other_params:
            p.add_(1.0)
    layout.lerp_into(flat, other_params, 0.5)
    for a, b in zip(params, other_params):
        torch.testing.assert_close(b, a + 0.5)
    layout.lerp_into(flat, other_params, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(params, other_params))
