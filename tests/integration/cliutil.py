"""Run `swarmloco` commands as real processes, and a real `swarmloco bootstrap` node."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

COMMAND = [sys.executable, "-m", "swarmloco.cli"]


def swarmloco(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Bootstrap:
    """A `swarmloco bootstrap` process on 127.0.0.1, port 0; stderr is collected as it comes."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.process = subprocess.Popen(
            [
                *COMMAND,
                "bootstrap",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--data-dir",
                str(data_dir),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # the process prints it once it serves, or dies
        match = re.search(r"serving on (\S+:\d+) as peer ([0-9a-f]{40})", line)
        if match is None:
            self.process.kill()
            raise AssertionError(f"no address line: {line!r}; log: {self.log}")
        self.endpoint, self.peer_id = match.group(1), match.group(2)

    def _collect(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)

    def wait_for_log(self, pattern: str, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.log):
                if re.search(pattern, line):
                    return line
            time.sleep(0.02)
        raise AssertionError(f"{pattern!r} not logged; log: {''.join(self.log)}")

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 10) -> int:
        self.process.send_signal(signum)
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=timeout)
        return code

    def __enter__(self) -> Bootstrap:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
