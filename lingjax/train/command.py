"""The scaffolding both training commands share: `python -m lingjax.train` (lingjax.train.run) and
`python -m lingjax.train.dspark`.

    p = Parser(PROG, "description")                    # a bad flag raises CommandError: one line, no usage
    p.add_common("--steps", default=1000, help="...")  # a flag both take: one spelling and type
    roots = parse_roots(a.roots)                       # --roots LABEL=PATH ... (the interpreter's by default)

    @one_line_errors(PROG)                             # CommandError, CheckpointMismatch -> one line, status 2
    def main(argv=None) -> int: ...

    if TimeBudget(limit_s).exhausted(steps_done, end_s): ...   # --time-limit-s: stop before another step
    seconds = save(rep, run_dir, step, state, record)  # a checkpoint, reported as one line
    outputs, seconds = evaluate(program, calls)        # an evaluation, read back from the device once

Each trainer keeps its own flags, checks and messages; what is here is the part whose rule is the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

from lingjax.train import checkpointing, corpus
from lingjax.train.checkpointing import CheckpointMismatch
from lingjax.train.report import Reporter, mb

EXPORT_DIR = "export"  # RUN_DIR/export: where the final step's export goes unless --export names another
SMOKE_PROMPT = "def quicksort(xs):"  # what an export completes, loaded back, as a check


class CommandError(Exception):
    """A problem reported as one `PROG: error: ...` line, exit status 2 (one_line_errors)."""


# The flags both commands take, by their one spelling: type and arity here; default and help are each command's.
COMMON_FLAGS = {
    "--out": {"type": Path, "required": True},
    "--steps": {"type": int},
    "--time-limit-s": {"type": float, "default": None},
    "--batch": {"type": int},
    "--seq-len": {"type": int},
    "--lr": {"type": float},
    "--warmup-steps": {"type": int},
    "--seed": {"type": int, "default": 0},
    "--log-every": {"type": int},
    "--export": {"type": Path, "default": None},
    "--roots": {"nargs": "+", "default": None, "metavar": "LABEL=PATH"},
}


class Parser(argparse.ArgumentParser):
    """`python -m PROG`'s parser: an error raises CommandError instead of printing usage and exiting."""

    def __init__(self, prog: str, description: str):
        super().__init__(prog=f"python -m {prog}", description=description)

    def error(self, message):  # one line, no usage block: one_line_errors turns it into exit status 2
        raise CommandError(message)

    def add_common(self, flag: str, **kwargs) -> None:
        """A flag of COMMON_FLAGS, with this command's default, help or metavar."""
        self.add_argument(flag, **{**COMMON_FLAGS[flag], **kwargs})


def at_least(flag: str, value, minimum=1) -> None:
    if value < minimum:
        raise CommandError(f"{flag} must be >= {minimum}, got {value}")


def parse_roots(items: list[str] | None) -> dict[str, Path]:
    """--roots ["label=path", ...] -> {label: path}, each path an existing directory, each label unique; None
    (the flag not given) -> corpus.default_roots(), this interpreter's stdlib and site-packages."""
    if items is None:
        return corpus.default_roots()
    roots: dict[str, Path] = {}
    for item in items:
        label, sep, raw = item.partition("=")
        if not sep or not label or "/" in label or not raw:
            raise CommandError(f"--roots takes LABEL=PATH items, got {item!r}")
        if label in roots:
            raise CommandError(f"--roots names {label!r} twice")
        path = Path(raw).expanduser()
        if not path.is_dir():
            raise CommandError(f"--roots {label}={raw}: not a directory")
        roots[label] = path
    return roots


def one_line_errors(prog: str):
    """The one error path of a command's main: a CommandError or CheckpointMismatch raised anywhere in it is
    printed as `PROG: error: ...` on stderr, and main returns exit status 2."""

    def wrap(main):
        @functools.wraps(main)
        def guarded(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except (CommandError, CheckpointMismatch) as e:
                print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
                return 2

        return guarded

    return wrap


@dataclasses.dataclass(frozen=True)
class TimeBudget:
    """--time-limit-s (None: no limit), counted from the start of the call. The first step of a call is always
    taken, so every call makes progress; after it, a step is taken only when the call, taking it, would still
    end within the limit. Where it would end is the trainer's estimate, in seconds since the call started: the
    LM trainer's adds the steps in flight, the step and what follows the loop (evaluation, save, export); the
    drafter's is the time so far."""

    limit_s: float | None

    def exhausted(self, steps_done: int, end_s: Callable[[], float]) -> bool:
        """Whether this call, having taken steps_done steps, stops before the next one; end_s() is the estimate,
        asked only when the limit applies."""
        return self.limit_s is not None and steps_done > 0 and end_s() > self.limit_s


def save(rep: Reporter, run_dir: Path, step: int, state: dict, record: dict) -> float:
    """checkpointing.save of the state at `step`, reported as one line with its size; -> the seconds it took."""
    t = time.perf_counter()
    path = checkpointing.save(run_dir, step, state, record)
    secs = time.perf_counter() - t
    rep.say(f"saved step {step} to {path} ({mb(checkpointing.dir_bytes(path))}) in {secs:.1f} s")
    return secs


def evaluate(program, calls: list[tuple]) -> tuple[list, float]:
    """program(*args) for each args of calls, all dispatched before the one device read. -> (the outputs on the
    host, one per call; the seconds it took)."""
    t = time.perf_counter()
    host = jax.device_get([program(*args) for args in calls])
    return host, time.perf_counter() - t
