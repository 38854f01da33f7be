"""A prefill chunk's routed experts (lingjax.pallas.moe_experts.fused_experts above 16 tokens) at several expert
block sizes and both forms of the fp8 dots (ExpertTuning.fp8_dots): time per layer, rows bit-equal to the first
variant's, on Flash's MoE layer with fp8 or bf16 weights.

    python bench/moe_prefill_bench.py --out moe_prefill.md             # T = 2048, fp8, block_m 16 .. 128
    python bench/moe_prefill_bench.py --weights dense --tokens 512
    python bench/moe_prefill_bench.py --smoke                          # tiny preset, interpret mode: a CPU check

Why: the expert kernels take (token, slot) pairs in blocks of block_m rows that share one expert, and every block
reads its expert's whole weights (and, in fp8, converts them tile by tile). At the decode's and a verify's 16-row
blocks a 2048-token chunk, ~32 pairs an expert on Flash, has each touched expert span two or three blocks.

One program applies fused_experts (routed and shared experts, the routing fixed beforehand by the Pallas router) to
--layers distinct layers (cold: Flash's experts are 3 GB a layer in fp8), each with its own random x [T, D]; the
time is the median of --reps calls over the layers. `bits` says whether every output row equals the first
variant's bit for bit (the pairs' sums do not depend on the block); a variant of other fp8_dots on fp8 weights rounds
otherwise by declaration and says "other rounding", FAIL above ROUNDING_TOL; `vs first` is the max relative
difference.
"""

from __future__ import annotations

import jax
import numpy as np
from moe_bench import make_layer

from common import BF16, F32, Report, add_options, config_of, heading, median_seconds, moe_shape, parser, progress, rel
from lingjax import target
from lingjax.execution import step_compiler_options
from lingjax.ops.fp8 import BLOCK, device_block, quantize_on_device
from lingjax.pallas.moe_experts import ExpertTuning, fused_experts
from lingjax.pallas.moe_router import route

ROUNDING_TOL = 1e-2  # a variant of other fp8_dots against the first: rounding, not a wrong sum
VARIANTS = [  # (label, tuning)
    ("block_m 16", ExpertTuning()),
    ("block_m 32 (many_token_tiles at 1024 tokens and up)", ExpertTuning(block_m=32)),
    ("block_m 32, fp8 dots in bf16", ExpertTuning(block_m=32, fp8_dots="x")),
    ("block_m 16, fp8 dots in bf16", ExpertTuning(fp8_dots="x")),
    ("block_m 64", ExpertTuning(block_m=64)),
    ("block_m 128", ExpertTuning(block_m=128)),
    ("block_m 64, 8 warps", ExpertTuning(block_m=64, warps_up=8, warps_down=8)),
]


def fp8_layer(p: dict) -> dict:
    """moe_bench.make_layer's weights with every expert matrix (routed and shared) in fp8, 128 x 128 blocks."""
    q = lambda a: quantize_on_device(a, device_block(a.shape, BLOCK))  # noqa: E731
    return {name: q(a) if name in ("wg", "wu", "wd", "sg", "su", "sd") else a for name, a in p.items()}


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "weights", "smoke", "out", model="flash", weights="fp8")
    ap.add_argument("--tokens", type=int, default=2048, help="T: the chunk's tokens")
    ap.add_argument("--layers", type=int, default=4, help="distinct layers in the timed program")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.tokens, args.layers, args.reps = "tiny", 64, 2, 1
    gpu = target.platform() == "gpu"
    shape = moe_shape(config_of(args.model))
    say = Report(args.out)
    heading(say, f"moe_prefill_bench: {args.model}'s MoE layer at T = {args.tokens}, {args.weights} weights")
    layers = [make_layer(jax.random.key(10 + l), shape) for l in range(args.layers)]
    layers = [fp8_layer(p) for p in layers] if args.weights == "fp8" else layers
    xs = [jax.random.normal(jax.random.key(100 + l), (args.tokens, shape.d), F32).astype(BF16)
          for l in range(args.layers)]
    routes = [route(x, p["router"], p["bias"], **shape.routing) for x, p in zip(xs, layers)]
    counts = np.bincount(np.asarray(routes[0][1]).reshape(-1), minlength=shape.e)
    say(f"layer 0: {np.count_nonzero(counts)} of {shape.e} experts touched, {counts[counts > 0].mean():.1f} pairs "
        f"each on average, {counts.max()} at most")
    say.table("tiles", "ms per layer", "bits", "vs first")
    first = first_dots = None
    for label, tuning in VARIANTS[:4] if args.smoke else VARIANTS:
        def run(layers, xs, routes, tuning=tuning):
            return [fused_experts(x, p["wg"], p["wu"], p["wd"], w, ids, shape.limit,
                                  shared=(p["sg"], p["su"], p["sd"]), shared_limit=shape.shared_limit, tuning=tuning)
                    for p, x, (w, ids) in zip(layers, xs, routes)]

        fn = jax.jit(run, compiler_options=step_compiler_options() if gpu else None)
        progress(label)
        try:
            out = np.asarray(fn(layers, xs, routes)[0])
        except Exception as e:  # a tiling that does not compile or launch: reported, the others still run
            say.row(label, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}", "", "")
            continue
        if first is None:
            first, first_dots = out, tuning.fp8_dots
        ms = median_seconds(fn, layers, xs, routes, reps=args.reps) / args.layers * 1e3
        same = bool(np.isfinite(out).all()) and np.array_equal(out.view(np.uint32), first.view(np.uint32))
        # the same fp8_dots must give the same bits; another is a declared rounding, held to ROUNDING_TOL
        e = rel(out, first)
        bits = ("equal" if same else "DIFFER" if tuning.fp8_dots == first_dots or args.weights != "fp8"
                else "other rounding" + ("" if e < ROUNDING_TOL else " FAIL"))
        say.row(label, f"{ms:.3f}", bits, f"{e:.1e}")


if __name__ == "__main__":
    main()
