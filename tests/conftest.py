"""Shared test settings: a fixed thread count and hypothesis profiles."""

import os

# Subprocesses the tests start (CLI runs, peers) inherit this: several processes share two
# cores, and OpenMP threads that spin-wait for each other make tiny models many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from hypothesis import HealthCheck, settings

# Tiny models in tests: one thread is faster than two when test processes share the cores.
torch.set_num_threads(1)

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")
