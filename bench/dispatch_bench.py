"""The host's own time to dispatch one call of a jitted program onto an idle device, against the number of argument
arrays (issue 48: measure how the dispatch grows with the arrays before changing the engine's layout), and against
the number of kernels in a step program's CUDA graph.

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

The second table separates the other host cost a step program has: its CUDA graph. A step program is compiled
with lingjax.execution.step_jit, which on a GPU puts the whole program into CUDA graphs (command buffers). A
graph's launch costs the host little per kernel while the addresses it was recorded with hold; when an argument's
or an output's address changes, the runtime first updates the graph, re-recording the kernels that use a changed
address, at a host cost per kernel; without graphs the host launches every kernel itself. The program here is a
chain of K small kernels (K fusions of a [4096] f32 array, kept apart by optimisation barriers) with a small int32
counter beside it, compiled by step_jit, in four variants per K (--kernels):
- graphs, x donated, one small output new each call: the array donated, the counter not (a new buffer each
  call), as the engine's step donates its caches and returns new tokens;
- graphs, all donated: every address stable from call to call (the cheapest a graph can be);
- graphs, nothing donated: every argument and output at a new address each call;
- no graphs, all donated: xla_gpu_enable_command_buffer empty, each kernel launched by the host.
Each row has the idle host's time per call (dispatch_seconds, as above) and the device-paced time per call: calls
back to back with one wait at the end (lingjax.steady.timed), where the host's time hides behind the device's
when the device is the slower. The last rows are each variant's cost per kernel: the slope between the smallest
and the largest K. On the CPU step_jit is plain jax.jit (no graphs, the graph options unused), so there the
variants differ in donation only, and the table checks the script, not the graphs.

    python bench/dispatch_bench.py --out dispatch.md
    python bench/dispatch_bench.py --arrays 1 64 1024 --calls 500
    python bench/dispatch_bench.py --kernels 64 512 --calls 100
    python bench/dispatch_bench.py --smoke        # few arrays, short chains, few calls: a script check
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from common import BF16, F32, Report, add_options, heading, parser, progress
from lingjax.execution import CompileOptions, step_jit
from lingjax.steady import Steady, dispatch_seconds, timed

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


def slope_us(seconds: dict[int, float]) -> float:
    """µs per unit of the key (an array, a kernel): the slope between the smallest and the largest key."""
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
    say.row("µs per array", *(f"{slope_us(seconds[v]):.3f}" for v in VARIANTS))


CHAIN_WIDTH = 4096  # f32 elements of the chain's array: each kernel is small, so its launch is the cost
NO_GRAPHS = CompileOptions(xla_options=(("xla_gpu_enable_command_buffer", ""),))
# variant -> (compile options, donated arguments of chain(x, counter))
CHAIN_VARIANTS = {
    "graphs, x donated, one small output new each call": (CompileOptions(), (0,)),
    "graphs, all donated (stable addresses)": (CompileOptions(), (0, 1)),
    "graphs, nothing donated (addresses change every call)": (CompileOptions(), ()),
    "no graphs, all donated": (NO_GRAPHS, (0, 1)),
}


def chain(kernels: int):
    """-> f(x, counter): `kernels` small fusions of x one after another (an optimisation barrier after each keeps
    them apart), and counter + 1."""

    def f(x, counter):
        for i in range(kernels):
            x = jax.lax.optimization_barrier(jnp.sin(x) * 1.0001 + i)
        return x, counter + 1

    return f


def steady_chain(variant: str, kernels: int) -> Steady:
    """The chain of `kernels` kernels compiled as `variant` (CHAIN_VARIANTS) by step_jit, as a Steady: prepare()
    compiles it with one call and returns its outputs; call() passes the state and returns the outputs as the
    next state (donated or not, each call takes the last call's outputs, as a step takes the last step's)."""
    options, donated = CHAIN_VARIANTS[variant]
    fn = step_jit(chain(kernels), options, donate_argnums=donated)

    def prepare(calls):
        del calls  # the state does not grow
        return fn(jnp.ones((CHAIN_WIDTH,), F32), jnp.int32(0))  # compiles

    def call(state):
        out = fn(*state)
        return out, out

    def lower(state):
        return fn.lower(*state).compile().as_text()

    return Steady(f"{variant}, K={kernels}", prepare, call, lower)


def report_chains(say: Report, kernels: list[int], calls: int) -> None:
    """The second table: a row per K and variant as soon as it is measured, then each variant's µs per kernel."""
    say.table("kernels", "variant", "idle host µs/call", "device-paced µs/call")
    host, paced = ({variant: {} for variant in CHAIN_VARIANTS} for _ in range(2))
    for k in kernels:
        for variant in CHAIN_VARIANTS:
            steady = steady_chain(variant, k)
            host[variant][k] = dispatch_seconds(steady, calls)
            paced[variant][k] = timed(steady, calls)
            progress(f"K={k} {variant}: host {host[variant][k] * 1e6:.1f} µs, paced {paced[variant][k] * 1e6:.1f} µs")
            say.row(k, variant, f"{host[variant][k] * 1e6:.1f}", f"{paced[variant][k] * 1e6:.1f}")
    if len(set(kernels)) > 1:
        for variant in CHAIN_VARIANTS:
            say.row("µs per kernel", variant, f"{slope_us(host[variant]):.3f}", f"{slope_us(paced[variant]):.3f}")


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "smoke", "out")
    ap.add_argument("--arrays", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 2048],
                    help="the numbers N of argument arrays")
    ap.add_argument("--kernels", type=int, nargs="+", default=[8, 64, 256, 512],
                    help="the numbers K of kernels in the chains of the second table (its CUDA graph's cost)")
    ap.add_argument("--calls", type=int, default=200, help="calls per figure (their median)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.arrays, args.kernels, args.calls = [1, 16, 64], [8, 16], 20
    say = Report(args.out)
    heading(say, f"The idle host's time per call against the argument arrays ([{WIDTH}] bf16 each) and against "
                 "the kernels of a CUDA graph")
    say(f"median of {args.calls} calls, each after the one before has finished (lingjax.steady.dispatch_seconds); "
        "µs per array: the slope between the smallest and the largest N")
    report(say, args.arrays, args.calls)
    say()
    say(f"A chain of K small kernels ([{CHAIN_WIDTH}] f32) compiled by lingjax.execution.step_jit; idle host: as "
        f"above; device-paced: {args.calls} calls back to back, one wait at the end (lingjax.steady.timed, the "
        "median of 3 runs)")
    if jax.default_backend() != "gpu":
        say(f"on the {jax.default_backend().upper()} step_jit is plain jax.jit: no CUDA graphs and the graph "
            "options unused, so the variants differ in donation only")
    report_chains(say, args.kernels, args.calls)


if __name__ == "__main__":
    main()
