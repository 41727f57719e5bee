"""A small progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self, total: int, label: str, *, stream: TextIO | None = None, enabled: bool = True
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self.postfix = ""

    def update(self, n: int = 1, **postfix: float | str) -> None:
        self.done = min(self.total, self.done + n)
        if postfix:
            self.postfix = "  ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in postfix.items()
            )
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self._last_draw = now
                self.stream.write("\r\x1b[2K" + self._line(now))
                self.stream.flush()
        else:
            decile = self.done * 10 // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(self._line(now) + "\n")
                self.stream.flush()

    def _line(self, now: float) -> str:
        frac = self.done / self.total
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        return (
            f"{self.label:<16} [{bar}] {self.done}/{self.total} "
            f"{elapsed:5.0f}s<{eta:4.0f}s {self.postfix}"
        )

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
