"""Progress of long work (loading weights), on stderr: a bar redrawn in place on a terminal, a few plain
lines (every quarter) when stderr is a file or a pipe, so logs stay readable."""

from __future__ import annotations

import sys
import time

BAR_WIDTH = 30


class Progress:
    """progress(done, total) as lingjax.load and lingjax.checkpoint call it."""

    def __init__(self, label: str, stream=None, tty: bool | None = None):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.start = time.perf_counter()
        self.quarter = -1

    def __call__(self, done: int, total: int) -> None:
        total = max(total, 1)
        elapsed = time.perf_counter() - self.start
        if self.tty:
            filled = BAR_WIDTH * done // total
            bar = "#" * filled + "-" * (BAR_WIDTH - filled)
            end = "\n" if done >= total else ""
            self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {elapsed:.1f} s{end}")
        else:
            quarter = 4 * done // total
            if quarter == self.quarter:
                return
            self.quarter = quarter
            self.stream.write(f"{self.label}: {done}/{total} ({elapsed:.1f} s)\n")
        self.stream.flush()
