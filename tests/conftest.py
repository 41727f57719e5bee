"""Shared test settings (a fixed thread count, hypothesis profiles) and fixtures."""

import os
import subprocess
import uuid

# Subprocesses the tests start (CLI runs, peers) inherit this: several processes share two
# cores, and OpenMP threads that spin-wait for each other make tiny models many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from hypothesis import HealthCheck, settings

# Tiny models in tests: one thread is faster than two when test processes share the cores.
torch.set_num_threads(1)

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB tmpfs: a real disk that fills up (root only; skipped elsewhere)."""
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
