"""A generation's programs compiled together, before the first of them runs.

Compiling one program is mostly XLA's work on one host thread, and a generation needs several (the prefill of a
chunk, of a shorter last chunk, the decode step or the speculative round): compiled one after another at their first
calls, a first request waits for their sum. Here each is traced and lowered in turn (Python's part), then XLA
compiles them all at once on a thread pool, so the wait is about the slowest one. jit keeps what was compiled for
those arguments: the calls that follow compile nothing (tests/test_compile_once.py). bench/compile_bench.py
measures both ways (docs/engine.md, start-up). With the program store on (lingjax.program_store), a step program
stored by an earlier process is read back rather than traced and lowered.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import jax

from lingjax import compile_watch
from lingjax.program_store import StepProgram


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


def _prepared(job: Job):
    """What compiles for the job: a step program's stored form where the program store keeps it
    (lingjax.program_store.StepProgram.prepare), else the program itself."""
    return job.program.prepare(job.args) if isinstance(job.program, StepProgram) else job.program


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
        lowered = [_prepared(job).trace(*job.args).lower() for job in todo.values()]
        if len(lowered) == 1:
            lowered[0].compile()
        else:
            with ThreadPoolExecutor(min(len(lowered), os.cpu_count() or 1),
                                    thread_name_prefix="lingjax-compile") as pool:
                list(pool.map(lambda program: program.compile(), lowered))
    done.update(todo)
