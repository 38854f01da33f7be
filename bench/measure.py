"""Timing and comparison helpers the GPU bench scripts share."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_seconds(fn, *args, reps: int) -> float:
    """Median wall time of fn(*args) to completion, after one untimed call (compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(elements: int = 2 << 30, warm: int = 10, reps: int = 21) -> float:
    """Read bandwidth in B/s: a bf16 array (4 GiB by default) summed in f32 (a step mostly reads weights),
    after `warm` untimed passes. On the H200 this gives ~3.3-3.9 TB/s where a bf16 copy (read + write) gives
    ~3.0; one process measured 2.73 (7 passes, no warm-up) where the next measured 3.48, so a bench that
    divides by it measures it twice and takes the larger (the stricter floor)."""
    x = jnp.ones((elements,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    for _ in range(warm):
        total(x).block_until_ready()
    return x.nbytes / median_seconds(total, x, reps=reps)


def rel(got, want) -> float:
    """max |got - want| / max |want|; inf when got holds a NaN or an infinity."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)) if np.isfinite(got).all() else float("inf")


def run_or_report(run, say, row: str, empty: int, fails: list, name: str):
    """run()'s result; if it raises (a variant that fails to compile), None after printing `row` with the
    error and `empty` empty cells as a table row and adding `name` to fails, so the other variants still run."""
    try:
        return run()
    except Exception as e:
        say(f"{row} failed: {type(e).__name__}: {str(e)[:80]} |" + " |" * empty)
        fails.append(name)
        return None


def floor_row(row: str, us: float, floor_us: float, err: float, ok: bool) -> str:
    """A timed variant's table row: `row` (its leading cells), µs, floor µs, x floor, rel. err (FAIL if not ok)."""
    return f"{row} {us:.2f} | {floor_us:.2f} | {us / floor_us:.2f} | {err:.1e}{'' if ok else ' FAIL'} |"
