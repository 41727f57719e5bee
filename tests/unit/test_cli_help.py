"""`--help` that teaches: `create` lists the tasks and what each preset picks, `join` says
when a run ends."""

import subprocess
import sys

import pytest

from swarmloco.train.model import GPT
from swarmloco.train.spec import GPT_PRESETS, GPTConfig


def help_of(command: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "swarmloco", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    "config",
    [*GPT_PRESETS.values(), GPTConfig(vocab_size=1000, seq_len=64, n_layer=3, n_head=2, n_embd=48)],
)
def test_a_gpts_size_is_known_without_building_it(config):
    assert config.parameters == sum(p.numel() for p in GPT(config).parameters())


def test_create_lists_the_tasks_and_what_each_preset_picks():
    shown = help_of("create")
    assert "tasks and presets" in shown
    assert "gpt-bytes: The built-in task: a byte-level GPT" in shown
    for line in (
        "tiny   0.84M parameters (4 layers, 128 wide, 128 tokens of context); H=50, batch 16, "
        "lr 0.003 (warmup 150), 2,000 steps, 40 rounds",
        "small  11M parameters (6 layers, 384 wide, 256 tokens of context)",
        "base   128M parameters (18 layers, 768 wide, 1024 tokens of context)",
    ):
        assert line in shown, shown[-1500:]
    assert "llama: The Llama architecture" in shown
    assert "1b     1.1B parameters (22 layers, 2048 wide, 2048 tokens of context); H=500" in shown
    flat = " ".join(shown.split())
    assert "--seq-len TOKENS context length of the model" in flat
    assert "--memory-budget GB device memory the training may use" in flat


def test_seq_len_and_vocab_size_replace_the_presets_values():
    import argparse

    from swarmloco.cli.common import _model_overrides
    from swarmloco.train.tasks import build_manifest

    args = argparse.Namespace(vocab_size=None, seq_len=64)
    assert _model_overrides(args) == {"seq_len": 64}
    manifest = build_manifest("llama", "tiny", creator="", model_overrides=_model_overrides(args))
    assert manifest.model["seq_len"] == 64


def test_join_says_when_a_run_ends_and_what_dry_run_prints():
    shown = " ".join(help_of("join").split())
    assert "until the run ends (its manifest's total steps" in shown
    assert "--dry-run it prints what the run trains and how" in shown
