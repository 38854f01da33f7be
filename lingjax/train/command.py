"""The scaffolding both training commands share: `python -m lingjax.train` (lingjax.train.run) and
`python -m lingjax.train.dspark`.

    p = Parser(PROG, "description")                    # a bad flag raises CommandError: one line, no usage
    p.add_common("--steps", default=1000, help="...")  # a flag both take: one spelling and type
    roots = parse_roots(a.roots)                       # --roots LABEL=PATH ... (the interpreter's by default)

    @one_line_errors(PROG)                             # CommandError, CheckpointMismatch -> one line, status 2
    def main(argv=None) -> int: ...

    if TimeBudget(limit_s).exhausted(steps_done, end_s): ...   # --time-limit-s: stop before another step
    reserve = save_reserve_s(state) + (EXPORT_RESERVE_S if exports else 0)  # what follows the last step
    positive("--lr", a.lr); not_a_file("--out", a.out)  # the checks both make, in one wording
    seconds = save(rep, run_dir, step, state, record)  # a checkpoint, reported as one line
    outputs, seconds = evaluate(program, calls)        # an evaluation, read back from the device once

Each trainer keeps its own flags, checks and messages; what is here is the part whose rule is the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
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


def positive(flag: str, value: float) -> None:
    if not value > 0 or not math.isfinite(value):
        raise CommandError(f"{flag} must be a positive number, got {value}")


def not_a_file(flag: str, path: Path | None) -> None:
    """A run or export directory: created when missing, refused when a file is there."""
    if path is not None and path.exists() and not path.is_dir():
        raise CommandError(f"{flag} {path} is a file, not a directory")


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


# What the time limit keeps in hand for the work after the last step, before it has been measured in the call:
# a save writes about SAVE_BYTES_PER_S; an export with its smoke completion takes EXPORT_RESERVE_S.
SAVE_BYTES_PER_S = 50_000_000
SAVE_FIXED_S = 2.0
EXPORT_RESERVE_S = 45.0


def save_reserve_s(state) -> float:
    """Seconds a save of `state` is expected to take, before one has been timed."""
    return SAVE_FIXED_S + sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / SAVE_BYTES_PER_S


@dataclasses.dataclass(frozen=True)
class TimeBudget:
    """--time-limit-s (None: no limit), counted from the start of the call. The first step of a call is always
    taken, so every call makes progress; after it, a step is taken only when the call, taking it, would still
    end within the limit. Where it would end is the trainer's estimate, in seconds since the call started: the
    time at the last sync, the steps in flight and the next one at the measured step time, then what follows the
    loop (evaluation, save, export)."""

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
