"""Progress on stderr for long work; silent when stderr is not a terminal or with --quiet."""

from __future__ import annotations

import sys
import time


class Progress:
    """Byte-count progress: ``writing  42%  1.00/2.40 GB``, redrawn at most five times a second."""

    def __init__(self, label: str, total: int, enabled: bool | None = None):
        self.label, self.total, self.done = label, max(total, 1), 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.2 or self.done >= self.total):
            self._last = now
            pct = 100 * self.done // self.total
            sys.stderr.write(f"\r{self.label} {pct:3d}%  {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
