"""Where the host's time goes at TP: per CUDA-graph launch, per all-reduce, per argument.

    python bench/launch_bench.py --tp 1 2 --layers 8 32 96 --repeat 1 8 --out launch.md
    python bench/launch_bench.py --tp 2 --processes 2 --out launch.md     # also as 2 processes of one GPU each
    python bench/launch_bench.py --tp 1 --layers 8 --repeat 1 2 --n 5      # a CPU check

Under TP each all-reduce left out of the CUDA graphs splits XLA's graph, so a step is many graph launches plus
all-reduces per device. This isolates those costs without the model: a chain of `layers` blocks, each a GEMV of
the preset's hidden size (--model) through its own weight (so XLA keeps one kernel per block) followed, under TP,
by a psum over the mesh; compiled with lingjax.execution.step_jit (the step programs' command-buffer options). For
each configuration it prints the device time per call (N calls back to back, one block at the end) and the host's
dispatch time per call, both also per block, for:
- weights as `layers` separate arrays or as one stacked array (the per-argument cost of a call);
- all-reduces outside the graphs (split) or inside (in graphs: CompileOptions.collectives_in_graphs);
- the chain run once per call, or `repeat` times in one call (a lax.scan): with the host's cost per call shared,
  the device time per block is the GPU's own cost of a block (at TP2: GEMV + all-reduce, so the TP2 - TP1
  difference is an all-reduce's device cost when nothing waits on the host).
Host dispatch ≈ device time means the host sets the pace; the slope over `layers` is the per-block cost.

--processes N runs the TP=N rows again as N processes of one GPU each (jax.distributed, as SGLang runs one
process per GPU): in one process, one host drives every device and each all-reduce makes the devices' launch
threads meet. Rank 0 reports; its rows say "N procs", and this process's rows follow them in the same file.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from common import Report, add_options, config_of, heading, parser
from lingjax import sharding
from lingjax.execution import CompileOptions, step_jit


def make_program(d: int, tp: int, layers: int, stacked: bool, whole: bool, repeat: int = 1, rows: int = 1):
    """-> (jitted fn(weights, x) -> x, weights, x): `layers` row-parallel [d, d] GEMVs of `rows` rows, a psum after
    each under TP (the all-reduced partial sums are [rows, d] f32, as in the model), the whole chain `repeat`
    times."""
    mesh = sharding.make_mesh(tp) if tp > 1 else None
    w_spec = P(None, None, sharding.AXIS) if stacked else tuple(P(None, sharding.AXIS) for _ in range(layers))

    def draw_all():
        keys = jax.random.split(jax.random.key(0), layers)
        draw = lambda k: (jax.random.normal(k, (d, d), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
        return jnp.stack([draw(k) for k in keys]) if stacked else tuple(draw(k) for k in keys)

    # drawn by a jitted program straight into their shards: the one way that also works when each
    # process holds one device (jax.distributed)
    place = (lambda spec: NamedSharding(mesh, spec)) if mesh is not None else (lambda spec: None)
    weights = jax.jit(draw_all, out_shardings=jax.tree.map(place, w_spec, is_leaf=lambda a: isinstance(a, P)))()
    x = jax.jit(lambda: jnp.ones((rows, d), jnp.bfloat16), out_shardings=place(P()))()

    def body(ws, h):
        for i in range(layers):
            w = ws[i]  # [d, d / tp]: this device's slice of the input features (row-parallel)
            mine = h if tp == 1 else jax.lax.dynamic_slice_in_dim(
                h, jax.lax.axis_index(sharding.AXIS) * w.shape[1], w.shape[1], axis=1)
            part = jnp.dot(mine, w.T, preferred_element_type=jnp.float32)
            if tp > 1:
                part = jax.lax.psum(part, sharding.AXIS)
            h = jnp.tanh(part).astype(h.dtype)
        return h

    def chain(ws, h):
        if repeat == 1:
            return body(ws, h)
        return jax.lax.scan(lambda c, _: (body(ws, c), None), h, length=repeat)[0]

    fn = chain
    if mesh is not None:
        fn = jax.shard_map(chain, mesh=mesh, in_specs=(w_spec, P()), out_specs=P(), check_vma=False)
    return step_jit(fn, CompileOptions(collectives_in_graphs=whole)), weights, x


def timed(fn, weights, x, n: int) -> tuple[float, float]:
    """Medians over 7 batches of n calls: (device-paced seconds per call, host dispatch seconds per call)."""
    jax.block_until_ready(fn(weights, x))
    per_call, dispatch = [], []
    for _ in range(7):
        h = x
        t = time.perf_counter()
        for _ in range(n):
            h = fn(weights, h)
        dispatch.append((time.perf_counter() - t) / n)
        jax.block_until_ready(h)
        per_call.append((time.perf_counter() - t) / n)
    return statistics.median(per_call), statistics.median(dispatch)


RANK_ENV = "LAUNCH_BENCH_RANK"  # set in the processes of --processes N: "rank/N/port"


def run_processes(n: int) -> int:
    """Runs this script as n processes of one GPU each (the TP=n rows only); their exit status."""
    port = 20000 + os.getpid() % 20000
    procs = [subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, RANK_ENV: f"{r}/{n}/{port}"})
             for r in range(n)]
    return max(p.wait() for p in procs)


def configurations(args, procs: int):
    """(tp, layers, repeat, stacked, whole) of every row, in order."""
    for tp in [procs] if procs > 1 else args.tp:
        for layers in args.layers:
            for repeat in args.repeat:
                for stacked in (w == "stacked" for w in args.weights):
                    for whole in (False, True) if tp > 1 else (False,):
                        yield tp, layers, repeat, stacked, whole


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "tp", "out", many=("tp",), model="flash", tp=[1, 2])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32, 96])
    ap.add_argument("--repeat", type=int, nargs="+", default=[1, 8], help="chain runs per call (a lax.scan)")
    ap.add_argument("--n", type=int, default=50, help="calls per timed batch")
    ap.add_argument("--rows", type=int, default=1,
                    help="rows of x (a decode/verify of the model all-reduces 16 padded rows)")
    ap.add_argument("--weights", nargs="+", choices=["separate", "stacked"], default=["separate", "stacked"])
    ap.add_argument("--processes", type=int, default=1,
                    help="also run the TP=N rows as N processes of one GPU each (first, before this process takes "
                         "the GPUs)")
    args = ap.parse_args(argv)
    rank, procs = 0, 1
    if RANK_ENV in os.environ:
        rank, procs, port = (int(v) for v in os.environ[RANK_ENV].split("/"))
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=procs, process_id=rank,
                                   local_device_ids=[rank])
    elif args.processes > 1 and run_processes(args.processes) != 0:
        sys.exit("the multi-process rows failed")
    d = config_of(args.model).hidden_size
    # rank 0 reports; after the processes' rows, this process's rows follow them in the same file
    say = Report(args.out, append=procs == 1 and args.processes > 1, silent=rank != 0)
    heading(say, f"launch_bench: {args.model}'s x [{args.rows}, {d}]" + (f", {procs} processes" if procs > 1 else ""))
    say()
    say.table("tp", "layers", "repeat", "weights", "all-reduces", "µs/call", "host dispatch µs/call", "µs/layer",
              "host µs/layer")
    for tp, layers, repeat, stacked, whole in configurations(args, procs):
        fn, weights, x = make_program(d, tp, layers, stacked, whole, repeat, args.rows)
        call, host = timed(fn, weights, x, args.n)
        blocks = layers * repeat
        say.row(f"{tp}{f' ({procs} procs)' if procs > 1 else ''}", layers, repeat,
                "stacked" if stacked else "separate", ("in graphs" if whole else "split") if tp > 1 else "-",
                f"{call * 1e6:.0f}", f"{host * 1e6:.0f}", f"{call / blocks * 1e6:.2f}", f"{host / blocks * 1e6:.2f}")
        del fn, weights


if __name__ == "__main__":
    main()
