"""The CUDA paths, where a GPU is: the inner loop's defaults there (torch.compile, bf16
autocast, fused AdamW), a state moving between a GPU and a CPU, and a GPU peer averaging with
a CPU peer in one swarm. Skipped on a machine without CUDA.
"""

from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

import pytest
import torch

from swarmloco.train.inner import InnerConfig, InnerLoop
from swarmloco.train.model import GPT
from swarmloco.train.spec import GPTConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
MODEL = GPTConfig(n_layer=2, n_embd=64, n_head=2, seq_len=32)


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(MODEL)


def repeating(batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, MODEL.vocab_size, (batch, MODEL.seq_len + 1), generator=g)
    return itertools.repeat((rows[:, :-1], rows[:, 1:]))


def config(**overrides) -> InnerConfig:
    base = dict(lr=3e-3, warmup_steps=0, total_steps=100)
    return InnerConfig(**(base | overrides))


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def follows_fp32(build) -> tuple[InnerLoop, InnerLoop]:
    """The same model trained on CUDA by the auto loop (compiled, bf16, fused AdamW) and in
    plain fp32, 41 steps on one batch: the losses agree and both learn."""
    fast = InnerLoop(build(), config(), CUDA)  # precision and compile: auto
    exact = InnerLoop(build(), config(precision="fp32", compile="off"), CUDA)
    assert fast.amp_dtype is torch.bfloat16
    assert fast._forward is not fast.model  # compiled
    assert all(g["fused"] for g in fast.optimizer.param_groups)
    a, b = repeating(8), repeating(8)
    first_fast, first_exact = fast.train_step(a), exact.train_step(b)
    assert first_fast == pytest.approx(first_exact, rel=2e-2)
    for _ in range(40):
        last_fast, last_exact = fast.train_step(a), exact.train_step(b)
    assert last_fast < 0.5 * first_fast
    assert last_fast == pytest.approx(last_exact, rel=0.1)
    return fast, exact


def test_auto_on_cuda_is_compiled_bf16_with_fused_adamw_and_follows_fp32():
    fast, exact = follows_fp32(make_model)
    assert all(p.dtype is torch.float32 for p in fast.model.parameters())  # fp32 masters
    gap = (params(fast.model) - params(exact.model)).norm() / params(exact.model).norm()
    assert gap < 0.05, gap


def test_the_llama_model_compiled_in_bf16_on_cuda_follows_fp32():
    from swarmloco.train.llama import Llama
    from swarmloco.train.spec import LlamaConfig

    shape = LlamaConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)

    def llama() -> Llama:
        torch.manual_seed(0)
        return Llama(shape)

    follows_fp32(llama)


def test_a_state_saved_on_the_gpu_resumes_on_the_cpu_to_the_same_step():
    exact = dict(precision="fp32", compile="off")
    gpu = InnerLoop(make_model(), config(**exact), CUDA)
    batches = repeating(4)
    for _ in range(5):
        gpu.train_step(batches)
    model_state = {k: v.cpu() for k, v in gpu.model.state_dict().items()}
    saved = copy.deepcopy(gpu.state_dict())  # the live moments change with the next step
    expected = gpu.train_step(batches)

    def on_cpu(state: dict | None) -> InnerLoop:
        model = make_model(seed=7)
        model.load_state_dict(model_state)
        loop = InnerLoop(model, config(**exact), CPU)
        if state is not None:
            loop.load_state_dict(state)
        return loop

    cpu = on_cpu(saved)
    assert cpu.step == 5
    assert cpu.train_step(batches) == pytest.approx(expected, rel=1e-4)
    # Loading the GPU's state (fused AdamW keeps its step count on the GPU) is loading a
    # CPU copy of it, to the bit.
    copied = on_cpu(copy.deepcopy(_to_cpu(saved)))
    copied.train_step(batches)
    torch.testing.assert_close(params(cpu.model), params(copied.model), rtol=0, atol=0)
    for state in cpu.optimizer.state.values():
        assert float(state["step"]) == 6
        assert state["exp_avg"].device == CPU
    # Against the GPU's own sixth step: the two devices' gradients differ in their last bits;
    # without the moments carried over (a fresh AdamW, its first step a full lr in every
    # coordinate) the parameters land far further away.
    fresh = on_cpu(None)
    fresh.train_step(batches)
    reference = params(gpu.model)
    resumed_gap = (params(cpu.model) - reference).norm() / reference.norm()
    fresh_gap = (params(fresh.model) - reference).norm() / reference.norm()
    assert resumed_gap < 0.05 * fresh_gap, (resumed_gap, fresh_gap)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


@pytest.mark.timeout(300)
def test_a_gpu_peer_and_a_cpu_peer_hold_the_same_state_after_every_round(tmp_path):
    from swarmutil import Bootstrap, PeerProcess

    rounds = 3
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint)
        # No round alone: the CPU peer is training while the GPU peer still compiles.
        stop = ("--max-rounds", str(rounds), "--min-group", "2")
        with (
            PeerProcess.join(swarm, boot.endpoint, tmp_path / "g", "--device", "cuda", *stop) as g,
            PeerProcess.join(swarm, boot.endpoint, tmp_path / "c", "--device", "cpu", *stop) as c,
        ):
            for p in (g, c):
                assert p.wait(240) == 0, p.log_tail()
    ready = g.of("ready")[0]
    assert ready["device"].startswith("cuda") and ready["precision"] == "bf16", ready
    assert c.of("ready")[0]["device"] == "cpu"
    held = [{e["round"]: e["digest"] for e in p.of("round")} for p in (g, c)]
    for p in (g, c):
        assert {e["group"] for e in p.of("round")} == {2}, p.events
    assert held[0] == held[1] and rounds in held[0], held


def test_the_memory_probe_measures_what_a_step_needs():
    from swarmloco.train.fit import choose_fit, measure_profile
    from swarmloco.train.llama import Llama
    from swarmloco.train.spec import LlamaConfig

    shape = LlamaConfig(vocab_size=4096, seq_len=256, n_layer=4, n_head=8, n_kv_head=2, n_embd=256)
    torch.manual_seed(0)
    loop = InnerLoop(Llama(shape), config(compile="off", batch_size=8), CUDA)
    state = 2 * sum(p.numel() * 4 for p in loop.model.parameters())
    profile = measure_profile(
        loop.model,
        seq_len=shape.seq_len,
        vocab_size=shape.vocab_size,
        device=CUDA,
        autocast=loop._autocast,
        optimizer_state_bytes=state,
    )
    assert profile.per_sequence_bytes > 0 and profile.checkpointed_per_sequence_bytes
    assert profile.checkpointed_per_sequence_bytes < profile.per_sequence_bytes
    fit = choose_fit(8, profile, profile.need(4) + profile.need(4) // 8)
    assert (fit.micro_batch, fit.grad_accum) == (4, 2)
    torch.cuda.reset_peak_memory_stats(CUDA)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, shape.vocab_size, (4, shape.seq_len + 1), generator=g)
    loop.train_step(itertools.repeat((rows[:, :-1], rows[:, 1:])))
    peak = torch.cuda.max_memory_allocated(CUDA)
    assert 0.5 * profile.need(4) < peak < 1.25 * profile.need(4), (peak, profile)
