"""Layer-stacked weights read in place (issue 48's structural fix for the host's dispatch): a chain of L Pallas
`linear` launches, one per layer, with the weights passed three ways:
- separate: L arrays, one per layer (the engine today: an argument array per weight);
- stacked, in place: one [L, N, K] array, each launch reading its layer through lingjax.stacked.layer_of;
- stacked, sliced: the same array sliced per layer before the launch (XLA copies each slice: the trap);
- stacked, scanned: one launch site in a loop over the layers (lax.scan), its counter the layer index: one layer
  compiled once, whatever L (issue 51's compile time).
For each: the compile time, the device time per call (calls back to back, one block at the end, median of
batches), the host's time to dispatch one call onto an idle device, and the launches in the optimised HLO; plain
and fp8 weights.

    python bench/stacked_bench.py --layers 35 --dim 2560 --out stacked.md
    python bench/stacked_bench.py --layers 3 --dim 256 --n 2      # a CPU check (interpret mode)
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from common import Report, add_options, heading, launch_summary, parser
from lingjax.ops.fp8 import quantize_on_device
from lingjax.pallas.linear import linear
from lingjax.stacked import layer_of

F32, BF16 = jnp.float32, jnp.bfloat16


def chain(mode: str, layers: int):
    """-> fn(weights, x) -> x after `layers` launches of x <- linear(x, w_i) (x [16, D] bf16)."""

    def fn(weights, x):
        if mode == "scanned":
            return jax.lax.scan(lambda x, i: (linear(x, layer_of(weights, i)), None), x, jnp.arange(layers))[0]
        for i in range(layers):
            if mode == "separate":
                w = weights[i]
            elif mode == "in place":
                w = layer_of(weights, i)
            else:
                w = weights[i]  # a slice of the stack: XLA copies it for the custom call
            x = linear(x, w)
        return x

    return jax.jit(fn, donate_argnums=(1,))


def weights_for(mode: str, stack):
    if mode == "separate":
        return tuple(stack[i] for i in range(stack.shape[0]))
    return stack


def timed(fn, weights, x0, n: int, batches: int = 5) -> tuple[float, float]:
    """-> (device-paced seconds per call, the host's seconds to dispatch one call onto an idle device)."""
    per_call = []
    for _ in range(batches):
        x = jnp.array(x0)
        jax.block_until_ready(x)
        t = time.perf_counter()
        for _ in range(n):
            x = fn(weights, x)
        jax.block_until_ready(x)
        per_call.append((time.perf_counter() - t) / n)
    idle = []
    x = jnp.array(x0)
    for _ in range(n):
        jax.block_until_ready(x)
        t = time.perf_counter()
        x = fn(weights, x)
        idle.append(time.perf_counter() - t)
    jax.block_until_ready(x)
    return statistics.median(per_call), statistics.median(idle)


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "out")
    ap.add_argument("--layers", type=int, default=35, help="launches in the chain (Flash has 35 KDA layers)")
    ap.add_argument("--dim", type=int, default=2560, help="N = K of each weight (Flash's hidden size)")
    ap.add_argument("--n", type=int, default=20, help="calls per timed batch")
    ap.add_argument("--weights", nargs="+", default=["dense", "fp8"], choices=["dense", "fp8"])
    args = ap.parse_args(argv)
    say = Report(args.out)
    heading(say, f"Stacked weights read in place: {args.layers} Pallas linear launches of [16, {args.dim}] x "
                 f"[{args.dim}, {args.dim}]")
    say.table("weights", "passed as", "argument arrays", "compile s", "µs/call", "µs/launch", "idle host µs/call",
              "launches in HLO", "max |Δ| against separate")
    x0 = (jax.random.normal(jax.random.key(1), (16, args.dim), F32)).astype(BF16)
    for kind in args.weights:
        stack = (jax.random.normal(jax.random.key(0), (args.layers, args.dim, args.dim), F32)
                 * args.dim**-0.5).astype(BF16)
        if kind == "fp8":
            stack = quantize_on_device(stack.astype(F32), (128, 128))
        outs = {}
        for mode in ("separate", "in place", "sliced", "scanned"):
            fn = chain(mode, args.layers)
            weights = weights_for(mode, stack)
            arrays = len(jax.tree.leaves(weights)) + 1
            began = time.perf_counter()
            hlo = fn.lower(weights, x0).compile().as_text()
            compile_s = time.perf_counter() - began
            outs[mode] = fn(weights, jnp.array(x0))
            t, idle = timed(fn, weights, x0, args.n)
            diff = float(jnp.max(jnp.abs(outs[mode].astype(F32) - outs["separate"].astype(F32))))
            say.row(kind, mode, arrays, f"{compile_s:.1f}", f"{t * 1e6:.0f}", f"{t * 1e6 / args.layers:.2f}",
                    f"{idle * 1e6:.0f}", launch_summary(hlo), f"{diff:.3g}")
        del stack
    say()
    say("µs/launch: the call's device-paced time over its launches. A stacked weight read in place should cost what "
        "separate ones do on the device, with one argument array in place of L; a sliced one adds a copy per layer.")


if __name__ == "__main__":
    main()
