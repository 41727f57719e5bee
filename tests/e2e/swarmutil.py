"""Training peers as real processes (`swarmloco create` / `swarmloco join`) on 127.0.0.1.

Each peer runs with ``--events -``: its stdout carries one JSON object per event (ready,
round, checkpoint, downloaded, aborted, stopped, ...), collected as they come; its stderr
(the log) is kept for failure messages.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from cliutil import Bootstrap, swarmloco  # re-exported for the e2e tests

__all__ = ["Bootstrap", "PeerProcess", "swarmloco"]

COMMAND = [sys.executable, "-m", "swarmloco.cli"]
# Small and fast: a tiny GPT on batches of 4, a round every 8 steps, second-scale timeouts,
# and keys without proofs of work (a second of CPU per key, at random: tests of training
# and timing would start their peers seconds apart; test_swarm.py has a run with proofs).
FAST_SWARM = (
    "--preset",
    "tiny",
    "--batch-size",
    "4",
    "--sync-every",
    "8",
    "--seed",
    "3",
    "--identity-work",
    "0",
)
FAST_PEER = (
    "--host",
    "127.0.0.1",
    "--threads",
    "1",
    "--gather",
    "3",
    "--round-timeout",
    "30",
    "--progress-interval",
    "0.5",
    # The compiled codec gives the same bits (tests/unit/test_codec.py) but costs every
    # process seconds of compiling at start.
    "--codec",
    "eager",
)

Event = dict[str, Any]


# A user's script as `python SCRIPT ARGS` runs it (its folder first on sys.path, its
# arguments in sys.argv), with SIGUSR1 writing every thread's stack to stderr.
_SCRIPT = (
    "import faulthandler, os, runpy, signal, sys; "
    "faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "sys.argv = sys.argv[1:]; sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


class PeerStillRunning(AssertionError):
    """A peer did not exit in the time a test gave it."""


class PeerProcess:
    """One `swarmloco create|join ... --events -` process."""

    def __init__(self, args: list[str], data_dir: Path, *, command: list[str] = COMMAND) -> None:
        self.data_dir = data_dir
        self.process = subprocess.Popen(
            [*command, *args, "--data-dir", str(data_dir), "--events", "-"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[Event] = []
        self.first_line = ""
        self.log: list[str] = []
        self._changed = threading.Condition()
        self._recorded = False
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for t in self._threads:
            t.start()

    @classmethod
    def script(cls, path: Path, data_dir: Path, *args: str) -> PeerProcess:
        """A user's own training script that takes --data-dir and --events -, run as
        ``python path`` runs it, and with the command's SIGUSR1 (every thread's stack on
        stderr: ``dump_stacks``), which a script of its own does not set."""
        return cls(list(args), data_dir, command=[sys.executable, "-c", _SCRIPT, str(path)])

    @classmethod
    def create(cls, data_dir: Path, *extra: str) -> PeerProcess:
        return cls(["create", *FAST_SWARM, *FAST_PEER, *extra], data_dir)

    @classmethod
    def publish(cls, data_dir: Path, peer: str, *extra: str) -> str:
        """`swarmloco create --no-train`: publish a new swarm's manifest; return its id."""
        result = subprocess.run(
            [
                *COMMAND,
                "create",
                *FAST_SWARM,
                *extra,
                "--no-train",
                "--peer",
                peer,
                "--data-dir",
                str(data_dir),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[0]

    @classmethod
    def join(cls, swarm_id: str, peer: str, data_dir: Path, *extra: str) -> PeerProcess:
        return cls(["join", swarm_id, "--peer", peer, *FAST_PEER, *extra], data_dir)

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            event = None
            if line.startswith("{"):
                # A training library may print dict reprs too (transformers' Trainer logs).
                with contextlib.suppress(json.JSONDecodeError):
                    event = json.loads(line)
            with self._changed:
                if event is not None:
                    self.events.append(event)
                elif not self.first_line:
                    self.first_line = line.strip()
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._changed:
                self.log.append(line)
                self._changed.notify_all()

    def wait_for(
        self, event: str, where: Callable[[Event], bool] = lambda e: True, timeout: float = 120
    ) -> Event:
        """The first ``event`` that satisfies ``where`` (waiting for it up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for e in self.events:
                    if e["event"] == event and where(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self._reading()):
                    raise AssertionError(
                        f"no {event!r} event (exit code {self.process.poll()}); events: "
                        f"{[e['event'] for e in self.events]}; log tail:\n{self.log_tail()}"
                    )
                self._changed.wait(min(left, 0.5))

    def _reading(self) -> bool:
        return self._threads[0].is_alive()

    def of(self, event: str) -> list[Event]:
        with self._changed:
            return [e for e in self.events if e["event"] == event]

    @property
    def swarm_id(self) -> str:
        self.wait_for("ready")
        return self.first_line

    @property
    def endpoint(self) -> str:
        return str(self.wait_for("ready")["endpoint"])

    def log_tail(self, lines: int = 40) -> str:
        return "".join(self.log[-lines:])

    def wait(self, timeout: float = 180) -> int:
        """The peer's exit code. One still running after ``timeout`` fails the test with
        where its threads were (their stacks) and its log before that."""
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with self._changed:
                before = len(self.log)
            self.dump_stacks()
            self.kill()  # (the dump is written at once; the log is read to its end)
            raise PeerStillRunning(
                f"the peer was still running {timeout:.0f} s later; its log, then where "
                f"each of its threads was:\n{''.join(self.log[max(0, before - 40) :])[-40_000:]}"
            ) from None
        for t in self._threads:
            t.join(timeout=5)
        self._keep_record()
        return code

    def kill(self) -> None:
        self.process.kill()
        self.wait(timeout=10)

    def _keep_record(self) -> None:
        """Leave the events and the log beside the peer's data, for whoever debugs a failure."""
        if self._recorded:
            return
        self._recorded = True
        self.data_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(self.data_dir.glob("run-*.log")))
        (self.data_dir / f"run-{n}.log").write_text("".join(self.log))
        (self.data_dir / f"run-{n}.events").write_text(
            "".join(json.dumps(e) + "\n" for e in self.events)
        )

    def stop(self, timeout: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def __enter__(self) -> PeerProcess:
        return self

    def dump_stacks(self, timeout: float = 10.0) -> None:
        """Have a running peer write every thread's stack into its log (SIGUSR1, the
        command's faulthandler), for whoever debugs a hang: returns once the dump began to
        arrive (the rest is in the pipe), the peer exited, or ``timeout`` passed."""
        if self.process.poll() is not None:
            return
        with self._changed:
            start = len(self.log)
        self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        with self._changed:
            while not any("most recent call first" in line for line in self.log[start:]):
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    return
                self._changed.wait(min(left, 0.5))

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            if exc[0] is not None:  # a test failed with the peer still running: where was it?
                self.dump_stacks()
            self.kill()
        else:
            self.wait()


def load_export_in_transformers(probe: str, out: Path) -> dict[str, Any]:
    """Run ``probe`` (a script given the export's directory; its last line of output is a
    JSON object with ``gap``, ``missing`` and ``unexpected``) in a fresh interpreter; the
    export must load with no key missing or unexpected and give our logits (to 1e-4).
    Skips the test without the hf extra. Returns what the probe printed."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("the hf extra is not installed: the export is not loaded")
    done = subprocess.run(
        [sys.executable, "-c", probe, str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert not found["missing"] and not found["unexpected"], found
    assert found["gap"] < 1e-4, found
    return found


def last_landed(data_dir: Path) -> tuple[int, Any]:
    """The round of a peer's newest checkpoint and what landed of a pinned dataset in its
    state (``dataset.ledger.Landed``)."""
    from swarmloco.dataset.ledger import Landed
    from swarmloco.runtime.checkpoint import CheckpointStore

    # (A stage peer's data directory holds its run's manifest beside its stage's swarm.)
    [swarm_dir] = [d for d in (data_dir / "swarms").iterdir() if (d / "checkpoints").is_dir()]
    with CheckpointStore(swarm_dir / "checkpoints", swarm_id=swarm_dir.name) as store:
        found = store.latest()
    assert found is not None, f"no checkpoint under {data_dir}"
    return found.round, Landed.from_tensor(found.state["diloco"]["landed"])


def rank_pid(launcher: PeerProcess, rank: int) -> int:
    """The process of ``rank`` among the launcher's (torchrun's) children."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher.process.pid:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if f"RANK={rank}".encode() in environ:
            return int(stat.parent.name)
    raise AssertionError(f"no rank {rank} under process {launcher.process.pid}")


def process_gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process ``pid`` ended (gone, or a zombie nobody reaped yet) within
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False
