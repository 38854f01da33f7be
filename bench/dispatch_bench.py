"""The host's own time to dispatch one call of a jitted program onto an idle device, against the number of argument
arrays (issue 48: measure how the dispatch grows with the arrays before changing the engine's layout).

A call's host cost has a part per argument array: jax flattens the pytree, checks and hands each buffer to the
runtime, and for a donated array also gives up the old buffer and wraps a new output. The engine passes every
weight and cache of every layer as an array of its own (hundreds of them, the caches donated and returned), so
this part may be most of the host's cost of a step. Measured here, for N small [128] bf16 arrays, all different
buffers, passed as one tuple:
- read: N arrays in, one scalar out (the program reads every array: the weights);
- donated: N arrays donated and returned updated, each + 1 (the caches);
- stacked, read / donated: the same bytes as one [N, 128] array (the structural fix: layers stacked into one
  array), read, or donated and returned updated.
Each figure is lingjax.steady.dispatch_seconds: the median over --calls calls of the host's time to return from one
call, each made after the one before has finished (nothing queued, so the device's pace does not enter). The last
row is the growth per array: the slope between the smallest and the largest N. Timings on the CPU show the shape
of the curve only; a GPU's runtime has its own cost per buffer.

    python bench/dispatch_bench.py --out dispatch.md
    python bench/dispatch_bench.py --arrays 1 64 1024 --calls 500
    python bench/dispatch_bench.py --smoke        # few arrays, few calls: a script check
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from common import BF16, F32, Report, add_options, heading, parser, progress
from lingjax.steady import Steady, dispatch_seconds

WIDTH = 128  # elements of each small array (one row of the stack)
VARIANTS = ("read", "donated", "stacked, read", "stacked, donated")
COLUMNS = {"read": "N arrays, read µs", "donated": "N arrays donated, returned µs",
           "stacked, read": "one [N, 128] array, read µs", "stacked, donated": "one [N, 128] donated, returned µs"}


def read_all(arrays):
    """One scalar from every array's first element (a program that reads each argument, so none is pruned)."""
    return sum(a[0].astype(F32) for a in arrays)


def read_stack(stack):
    return jnp.sum(stack[:, 0], dtype=F32)


def add_one(arrays):
    return tuple(a + 1 for a in arrays)


def program(variant: str):
    """-> the jitted program of `variant` (VARIANTS), taking its arrays as one argument."""
    stacked, donated = variant.startswith("stacked"), variant.endswith("donated")
    if donated:
        return jax.jit((lambda s: s + 1) if stacked else add_one, donate_argnums=(0,))
    return jax.jit(read_stack if stacked else read_all)


def fresh_arrays(variant: str, n: int):
    """N different [WIDTH] bf16 buffers on the device, or one [N, WIDTH] array for the stacked variants."""
    stack = (jnp.arange(n * WIDTH, dtype=F32).reshape(n, WIDTH) % 251).astype(BF16)
    if variant.startswith("stacked"):
        return stack
    return tuple(stack[i] + 0 for i in range(n))  # each its own buffer (+ 0: not a view of the stack)


def steady_call(variant: str, n: int) -> Steady:
    """`variant` at N arrays as a lingjax.steady.Steady: prepare() compiles the program with one call and returns
    fresh arrays; call() passes them and returns the arrays to pass next (the outputs where donated)."""
    fn = program(variant)
    donated = variant.endswith("donated")

    def prepare(calls):
        del calls  # every call takes the same arrays (donated: the last call's outputs)
        arrays = fresh_arrays(variant, n)
        out = fn(arrays)  # compiles
        return out if donated else arrays

    def call(arrays):
        out = fn(arrays)
        return (out, out) if donated else (arrays, out)

    def lower(arrays):
        return fn.lower(arrays).compile().as_text()

    return Steady(f"{variant}, N={n}", prepare, call, lower)


def per_array_us(seconds: dict[int, float]) -> float:
    """µs per array: the slope between the smallest and the largest N."""
    lo, hi = min(seconds), max(seconds)
    return (seconds[hi] - seconds[lo]) * 1e6 / (hi - lo) if hi > lo else float("nan")


def measure(n: int, calls: int) -> dict[str, float]:
    """-> {variant: the idle host's seconds per call at N arrays}."""
    seconds = {}
    for variant in VARIANTS:
        seconds[variant] = dispatch_seconds(steady_call(variant, n), calls)
        progress(f"N={n} {variant}: {seconds[variant] * 1e6:.1f} µs")
    return seconds


def report(say: Report, arrays: list[int], calls: int) -> None:
    """The table, a row per N as soon as it is measured (a run cut short keeps its rows), then the slopes."""
    say.table("N", *(COLUMNS[v] for v in VARIANTS))
    seconds = {variant: {} for variant in VARIANTS}
    for n in arrays:
        for variant, s in measure(n, calls).items():
            seconds[variant][n] = s
        say.row(n, *(f"{seconds[v][n] * 1e6:.1f}" for v in VARIANTS))
    say.row("µs per array", *(f"{per_array_us(seconds[v]):.3f}" for v in VARIANTS))


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "smoke", "out")
    ap.add_argument("--arrays", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 2048],
                    help="the numbers N of argument arrays")
    ap.add_argument("--calls", type=int, default=200, help="calls per figure (their median)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.arrays, args.calls = [1, 16, 64], 20
    say = Report(args.out)
    heading(say, f"The idle host's time per call against the argument arrays ([{WIDTH}] bf16 each)")
    say(f"median of {args.calls} calls, each after the one before has finished (lingjax.steady.dispatch_seconds); "
        "µs per array: the slope between the smallest and the largest N")
    report(say, args.arrays, args.calls)


if __name__ == "__main__":
    main()
