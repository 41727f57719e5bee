"""A box of ranks started by the daemon (``--nproc-per-node N``): the ranks launched as
torch.distributed processes of this same command, each rank's process group, and its
orderly end."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from typing import Any

LAUNCHER = "SWARMLOCO_BOX_LAUNCHER"
"""The environment variable that gives a rank the process id of the daemon that started it."""


def _die_with_launcher() -> None:
    """A rank the daemon started dies with it (Linux: the kernel sends SIGKILL when the
    daemon's process ends). A daemon killed outright (SIGKILL, the OOM killer) would
    otherwise leave its ranks running: rank 0 a peer still, holding the data directory's
    lock, and the box could not start again until someone found and killed them."""
    launcher = os.environ.get(LAUNCHER)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        logging.getLogger("swarmloco.box").warning(
            "this rank cannot ask to die with its daemon: %s", os.strerror(ctypes.get_errno())
        )
    elif os.getppid() != int(launcher):  # it died before we asked
        raise SystemExit("the box's daemon is gone: this rank leaves")


def _box_launch(args: argparse.Namespace) -> int | None:
    """With --nproc-per-node N > 1: run this same command as N ranks (the environment of a
    torch.distributed launch: RANK, WORLD_SIZE, MASTER_ADDR/PORT on this machine) and
    return the box's exit code; None inside a rank (or for one process).

    SIGINT/SIGTERM go to rank 0, which stops every rank at a step's end, checkpoints the
    box and leaves. A rank that fails stops the others (SIGTERM, then SIGKILL after
    30 s): the box's peer leaves the swarm, and the box resumes from its checkpoint."""
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    if "RANK" in os.environ:
        _die_with_launcher()
        return None
    if args.nproc_per_node == 1:
        return None
    if getattr(args, "no_train", False):
        raise ValueError("--no-train trains nothing: leave out --nproc-per-node")
    import signal
    import socket

    n = args.nproc_per_node
    with socket.socket() as s:  # a free port for the box's rendezvous, on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
    env[LAUNCHER] = str(os.getpid())
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    command = [sys.executable, "-m", "swarmloco.cli", *args.argv]
    ranks = [
        subprocess.Popen(command, env=env | {"RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(n)
    ]
    logging.getLogger("swarmloco.box").info("started %d ranks (rank 0 is the peer)", n)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: ranks[0].send_signal(signum))
    if hasattr(signal, "SIGUSR1"):  # every thread's stack, of every rank (and this one)
        import faulthandler

        def stacks(signum: int, _frame: Any) -> None:
            faulthandler.dump_traceback(all_threads=True)
            for rank in ranks:
                rank.send_signal(signum)

        signal.signal(signal.SIGUSR1, stacks)
    by_pid = {p.pid: p for p in ranks}
    code = 0
    while by_pid:
        pid, status = os.waitpid(-1, 0)
        rank = by_pid.pop(pid, None)
        if rank is None:
            continue
        rank.returncode = os.waitstatus_to_exitcode(status)
        if rank.returncode != 0 and code == 0:
            code = rank.returncode if rank.returncode > 0 else 128 - rank.returncode
            logging.getLogger("swarmloco.box").error(
                "rank %d exited with %d: stopping the box", ranks.index(rank), rank.returncode
            )
            for other in by_pid.values():
                other.terminate()
            _reap(by_pid, grace_s=30.0)
            break
    return code


def _reap(ranks: dict[int, subprocess.Popen[bytes]], *, grace_s: float) -> None:
    """Wait for ``ranks`` to exit; SIGKILL those still running after ``grace_s``."""
    for p in ranks.values():
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _box_rank() -> int:
    """This process's rank in a box (0 outside one)."""
    return int(os.environ.get("RANK", "0"))


def _leave_process_group() -> None:
    """Destroy the box's process group once nothing holds it (the model's DDP wrapper, the
    box): its communication threads are joined now, while the interpreter runs. Left to
    exit, one of them may free its last work object during finalization and abort the
    process (std::terminate), failing a box that stopped cleanly."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def _init_box(device: str) -> Any:
    """Join this torchrun rank's process group (NCCL on GPUs, gloo on CPUs); the box."""
    import torch
    import torch.distributed as dist

    from swarmloco.runtime.box import Box

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return Box()
