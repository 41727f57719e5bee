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


def test_pipeline_stages_on_cuda_compute_what_the_cpu_computes():
    """Two stages on the GPU, driven by hand (forward 0, forward 1, backward 1, backward 0),
    holding their inputs in host memory between the two calls: the loss, the gradient that
    crosses the boundary (back on the CPU, for the wire) and every parameter's gradient are
    the CPU's, and dropout replays in the recomputed backward (the GPU's generator is kept
    with each micro-batch)."""
    from swarmloco.pipeline.replica import StageReplica
    from swarmloco.pipeline.stages import gpt_stages

    shape = GPTConfig(n_layer=2, n_embd=64, n_head=2, seq_len=32, dropout=0.1)
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, shape.vocab_size, (4, shape.seq_len + 1), generator=g)
    x, y = rows[:, :-1], rows[:, 1:]
    results = {}
    for device in (CPU, CUDA):
        zero, one = (s.to(device) for s in gpt_stages(shape, 2, seed=7))
        for s in (zero, one):
            s.eval()  # dropout off: the two devices draw different masks
        first = StageReplica(zero, first=True, last=False)
        last = StageReplica(one, first=False, last=True)
        assert first.device.type == last.device.type == device.type
        acts = first.forward(b"m", x)
        loss = last.forward(b"m", acts, y)
        held = last._held[b"m"]  # the input kept for the backward: in host memory
        assert held.input.device == CPU and held.targets is not None
        assert held.targets.device == CPU
        grad = last.backward(b"m", None)
        assert acts.device == grad.device == CPU and first.backward(b"m", grad) is None
        grads = [torch.cat([p.grad.reshape(-1).cpu() for p in s.parameters()]) for s in (zero, one)]
        results[str(device)] = (float(loss), grad, grads)
    (loss_c, grad_c, grads_c), (loss_g, grad_g, grads_g) = results[str(CPU)], results[str(CUDA)]
    assert loss_g == pytest.approx(loss_c, rel=1e-4)
    torch.testing.assert_close(grad_g, grad_c, rtol=1e-3, atol=1e-6)
    for mine, ref in zip(grads_g, grads_c, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-3, atol=1e-5)
    # In training mode the recomputed backward replays the forward's dropout on the GPU:
    # the gradient it returns is the one plain autograd gives for the same masks.
    head = gpt_stages(shape, 2, seed=7)[1].to(CUDA).train()
    replica = StageReplica(head, first=False, last=True)
    acts = torch.randn(4, shape.seq_len, shape.n_embd)
    torch.manual_seed(11)
    replayed = replica.forward(b"d", acts, y)
    grad = replica.backward(b"d", None)
    torch.manual_seed(11)
    mine = acts.to(CUDA).requires_grad_(True)
    want = head(mine, y.to(CUDA))
    want.backward()
    assert float(replayed) == pytest.approx(float(want.detach()), rel=1e-5)
    torch.testing.assert_close(grad, mine.grad.cpu(), rtol=1e-4, atol=1e-6)


def test_a_stage_under_bf16_autocast_on_cuda_trains_as_fp32_does_within_bf16s_precision():
    """What a stage peer on a GPU computes by default: the llama's two stages under bf16
    autocast give a loss and input gradient close to fp32's on the same GPU, and the
    recompute of the backward sees the activations that were sent (fp32 on the CPU)."""
    from swarmloco.pipeline.replica import StageReplica
    from swarmloco.pipeline.stages import build_stage
    from swarmloco.train.spec import LlamaConfig

    config = LlamaConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_kv_head=2,
                         n_embd=128, ffn=352)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, config.vocab_size, (4, config.seq_len + 1), generator=g)
    x, y = rows[:, :-1], rows[:, 1:]
    found = {}
    for autocast in (None, torch.bfloat16):
        zero, one = (build_stage(config, 2, k, seed=7, device=CUDA) for k in (0, 1))
        first = StageReplica(zero, first=True, last=False, autocast=autocast)
        last = StageReplica(one, first=False, last=True, autocast=autocast)
        acts = first.forward(b"m", x)
        assert acts.dtype == torch.float32 and acts.device == CPU
        loss = last.forward(b"m", acts, y)
        held = last._held[b"m"]  # the input kept for the backward: in host memory
        assert held.input.device == CPU and held.targets is not None
        assert held.targets.device == CPU
        grad = last.backward(b"m", None)
        assert first.backward(b"m", grad) is None
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in zero.parameters())
        found[autocast] = (float(loss), grad)
    (loss32, grad32), (loss16, grad16) = found[None], found[torch.bfloat16]
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    assert float((grad16 - grad32).norm() / grad32.norm()) < 0.05  # bf16: 8 bits of mantissa


@pytest.mark.timeout(300)
def test_a_pipelined_run_trains_its_stages_on_the_gpu(tmp_path):
    """`swarmloco create --stages 2` and two `join --device cuda` peers on one GPU: each
    stage computes there, the micro-batches cross the stages over loopback, both peers
    apply their rounds and the loss falls below an untrained byte model's. (On an H200,
    2026-11-27, the stage-1 peer missed a Backward's 30 s deadline: it compiled the
    codec's encoder on that call, on its event loop; docs/DESIGN.md section 10.)"""
    from swarmutil import Bootstrap, PeerProcess

    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint, "--stages", "2")
        flags = ("--max-rounds", "2", "--device", "cuda")
        with PeerProcess.join(swarm, boot.endpoint, tmp_path / "late", *flags) as late:
            late.wait_for("ready", timeout=120)
            with PeerProcess.join(swarm, boot.endpoint, tmp_path / "first", *flags) as first:
                for p in (first, late):
                    assert p.wait(240) == 0, first.log_tail(40) + late.log_tail(40)
    for p, stage in ((first, 0), (late, 1)):
        ready = p.of("ready")[0]
        assert ready["stage"] == stage and ready["device"].startswith("cuda"), ready
        assert [e["round"] for e in p.of("round")] == [1, 2], p.events
    assert first.of("round")[-1]["loss"] < 5.0  # ln 256 = 5.55 untrained


def test_a_checkpoint_clones_the_cards_tensors_and_the_writer_writes_them(tmp_path):
    """The model's and AdamW's tensors on the card are cloned there and written by the
    writer's thread (the training thread leaves holes for them), as they were when the
    checkpoint was asked for, whatever training does to them next."""
    import threading

    from safetensors.torch import load_file

    from swarmloco.runtime.checkpoint import TENSORS, BackgroundWriter, CheckpointStore

    gate = threading.Event()

    class Gated(CheckpointStore):
        def commit(self, staged):
            assert gate.wait(60)
            return super().commit(staged)

    state = {
        "model": torch.randn(1 << 22, device=CUDA),
        "adam": torch.randn(1 << 22, device=CUDA, dtype=torch.bfloat16),
        "theta_g": torch.randn(1 << 20),  # the host's: written by the training thread
    }
    expected = {k: v.cpu().clone() for k, v in state.items()}
    with Gated(tmp_path, swarm_id="ab" * 20) as store, BackgroundWriter(store) as writer:
        writer.submit(round=1, step=1, state=state)
        [staged] = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
        written = load_file(staged / TENSORS)
        assert not written["t.0"].any() and not written["t.1"].any()  # holes, for now
        assert torch.equal(written["t.2"], expected["theta_g"])
        state["model"].mul_(2.0)  # the next steps, in place
        state["adam"].zero_()
        state["theta_g"].zero_()
        gate.set()
        assert writer.wait() is not None
        got = store.latest().state
    for name, tensor in expected.items():
        assert torch.equal(got[name].cpu(), tensor), name
