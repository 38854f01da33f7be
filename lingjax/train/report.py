"""What a training command prints and logs, for both trainers (`python -m lingjax.train` and
`python -m lingjax.train.dspark`):

    rep = Reporter(run_dir, t0)                        # t0: time.perf_counter() when the call started
    rep.say("corpus: ...")                             # stdout: "[    12.3s] corpus: ..."
    rep.report("train", "step 10: ...", step=10, loss=2.5)   # that line, and {"event": "train", ...} in the log
    rep.last_line({"step": 10, ...})                   # the call's last line: one JSON object on stdout

Every progress line is led by the seconds since the call started; RUN_DIR/log.jsonl gets one JSON object a
line, keys sorted, its kind under "event" ("train", "eval", "summary"). The log is appended to, so it holds
every call of the run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

LOG_FILE = "log.jsonl"


class Reporter:
    """Progress lines on stdout, each led by the seconds since the call started; JSON events in log.jsonl."""

    def __init__(self, run_dir: Path, t0: float):
        self.log_path = run_dir / LOG_FILE
        self.t0 = t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():8.1f}s] {message}", flush=True)

    def event(self, kind: str, **fields) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"event": kind, **fields}, sort_keys=True) + "\n")

    def report(self, kind: str, line: str, **fields) -> None:
        """One progress line and the same figures as a `kind` event in the log."""
        self.say(line)
        self.event(kind, **fields)

    def last_line(self, fields: dict) -> None:
        """The call's result as one JSON object, the last line on stdout (what a script reads)."""
        print(json.dumps(fields), flush=True)


def since(t: float) -> str:
    """Seconds since perf_counter() read t, as printed: "1.2 s"."""
    return f"{time.perf_counter() - t:.1f} s"


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
