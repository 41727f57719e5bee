"""Shared test settings: a fixed thread count and hypothesis profiles."""

import os

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(min(2, os.cpu_count() or 1))

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")
