"""A generation's programs compiled together, before the first of them runs.

Compiling one program is mostly XLA's work on one host thread, and a generation needs several (the prefill of a
chunk, of a shorter last chunk, the decode step or the speculative round): compiled one after another at their first
calls, a first request waits for their sum. Here each is traced and lowered in turn (Python's part), then XLA
compiles them all at once on a thread pool, so the wait is about the slowest one. jit keeps what was compiled for
those arguments: the calls that follow compile nothing (tests/test_compile_once.py). bench/compile_bench.py
measures both ways (docs/engine.md, start-up).
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import jax

from lingjax import compile_watch


@dataclasses.dataclass(frozen=True)
class Job:
    """One program to compile: `program` (a jitted function) for `args`, the arguments its call will get (arrays,
    or stand-ins of the same shape, type and placement; nothing runs), named as compile_watch names it."""

    name: str
    program: object
    args: tuple

    def key(self) -> tuple:
        """What tells this compiled program from the program's others: the arguments' structure and types."""
        leaves, tree = jax.tree.flatten(self.args)
        return (self.program, tree, tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) for x in leaves))


def compile_together(done: set, jobs: list[Job]) -> None:
    """Compiles the jobs whose key is not in `done` (a model's set of compiled programs: Model.compiled), all at
    once, and adds their keys to it. One compile_watch status line covers them."""
    todo = {}
    for job in jobs:
        key = job.key()
        if key not in done and key not in todo:
            todo[key] = job
    if not todo:
        return
    with compile_watch.together([job.name for job in todo.values()]):
        lowered = [job.program.trace(*job.args).lower() for job in todo.values()]
        if len(lowered) == 1:
            lowered[0].compile()
        else:
            with ThreadPoolExecutor(min(len(lowered), os.cpu_count() or 1),
                                    thread_name_prefix="lingjax-compile") as pool:
                list(pool.map(lambda program: program.compile(), lowered))
    done.update(todo)
