"""A sub-layer's residual add and the next norm at decode and verify rows: lingjax.pallas.residual_norm (one launch)
against its XLA reference (XLA's fusions), per shape and tuning.

    python bench/residual_norm_bench.py --out residual_norm.md
    python bench/residual_norm_bench.py --smoke       # tiny shapes, interpret mode off the GPU: a script check

Shapes: the residual stream [16, D] with an o_proj's K-split partial sums [splits, 16, D] f32, and a decode's
expert terms [10, 1, D] f32 (8 slots, the padding row, the shared expert). One program chains --chain calls (each
call's h the next call's x, so they cannot overlap or be merged) under the step programs' compiler options; the
figure is its time per call, the median of batches dispatched back to back (bench/common.pipelined_seconds), each
call's own launch latency included, which is what the op is for. `bits` says whether the kernel's h and norm equal
the reference's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from common import BF16, F32, Report, add_options, config_of, heading, parser, pipelined_seconds, progress
from lingjax import target
from lingjax.execution import step_compiler_options
from lingjax.ops.norms import residual_rms_norm
from lingjax.pallas.residual_norm import ResidualNormTuning, residual_norm


def chained(op, chain: int, options):
    def run(x, parts, weight):
        h = x
        normed = x
        for _ in range(chain):
            h, normed = op(h, parts, weight)
        return h, normed

    return jax.jit(run, compiler_options=options)


def main(argv=None) -> None:
    ap = parser(__doc__)
    add_options(ap, "model", "smoke", "out", model="mid")
    ap.add_argument("--chain", type=int, default=32, help="calls chained in one program")
    ap.add_argument("--warps", default="4,8,16", help="warps per program to try")
    ap.add_argument("--chunks", default="0,256", help="columns of one load to try (0: the largest up to 1024)")
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args(argv)
    cfg = config_of("tiny" if args.smoke else args.model)
    gpu = target.platform() == "gpu"
    options = step_compiler_options() if gpu else None
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    chain = 2 if args.smoke else args.chain
    say = Report(args.out)
    heading(say, f"residual_norm against XLA: {args.model if not args.smoke else 'tiny'} (D = {d})")
    say(f"{chain} calls chained per program, median of {args.reps} batches; µs per call.")
    say.table("terms", "variant", "µs", "vs XLA", "bits")
    key = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key[0], (16, d), F32).astype(BF16)
    weight = (1 + 0.1 * jax.random.normal(key[1], (d,), F32)).astype(BF16)
    tunings = [ResidualNormTuning(warps=int(w), chunk=int(c)) for w in args.warps.split(",") for c in args.chunks.split(",")]
    for label, shape in (("o_proj splits [8, 16, D]", (8, 16, d)), ("decode experts [10, 1, D]", (10, 1, d))):
        parts = jax.random.normal(key[2], shape, F32) * 0.1
        progress(f"{label}: XLA")
        ref_fn = chained(lambda h, p, w: residual_rms_norm(h, p, w, eps), chain, options)
        want = [np.asarray(a, np.float32) for a in ref_fn(x, parts, weight)]
        xla_us = pipelined_seconds(ref_fn, x, parts, weight, reps=args.reps) / chain * 1e6
        say.row(label, "XLA (the reference's fusions)", f"{xla_us:.2f}", "1.00", "")
        for tuning in tunings:
            if d % (tuning.chunk or 1):
                continue
            progress(f"{label}: {tuning}")
            fn = chained(lambda h, p, w, t=tuning: residual_norm(h, p, w, eps, tuning=t, interpret=not gpu), chain,
                         options)
            got = [np.asarray(a, np.float32) for a in fn(x, parts, weight)]
            same = all(np.array_equal(g, w) for g, w in zip(got, want))
            us = pipelined_seconds(fn, x, parts, weight, reps=args.reps) / chain * 1e6
            say.row(label, f"kernel warps={tuning.warps} chunk={tuning.chunk or 'auto'}", f"{us:.2f}",
                    f"{us / xla_us:.2f}", "equal" if same else "differ")


if __name__ == "__main__":
    main()
