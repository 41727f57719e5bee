"""A machine without the compilers torch.compile runs (a slim image, a bare box): the peer
says so before any work, and trains on eager kernels unless compiling was asked for."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swarmloco.core.toolchain import missing_compiler


@pytest.fixture
def bare_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with no compiler on it, and no $CC or $CXX."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    missing_compiler.cache_clear()
    yield empty
    missing_compiler.cache_clear()


def test_a_missing_compiler_is_named_and_a_chosen_one_is_found(bare_path, monkeypatch):
    assert "C++ compiler" in missing_compiler("cpu")
    assert "C compiler" in missing_compiler("cuda")
    (bare_path / "gcc").symlink_to(shutil.which("true", path=os.defpath))  # as Triton looks
    missing_compiler.cache_clear()
    assert missing_compiler("cuda") is None and missing_compiler("cpu") is not None
    monkeypatch.setenv("CXX", str(bare_path / "gcc"))  # $CXX, wherever it is
    monkeypatch.setenv("CC", "/nonexistent/cc")  # a $CC that is not there is not found
    missing_compiler.cache_clear()
    assert missing_compiler("cpu") is None and missing_compiler("cuda") is not None


def test_without_compilers_the_codec_runs_eager_and_compile_on_is_refused(tmp_path):
    """In a process of its own (the codec's choice holds for the process): what the codec
    and the inner loop do on a machine without a C++ compiler."""
    code = """
import torch
from torch._dynamo.utils import counters
from swarmloco.core import codec
from swarmloco.core.codec import CodecConfig, quantize, warm_up
from swarmloco.errors import CodecError, SwarmlocoError
from swarmloco.train.inner import InnerConfig, InnerLoop
from swarmloco.train.model import GPT
from swarmloco.train.spec import GPTConfig

try:
    quantize(torch.zeros(1024), CodecConfig(backend="compiled"))
    raise SystemExit("the compiled codec was built")
except CodecError as exc:
    print("compiled:", exc)
warm_up(CodecConfig(backend="auto"))
print("auto:", codec.compile_failure())
assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=1, n_embd=8))
settings = dict(lr=1e-3, warmup_steps=0, total_steps=10, precision="fp32")
assert not InnerLoop(model, InnerConfig(**settings, compile="auto"), torch.device("cpu")).compiled
try:
    InnerLoop(model, InnerConfig(**settings, compile="on"), torch.device("cpu"))
    raise SystemExit("compile on was taken")
except SwarmlocoError as exc:
    print("on:", exc)
"""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env["PATH"] = str(empty)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    said = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    for key in ("compiled", "auto", "on"):
        assert "C++ compiler ($CXX or g++)" in said[key], said
    assert "apt install g++" in said["auto"]
