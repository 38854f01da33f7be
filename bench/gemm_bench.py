"""Prefill projections at M rows: lingjax.pallas.gemm against XLA's GEMM (an fp8 weight dequantized in the graph)
compiled as the step programs are (autotuning off) and with autotuning on, per shape of Flash, over tunings.

    python bench/gemm_bench.py --rows 2048 --out gemm.md
    python bench/gemm_bench.py --only fp8 --no-xla-off   # the fp8 shapes, XLA autotuned only
    python bench/gemm_bench.py --smoke                   # tiny shapes, interpret mode off the GPU: a script check

Why: the step programs compile with XLA's GEMM autotuning off (lingjax.execution.step_compiler_options: a GEMM's
algorithm must follow from its shape), and XLA's untuned GEMMs are far from the tensor cores' speed at a prefill
chunk's rows; the Pallas kernel's tiles follow from the shape alone (lingjax.pallas.gemm.plan). This bench says how
far each form is from XLA's best, so a tuning of the kernel is judged against a peer measured in the same process.

For each shape of SHAPES ([N, K], an fp8 weight in 128 x 128 scale blocks or a bf16 one, x --rows bf16 rows), one
program per variant is compiled and timed as the median of batches of calls dispatched back to back. Variants: XLA's
GEMM (lingjax.ops.linear.linear) with the step programs' options (autotuning off), the same with XLA's autotuning on
(xla_gpu_autotune_level=4), and the Pallas kernel at each tuning of TUNINGS (compiled with the step programs' options),
a tuning it does not lower for reported as unsupported; a tuning of other fp8_dots or convert_rows runs on fp8 weights
alone, and its row says whether its bits are the default's. Each row gives the kernel's launch
(plan: tiles, padded rows, grid, swap), `vs exact`: the max error against x · Wᵀ in f32 (the dequantized weight)
relative to its largest value, `vs linear`: the same against lingjax.ops.linear.linear (XLA, autotuning off; it rounds
an fp8 weight to bf16 first, the kernel does not), ms, TFLOP/s (2·M·N·K per call) and `x best XLA`: the time over the
fastest XLA variant's of the same shape (below 1: faster than XLA at its best). There is no peak compute floor: the
ratio is to the peer. Off the GPU (--smoke) only XLA's default compilation runs, and the kernel in interpret mode: the
figures there mean nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from common import BF16, F32, Report, add_options, heading, parser, pipelined_seconds, progress, rel
from lingjax import target
from lingjax.execution import step_compiler_options
from lingjax.ops.fp8 import quantize_on_device
from lingjax.ops.linear import linear
from lingjax.pallas.gemm import GemmTuning, gemm, plan, supports

SHAPES = [  # label, N, K, fp8: Flash's projections on one device
    ("kda in_proj fp8", 5 * 4096, 2560, True),
    ("kda o_proj fp8", 2560, 4096, True),
    ("dense gate fp8", 6144, 2560, True),
    ("dense down fp8", 2560, 6144, True),
    ("kda in_proj bf16", 5 * 4096, 2560, False),
    ("lm_head bf16", 157184, 2560, False),
]
SMOKE_SHAPES = [("tiny fp8", 256, 256, True), ("tiny bf16", 256, 128, False)]
SMOKE_ROWS = 32

TUNINGS = [
    GemmTuning(),
    GemmTuning(swap=True),
    GemmTuning(swap=True, warps=4, stages=4),
    GemmTuning(swap=True, bm=256, stages=3),
    GemmTuning(bk=256),
    # fp8 weights alone (FP8_ONLY): each weight tile converted in registers once per M tile rather than the values
    # once before the launch (the default at 2048 rows), in f16 or in x's dtype (bf16); the same sums
    GemmTuning(convert_rows=0),
    GemmTuning(convert_rows=0, fp8_dots="x"),
    GemmTuning(fp8_dots="x"),
    GemmTuning(stages=2),
]
DEFAULT = GemmTuning()
FP8_ONLY = ("fp8_dots", "convert_rows")  # fields that change nothing on a plain weight
ERR_LIMIT = 1e-2  # vs exact at or above it: FAIL (a bf16 output rounds by up to 2^-8 of its magnitude)


def tuning_name(t: GemmTuning) -> str:
    """The fields of a tuning that differ from the default ("default" if none)."""
    changed = [f"{f.name}={getattr(t, f.name)}" for f in dataclasses.fields(t)
               if getattr(t, f.name) != getattr(DEFAULT, f.name)]
    return "Pallas, " + (" ".join(changed) or "default")


def plan_label(x, w, t: GemmTuning) -> str:
    p = plan(x, w, t)
    return (f"{p['bm']}x{p['bn']}x{p['bk']} sub {p['sub']}, rows {p['rows']}, grid {p['grid'][0]}x{p['grid'][1]}"
            + (", swap" if p["swap"] else "") + (", converted first" if p["convert"] else ""))


def compiled(f, args, options):
    return jax.jit(f).lower(*args).compile(compiler_options=options)


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "smoke", "out")
    ap.add_argument("--rows", type=int, default=2048, help="M: x's rows (a prefill chunk)")
    ap.add_argument("--only", default="", help="only the shapes whose label holds this text")
    ap.add_argument("--no-xla-off", action="store_true",
                    help="on the GPU, skip timing XLA with autotuning off (slow to time)")
    ap.add_argument("--calls", type=int, default=20, help="calls dispatched back to back per timed batch")
    ap.add_argument("--reps", type=int, default=5, help="timed batches (the median is taken)")
    args = ap.parse_args(argv)
    gpu = target.platform() == "gpu"
    shapes = SHAPES
    if args.smoke:
        shapes, args.rows, args.calls, args.reps = SMOKE_SHAPES, SMOKE_ROWS, 1, 1
    say = Report(args.out)
    heading(say, f"gemm_bench: {'tiny' if args.smoke else 'Flash'} prefill projections at M = {args.rows}")
    off = step_compiler_options() if gpu else None
    on = {**off, "xla_gpu_autotune_level": 4} if gpu else None
    say.table("shape", "[N, K]", "variant", "plan", "vs exact", "vs linear", "ms", "TFLOP/s", "x best XLA")
    key = jax.random.key(0)
    for label, n, k, fp8 in shapes:
        if args.only and args.only not in label:
            continue
        kx, kw = jax.random.split(jax.random.fold_in(key, n * k))
        x = jax.random.normal(kx, (args.rows, k), F32).astype(BF16)
        w = jax.random.normal(kw, (n, k), F32) * k**-0.5
        w = quantize_on_device(w, (128, 128)) if fp8 else w.astype(BF16)
        flop = 2 * args.rows * n * k
        exact = jnp.einsum("mk,nk->mn", x.astype(F32), (w.dequantize(F32) if fp8 else w.astype(F32)),
                           precision="highest")
        reference = compiled(lambda x, w: linear(x, w), (x, w), off)
        ref = reference(x, w)
        xla = [] if args.no_xla_off and gpu else [("XLA, autotuning off (step options)", off)]
        xla += [("XLA, autotuned", on)] if gpu else []
        lead = [label, f"[{n}, {k}]"]

        def row(*cells):  # the shape's first row names it
            say.row(*lead, *cells)
            lead[:] = ["", ""]

        def timed(name, make):
            """(output, seconds) of the program make() compiles, or None after a row saying why it failed."""
            progress(f"{label}: {name}")
            try:
                fn = make()
                return fn(x, w), pipelined_seconds(fn, x, w, calls=args.calls, reps=args.reps)
            except Exception as e:  # a variant that fails to compile: reported, the others still run
                row(name, "", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", "", "", "", "")
                return None

        # XLA first, its rows printed once all are timed: every row's ratio is to the fastest of them
        results = [(name, timed(name, lambda options=options: reference if options is off else compiled(
            lambda x, w: linear(x, w), (x, w), options))) for name, options in xla]
        results = [(name, r) for name, r in results if r is not None]
        best = min((t for _, (_, t) in results), default=None)

        def report(name, launch, got, t):
            e = rel(got, exact)
            row(name, launch, f"{e:.1e}" + ("" if e < ERR_LIMIT else " FAIL"), f"{rel(got, ref):.1e}",
                f"{t * 1e3:.3f}", f"{flop / t / 1e12:.1f}", f"{t / best:.2f}" if best else "")

        for name, (got, t) in results:
            report(name, "XLA", got, t)
        first = None
        for tuning in TUNINGS:
            name = tuning_name(tuning)
            fp8_only = any(getattr(tuning, f) != getattr(DEFAULT, f) for f in FP8_ONLY)
            if fp8_only and not fp8:
                continue  # the same launch as another row's on a plain weight
            if reason := supports(x, w, tuning=tuning):
                row(name, "", f"unsupported: {reason}", "", "", "", "")
                continue
            r = timed(name, lambda tuning=tuning: compiled(lambda x, w: gemm(x, w, tuning=tuning), (x, w), off))
            if r is not None:
                if first is not None and fp8_only:
                    same = np.array_equal(np.asarray(r[0], np.float32), np.asarray(first, np.float32))
                    name += " (same bits as the default's)" if same else " (other bits: its declared rounding)"
                report(name, plan_label(x, w, tuning), *r)
                first = r[0] if tuning == DEFAULT else first

if __name__ == "__main__":
    main()
