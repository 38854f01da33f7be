"""Steady-state steps of one program, dispatched back to back: what `lingjax profile` times and traces.

A program here is the plain decode step (T=1), a NEXTN round (the MTP chain's S drafts, verify S+1) or a
DSpark round (the drafter's block, verify block+1), each run after a prompt's prefill exactly as the engine
runs it (lingjax.engine, lingjax.spec.step); or one prefill chunk (the prompt, padded as the engine pads a chunk),
each call prefilling it again at the same position (0, or a later chunk's) into the same cache. `Steady` holds
the three things a measurement needs: a fresh state, one call, and the call's optimised HLO (for the census's named
scopes, lingjax.profiling).

    steady = steady_program(model, "decode", prompt)
    launch = steady.launcher(20)          # a fresh state with room for 20 calls
    start, last = launch()                # 20 calls dispatched; block on `last` to finish
    step_s = timed(steady, 20)            # the median seconds per step, unprofiled
    host_s = dispatch_seconds(steady)     # the host's own seconds to dispatch one call
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

PROGRAMS = ("decode", "nextn", "dspark", "prefill")


@dataclasses.dataclass
class Steady:
    name: str  # e.g. "decode T=1", "NEXTN round S=3"
    prepare: Callable  # prepare(n) -> a fresh state after the prompt, with room for n calls
    call: Callable  # call(state) -> (state, output)
    lower: Callable  # lower(state) -> the call's optimised HLO text
    drafts: int | None = None  # a round's drafts (S); None for decode

    def launcher(self, n: int):
        """-> launch(): n calls from a fresh state -> (start time, the last output)."""
        state = self.prepare(n)
        jax.block_until_ready(state)

        def launch():
            nonlocal state
            t = time.perf_counter()
            out = None
            for _ in range(n):
                state, out = self.call(state)
            return t, out

        return launch

    def hlo(self) -> str:
        return self.lower(self.prepare(1))


def steady_program(model, program: str, prompt: np.ndarray, steps: int | None = None, per_call: int = 1,
                   start: int = 0) -> Steady:
    """The steady state of `program` (PROGRAMS) on `model` after `prompt` (int32 [P]; prefill: the chunk), greedy.
    steps: drafts per round (nextn: default lingjax.config.DEFAULT_STEPS; dspark: the drafter's block size).
    start (prefill): the chunk's first position; the cache has the capacity the engine gives a prompt ending with
    the padded chunk (lingjax.engine.cache_capacity), its earlier slots zero.
    per_call: steps (decode) or rounds run in one device call (a lax.scan: rounds_per_call); a call then outputs
    per_call steps' results. The cache has room for 6 tokens a step of n calls (what bench/step_bench has always
    timed: an MLA step reads its whole cache, so the room is part of the figure)."""
    from lingjax import engine
    from lingjax.sampling import SamplingParams
    from lingjax.spec import step as spec_step

    # every host value committed as the engine commits them (Model.put): an uncommitted first argument compiles the
    # program a second time once the previous call's committed outputs come back
    sampling, key = SamplingParams(), model.put(jax.random.key(0))
    if program == "decode":
        _, decode = model.step_programs(sampling, per_call)

        def prepare(n):
            token, cache = engine.plain_prefill(model, prompt, 6 * n * per_call, sampling, key, per_call)
            return token, cache, model.put(np.int32(prompt.size))

        def call(state):
            token, cache, pos = state
            _, token, pos, cache = decode(model.weights, cache, token, pos, key)
            return (token, cache, pos), token

        def lower(state):
            return decode.lower(model.weights, state[1], state[0], state[2], key).compile().as_text()

        return Steady("decode T=1" + (f", {per_call} per call" if per_call > 1 else ""), prepare, call, lower)
    if program == "prefill":
        prefill, _ = model.step_programs(sampling)
        chunk = np.zeros(engine.prefill_bucket(prompt.size), np.int32)
        chunk[: prompt.size] = prompt
        capacity = engine.cache_capacity(start + chunk.size, 0)

        def prepare(n):
            del n  # every call writes the same positions
            return model.new_cache(capacity), *model.put((chunk, np.int32(start), np.int32(prompt.size)))

        def call(state):
            cache, tokens, first, n_valid = state
            token, cache = prefill(model.weights, cache, tokens, first, n_valid, key)
            return (cache, tokens, first, n_valid), token

        def lower(state):
            return prefill.lower(model.weights, *state, key).compile().as_text()

        return Steady(f"prefill chunk T={chunk.size}" + (f" at position {start}" if start else ""), prepare, call,
                      lower)
    if program not in PROGRAMS:
        raise ValueError(f"unknown program {program!r} (one of {', '.join(PROGRAMS)})")
    drafter = engine.make_drafter(model, program, steps)
    spec = spec_step.spec_program(model, drafter, sampling, per_call)

    def prepare(n):
        return engine.spec_prefill(model, spec, drafter, prompt, 6 * n * per_call, key)[1]

    def call(state):
        return spec.round(spec.weights, state)

    def lower(state):
        return spec.round.lower(spec.weights, state).compile().as_text()

    label = "NEXTN" if program == "nextn" else "DSpark"
    return Steady(f"{label} round S={drafter.steps}" + (f", {per_call} per call" if per_call > 1 else ""), prepare,
                  call, lower, drafter.steps)


def timed(steady: Steady, n: int, batches: int = 3) -> float:
    """Seconds per step of n calls dispatched back to back with one block at the end: the median of `batches`
    such runs, each from a fresh state (the real, unprofiled step)."""
    times = []
    for _ in range(batches):
        t, out = steady.launcher(n)()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def dispatch_seconds(steady: Steady, calls: int = 10) -> float:
    """The host's seconds to dispatch one call onto an idle device: the median over `calls` calls, each made after
    the one before has finished. Calls dispatched back to back can wait for room in the device's launch queue, so
    their host time reads the device's pace whenever the device is the slower one; here nothing is queued."""
    state = steady.prepare(calls)
    jax.block_until_ready(state)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        state, out = steady.call(state)
        times.append(time.perf_counter() - t)
        jax.block_until_ready((state, out))
    return statistics.median(times)
