"""Shared helpers of the benchmark scripts: machine description, robust timing, a process's
CPU and how late an event loop wakes."""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def status_mb(pid: int, field: str) -> float | None:
    """A memory figure of a process from /proc/PID/status (``VmRSS``: resident now,
    ``VmHWM``: its peak so far), in MB; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def stop_processes(children: list[Any], *, timeout: float = 60.0) -> None:
    """SIGTERM every child still running, then wait for each (SIGKILL past ``timeout``)."""
    import signal
    import subprocess

    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()


def median_seconds(fn: Callable[[], object], *, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process has used so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def loop_lag(lags: list[float], tick: float = 0.005) -> None:
    """Record how late each of a stream of short sleeps wakes on the running loop: how long
    the loop was held by other work (a round's decoding, hashing, accumulating; signature
    checks) while a DHT request or a heartbeat would have waited. Runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        asleep = loop.time()
        await asyncio.sleep(tick)
        lags.append(max(0.0, loop.time() - asleep - tick))
