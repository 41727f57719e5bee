"""The reducer of one part, without sockets: sums, deadlines, exclusions and refusals."""

import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.core.codec import CodecConfig, ErrorFeedback, chunk_spans, dequantize, quantize
from swarmloco.errors import RoundAborted
from swarmloco.net.averaging.reduction import PartReduction
from swarmloco.net.rejections import Rejection

CODEC = CodecConfig(block_size=64, chunk_bytes=4 * (64 + 4), backend="eager")  # 4 blocks a chunk
NUMEL = 64 * 10  # 3 chunks: 4 + 4 + 2 blocks


def make(
    senders=(0, 1, 2),
    weights=(1.0, 2.0, 3.0),
    timeout=1.0,
    now=0.0,
    *,
    codec=CODEC,
    take=None,
    norm_bound=float("inf"),
    **agg,
):
    return PartReduction(
        part=0,
        epoch=0,
        spans=chunk_spans(NUMEL, codec),
        weights=list(weights),
        senders=senders,
        codec=codec,
        aggregator=AggregatorConfig(**agg),
        timeout=timeout,
        now=now,
        norm_bound=norm_bound,
        take=take,
    )


def chunks_of(x: torch.Tensor):
    q, s = quantize(x, CODEC)
    return [
        (q[span.start : span.stop], s[span.first_block : span.first_block + span.blocks])
        for span in chunk_spans(NUMEL, CODEC)
    ]


def decoded(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize(x, CODEC)
    return dequantize(q, s, 64, "eager")


def finish_all(reduction: PartReduction) -> list[tuple[int, torch.Tensor, list[int]]]:
    out = []
    while reduction.ready():
        index, q, s, contributors = reduction.finish()
        out.append((index, dequantize(q, s, 64, "eager"), contributors))
    return out


def test_the_mean_is_weighted_and_chunks_complete_in_order():
    xs = [torch.randn(NUMEL) for _ in range(3)]
    r = make()
    parts = [chunks_of(x) for x in xs]
    for sender in (0, 1):
        for k, (q, s) in enumerate(parts[sender]):
            assert r.accept(sender, k, q, s, now=0.1)
    assert not r.ready()  # sender 2 has delivered nothing
    r.accept(2, 0, *parts[2][0], now=0.2)
    done = finish_all(r)
    assert [k for k, _, _ in done] == [0] and done[0][2] == [0, 1, 2]
    for k in (1, 2):
        r.accept(2, k, *parts[2][k], now=0.3)
    done += finish_all(r)
    assert r.done and [k for k, _, _ in done] == [0, 1, 2]
    mean = torch.cat([t for _, t, _ in done])
    exact = (decoded(xs[0]) + 2 * decoded(xs[1]) + 3 * decoded(xs[2])) / 6
    bound = max(x.abs().max() for x in xs) / 127
    assert (mean - exact).abs().max() <= bound
    assert r.included() == {0: 3, 1: 3, 2: 3}


def test_a_sender_that_stops_is_excluded_and_each_chunk_keeps_an_exact_mean():
    xs = [torch.randn(NUMEL) for _ in range(3)]
    parts = [chunks_of(x) for x in xs]
    r = make(timeout=1.0)
    for k in range(3):
        r.accept(0, k, *parts[0][k], now=0.0, remote=False)
        r.accept(1, k, *parts[1][k], now=0.1)
    r.accept(2, 0, *parts[2][0], now=0.2)  # then silence
    assert r.next_deadline() == pytest.approx(1.1)  # chunk 1 first arrived at 0.1
    assert r.expire(1.0) == []
    assert r.expire(1.2) == [2]
    assert "missed the deadline of chunk 1" in r.left[2]
    done = finish_all(r)
    assert [c for _, _, c in done] == [[0, 1, 2], [0, 1], [0, 1]]
    assert r.included() == {0: 3, 1: 3, 2: 1}
    exact_k1 = (decoded(xs[0]) + 2 * decoded(xs[1])) / 3
    span = chunk_spans(NUMEL, CODEC)[1]
    assert torch.allclose(done[1][1], exact_k1[span.start : span.stop], atol=0.05)
    # Its late chunk is ignored, not refused.
    assert r.accept(2, 1, *parts[2][1], now=1.3) is False


def test_a_lagging_sender_is_excluded_once_far_behind_the_others():
    xs = [torch.randn(NUMEL) for _ in range(3)]
    parts = [chunks_of(x) for x in xs]
    r = make(timeout=1.0)
    for k in range(3):
        r.accept(0, k, *parts[0][k], now=0.0, remote=False)
    # Sender 2 keeps delivering, but 1.0 s behind sender 1 on every chunk.
    r.accept(1, 0, *parts[1][0], now=0.0)
    r.accept(1, 1, *parts[1][1], now=0.1)
    r.accept(1, 2, *parts[1][2], now=0.2)
    r.accept(2, 0, *parts[2][0], now=0.9)
    assert r.expire(1.05) == []
    assert r.expire(1.15) == [2]  # chunk 1 arrived from sender 1 at 0.1


def test_one_sender_at_line_rate_does_not_set_the_pace_of_the_others():
    """Senders 1-3 are remote; 1 streams every chunk at once (a liar sending zeros at line
    rate, or just a fast link), 2 and 3 a chunk every 0.9 s. The pace is the lower median
    of the remote arrivals (the second of three), so neither is dropped for being a
    timeout behind sender 1 (the first arrival set it: both were excluded at 1.1 s); one
    a timeout behind the other still is."""
    xs = [torch.randn(NUMEL) for _ in range(4)]
    parts = [chunks_of(x) for x in xs]
    r = make(timeout=1.0, senders=(0, 1, 2, 3), weights=(1.0, 1.0, 1.0, 1.0))
    for k in range(3):
        r.accept(0, k, *parts[0][k], now=0.0, remote=False)
        r.accept(1, k, *parts[1][k], now=0.1)
    for sender in (2, 3):
        r.accept(sender, 0, *parts[sender][0], now=0.5)
    assert r.expire(1.2) == []
    for sender in (2, 3):
        r.accept(sender, 1, *parts[sender][1], now=1.4)
    r.accept(2, 2, *parts[2][2], now=2.3)
    assert r.expire(2.35) == []
    assert r.expire(2.45) == [3]  # chunk 2: a timeout after sender 2 delivered it


@pytest.mark.parametrize(
    "mutate, code",
    [
        (lambda q, s: (q[:-64], s[:-1]), "bad-chunk"),
        (lambda q, s: (q, torch.full_like(s, float("nan"))), "bad-chunk"),
        (lambda q, s: (q, -s), "bad-chunk"),
        (lambda q, s: (q.to(torch.int16), s), "bad-chunk"),
    ],
)
def test_invalid_chunks_are_refused_before_they_touch_the_sum(mutate, code):
    r = make()
    q, s = chunks_of(torch.randn(NUMEL))[0]
    with pytest.raises(Rejection) as info:
        r.accept(1, 0, *mutate(q, s), now=0.0)
    assert info.value.code == code
    assert r.included()[1] == 0


def test_duplicates_gaps_and_strangers_are_refused():
    r = make()
    parts = chunks_of(torch.randn(NUMEL))
    r.accept(1, 0, *parts[0], now=0.0)
    with pytest.raises(Rejection) as info:
        r.accept(1, 0, *parts[0], now=0.0)
    assert info.value.code == "duplicate"
    with pytest.raises(Rejection) as info:
        r.accept(1, 2, *parts[2], now=0.0)
    assert info.value.code == "bad-index"
    with pytest.raises(Rejection) as info:
        r.accept(7, 0, *parts[0], now=0.0)
    assert info.value.code == "not-member"


def test_trimmed_mean_holds_against_two_of_eight_flipped_updates():
    torch.manual_seed(0)
    base = torch.randn(NUMEL)
    honest = [base + 0.1 * torch.randn(NUMEL) for _ in range(6)]
    hostile = [-1000 * h for h in honest[:2]]
    r = make(senders=range(8), weights=[1.0] * 8, method="trimmed_mean", trim=2)
    for sender, x in enumerate(honest + hostile):
        for k, (q, s) in enumerate(chunks_of(x)):
            r.accept(sender, k, q, s, now=0.0)
    mean = torch.cat([t for _, t, _ in finish_all(r)])
    stacked = torch.stack([decoded(h) for h in honest])
    slack = stacked.abs().max() / 127
    assert (mean >= stacked.min(0).values - slack).all()
    assert (mean <= stacked.max(0).values + slack).all()


def test_the_first_contribution_is_written_not_added():
    # The accumulator comes from a reused buffer full of garbage.
    x = torch.randn(NUMEL)
    r = make(senders=[0], weights=[2.0], take=lambda n: torch.full((n,), 1e30))
    for k, (q, s) in enumerate(chunks_of(x)):
        r.accept(0, k, q, s, now=0.0)
    mean = torch.cat([t for _, t, _ in finish_all(r)])
    assert (mean - decoded(x)).abs().max() <= x.abs().max() / 127


@pytest.mark.parametrize("method", ["mean", "trimmed_mean", "centered_clip"])
def test_the_reducer_holds_the_chunks_in_flight_not_its_part(method):
    """Its own contribution waits as sent until a chunk's first other one comes: a part's
    worth of rows would be 4 bytes a value of the part (12 for a trimmed mean's three)."""
    xs = [torch.randn(NUMEL) for _ in range(3)]
    parts = [chunks_of(x) for x in xs]
    taken: list[int] = []
    r = make(method=method, take=lambda n: taken.append(n) or torch.empty(n))
    for k, chunk in enumerate(parts[0]):
        r.accept(0, k, *chunk, now=0.0, remote=False)
    assert taken == []
    done = []
    for k in range(3):
        r.accept(1, k, *parts[1][k], now=0.1)
        r.accept(2, k, *parts[2][k], now=0.1)
        done += finish_all(r)
    assert [k for k, _, _ in done] == [0, 1, 2]
    assert len(taken) == 1  # one chunk's rows, reused from chunk to chunk
    alone = make(senders=[0], weights=[1.0], method=method)
    for k, chunk in enumerate(parts[0]):
        alone.accept(0, k, *chunk, now=0.0, remote=False)
    mine = torch.cat([t for _, t, _ in finish_all(alone)])  # ours alone, decoded at the end
    assert (mine - decoded(xs[0])).abs().max() <= xs[0].abs().max() / 127


@pytest.mark.parametrize("method", ["mean", "trimmed_mean", "centered_clip"])
def test_a_chunk_whose_weighted_values_could_overflow_the_sum_is_refused(method):
    # Token counts as weights: 2e5 each. A finite update of 1e36 would make the sum Inf.
    r = make(weights=(2e5, 2e5, 2e5), method=method)
    honest = chunks_of(torch.randn(NUMEL))
    r.accept(0, 0, *honest[0], now=0.0)
    with pytest.raises(Rejection) as info:
        r.accept(1, 0, *chunks_of(torch.randn(NUMEL) * 1e36)[0], now=0.0)
    assert info.value.code == "too-large" and "overflow" in info.value.reason
    assert r.included()[1] == 0
    # The largest values that pass still sum to a finite mean.
    r.accept(2, 0, *chunks_of(torch.randn(NUMEL) * 1e30)[0], now=0.0)
    r.exclude(1, "struck")
    r.accept(0, 1, *honest[1], now=0.0)
    index, q, s, contributors = r.finish()
    assert index == 0 and contributors == [0, 2]
    assert torch.isfinite(dequantize(q, s, 64, "eager")).all()


def test_a_mean_that_is_not_finite_aborts_instead_of_leaving_the_reducer():
    # Weights whose sum overflows (each finite): nothing may be quantized from it.
    r = make(senders=(0, 1), weights=(1e308, 1e308))
    zeros = chunks_of(torch.zeros(NUMEL))
    for sender in (0, 1):
        r.accept(sender, 0, *zeros[0], now=0.0)
    with pytest.raises(RoundAborted, match="chunk 0"):
        r.finish()
    assert r.completed == 0


def test_centered_clip_stays_finite_for_the_largest_values_a_reducer_accepts():
    r = make(senders=range(4), weights=[1.0] * 4, method="centered_clip")
    big = torch.finfo(torch.float32).max / (128 * 4)
    for sender in range(4):
        x = torch.randn(NUMEL).sign() * big * (1 if sender < 3 else -1)
        for k, (q, s) in enumerate(chunks_of(x)):
            r.accept(sender, k, q, s, now=0.0)
    assert all(torch.isfinite(t).all() for _, t, _ in finish_all(r))


@pytest.mark.parametrize("method", ["mean", "trimmed_mean", "centered_clip"])
def test_a_sender_past_the_groups_norm_bound_is_struck_before_that_chunk_counts(method):
    r = make(weights=(1.0, 1.0, 1.0), norm_bound=10.0, method=method)
    at_bound = torch.randn(NUMEL)
    at_bound *= 10.0 * (1 - 1e-6) / at_bound.norm()
    for sender in (0, 1):
        for k, (q, s) in enumerate(chunks_of(at_bound)):
            r.accept(sender, k, q, s, now=0.0)
    # Sender 2's first chunk fits (a third of its update); the second takes it past.
    liar = torch.zeros(NUMEL)
    liar[:256] = 5.0 / 16  # norm 5 in chunk 0 (256 values)
    liar[256:512] = 100.0 / 16  # norm 100 in chunk 1
    chunks = chunks_of(liar)
    r.accept(2, 0, *chunks[0], now=0.0)
    with pytest.raises(Rejection) as info:
        r.accept(2, 1, *chunks[1], now=0.0)
    assert info.value.code == "too-large" and "bound 10" in info.value.reason
    assert r.included()[2] == 1
    r.exclude(2, "struck")
    done = finish_all(r)
    assert [c for _, _, c in done] == [[0, 1, 2], [0, 1], [0, 1]]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    log_scale=st.floats(-20, 30),
    scale_dtype=st.sampled_from(["float32", "float16"]),
    feedback=st.booleans(),
    spiky=st.booleans(),
)
def test_an_honest_update_clipped_to_the_bound_always_passes(
    seed, log_scale, scale_dtype, feedback, spiky
):
    """Whatever the values, the scale type and error feedback: quantization never takes an
    honest sender's clipped update past what the reducer allows."""
    # fp16 scales end at 65504 x 127: the residual set up below (several times the largest
    # spike) must stay encodable, or the codec rightly refuses it before the test starts.
    assume(scale_dtype == "float32" or log_scale <= 20)
    codec = dataclasses.replace(CODEC, scale_dtype=scale_dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(NUMEL, generator=g) * 10.0 ** (log_scale / 10)
    if spiky:
        x[torch.randint(0, NUMEL, (5,), generator=g)] *= 1000
    bound = float(x.norm()) / 3  # the sender must scale its update down
    if feedback:
        ef = ErrorFeedback(NUMEL, codec)
        ef.encode(torch.randn(NUMEL, generator=g) * float(x.abs().max()))  # a residual left
        ef.commit()
        q, s = ef.encode(x, max_norm=bound)
    else:
        q, s = quantize(x * (bound / float(x.norm()) * (1 - 1e-6)), codec)
    r = make(senders=[0], weights=[1.0], codec=codec, norm_bound=bound)
    for k, span in enumerate(chunk_spans(NUMEL, codec)):
        blocks = s[span.first_block : span.first_block + span.blocks]
        assert r.accept(0, k, q[span.start : span.stop], blocks, now=0.0)
