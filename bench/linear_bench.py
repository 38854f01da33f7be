"""The dense projections of a decode and a verify: lingjax.pallas.linear against XLA's GEMM with autotuning off (the
step programs' setting) and on, per shape, over cold weights.

    python bench/linear_bench.py --model mid --out linear_mid.md
    python bench/linear_bench.py --model flash --weights fp8 --sweep --out linear_flash_fp8.md
    python bench/linear_bench.py --smoke        # tiny shapes, interpret mode off the GPU: a script check

For each projection of the model at --tp's per-device shape ([N, K], x 16 bf16 rows, the lm_head's output f32; bf16
weights, or with --weights fp8 the product's fp8 weights, 128 x 128 scale blocks, all but the lm_head), one program
applies it to several weight copies (cold: the copies together are several times the L2) and is timed as the median of
batches of calls dispatched back to back. Variants: XLA's GEMM compiled with the step programs' options
(lingjax.execution.step_compiler_options: autotuning off), the same with XLA's autotuning on (xla_gpu_autotune_level=4),
and the Pallas kernel at its default tiles and at --sweep's. Each row gives µs per projection at verify rows (and, for
the kernel, at a decode's: tokens = 1, x's one row read as the decode reads it), its byte floor (the weight and its
scales read once at the read bandwidth measured at the start) and the ratios; `vs exact` is the relative error against
x · Wᵀ in f32 (an fp8 weight: its dequantized values); `bits` says whether the kernel's decode row 0 equals its verify's
row 0 bit for bit (row invariance).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from common import (
    BF16,
    F32,
    Report,
    add_options,
    config_of,
    heading,
    parser,
    pipelined_seconds,
    progress,
    read_bandwidth,
    rel,
)
from lingjax import target
from lingjax.execution import step_compiler_options
from lingjax.ops.fp8 import BLOCK, device_block, quantize_on_device
from lingjax.ops.linear import linear
from lingjax.pallas.linear import LinearTuning, plan, supports
from lingjax.pallas.linear import linear as pallas_linear

SWEEP = [  # (label, tuning): the kernel's other tiles, against the default
    ("N tile 64", LinearTuning(bn=64)),
    ("N tile 256", LinearTuning(bn=256)),
    ("K step 64", LinearTuning(bk=64)),
    ("K step 256", LinearTuning(bk=256)),
    ("8 warps", LinearTuning(warps=8)),
    ("3 stages", LinearTuning(stages=3)),
    ("splits of >= 512", LinearTuning(min_split=512)),
    ("splits of >= 128", LinearTuning(min_split=128)),
    ("N tile 64, K step 256", LinearTuning(bn=64, bk=256)),
]
FP8_SWEEP = [  # an fp8 weight's: the N tile is at most a scale block's 128 rows, the default K step 256 columns
    ("N tile 32", LinearTuning(bn=32)),
    ("N tile 128", LinearTuning(bn=128)),
    ("K step 128", LinearTuning(bk=128)),
    ("K step 512", LinearTuning(bk=512)),
    ("8 warps", LinearTuning(warps=8)),
    ("3 stages", LinearTuning(stages=3)),
    ("6 stages", LinearTuning(stages=6)),
    ("splits of >= 512", LinearTuning(min_split=512)),
    ("splits of >= 128", LinearTuning(min_split=128)),
    ("x row once a step", LinearTuning(x_row_split=True)),
    ("N tile 128, 8 warps", LinearTuning(bn=128, warps=8)),
    ("N tile 128, K step 512, 8 warps", LinearTuning(bn=128, bk=512, warps=8)),
]
COLD_BYTES = 512 << 20  # the copies of one projection together: about 10x an H200's L2


def projections(cfg, tp):
    """(label, [N, K], output dtype) of the dense projections a decode and a verify read, one device's share."""
    d, p, nh = cfg.hidden_size, cfg.kda_dim, cfg.num_heads
    return [
        ("KDA in_proj (q|k|v|f|g)", (5 * p // tp, d), BF16),
        ("KDA o_proj", (d, p // tp), F32),
        ("MLA q_proj", (nh * cfg.qk_head_dim // tp, d), BF16),
        ("MLA kv_a_proj", (cfg.mla_cache_dim, d), BF16),
        ("MLA o_proj", (d, nh * cfg.v_head_dim // tp), F32),
        ("dense gate_proj", (cfg.intermediate_size // tp, d), F32),
        ("dense down_proj", (d, cfg.intermediate_size // tp), F32),
        ("MTP eh_proj", (d, 2 * d), BF16),
        ("lm_head", (cfg.vocab_size // tp, d), F32),
    ]


def over_copies(fn, options):
    """One program applying fn(x, w) to each weight copy -> (a scalar of every copy's output, the first copy's
    whole output), compiled with `options` (None off the GPU)."""
    def run(x, ws):
        outs = [fn(x, w) for w in ws]
        return sum(jnp.sum(o[:1, :8].astype(F32)) for o in outs), outs[0]

    return jax.jit(run, compiler_options=options)


def bits_equal(a, b) -> bool:
    return bool(np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32)))


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "tp", "weights", "smoke", "out")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel at the SWEEP tiles (verify rows)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    gpu = target.platform() == "gpu"
    if args.smoke:
        args.model = "tiny"
    say = Report(args.out)
    heading(say, f"linear_bench: {args.model} projections at TP{args.tp}, {args.weights} weights")
    bw = read_bandwidth(1 << 20, warm=1, reps=3) if args.smoke else read_bandwidth()
    say(f"read bandwidth at the start {bw / 1e12:.2f} TB/s")
    off = step_compiler_options() if gpu else None
    tuned = dict(off, xla_gpu_autotune_level=4) if gpu else None
    say.table("projection", "[N, K]", "variant", "launch", "vs exact", "bits", "verify µs", "decode µs", "floor µs",
              "verify x floor", "decode x floor")
    sweep = FP8_SWEEP if args.weights == "fp8" else SWEEP
    key = jax.random.key(0)
    timed = {}
    for label, (n, k), out in projections(config_of(args.model), args.tp):
        if (n, k, out) in timed:  # timed once: a later program of the same shape could reuse XLA's autotuning
            say.row(label, f"[{n}, {k}]", f"as {timed[n, k, out]}", "", "", "", "", "", "", "", "")
            continue
        timed[n, k, out] = label
        key, kx, kw = jax.random.split(key, 3)
        copies = 2 if args.smoke else max(2, math.ceil(COLD_BYTES / (n * k * 2)))
        x = jax.random.normal(kx, (16, k), F32).astype(BF16)
        ws = [(jax.random.normal(jax.random.fold_in(kw, c), (n, k), F32) * k**-0.5).astype(BF16) for c in range(copies)]
        if args.weights == "fp8" and label != "lm_head":  # the product keeps the lm_head in bf16
            block = device_block((n, k), BLOCK)
            ws = [quantize_on_device(w, block) for w in ws]
        w0 = ws[0].dequantize(F32) if hasattr(ws[0], "dequantize") else ws[0].astype(F32)
        exact = jnp.einsum("rk,nk->rn", x.astype(F32), w0, precision="highest")
        floor = sum(a.nbytes for a in jax.tree.leaves(ws[0])) / bw
        variants = [("XLA, autotuning off (step options)", None, off)]
        variants += [("XLA, autotuned", None, tuned)] if gpu else []
        variants.append(("Pallas, default", LinearTuning(), None))
        if args.sweep:
            variants += [(f"Pallas, {name}", tuning, None) for name, tuning in sweep]
        first = True
        for name, tuning, options in variants:
            lead = (label, f"[{n}, {k}]") if first else ("", "")
            first = False
            if tuning is None:
                make = lambda tokens: over_copies(lambda x, w: linear(x, w, out), options)  # noqa: E731
                launch = "XLA"
            else:
                if reason := supports(x, ws[0], out, tuning=tuning):
                    say.row(*lead, name, "", f"unsupported: {reason}", "", "", "", "", "", "")
                    continue
                make = lambda tokens, tuning=tuning: over_copies(  # noqa: E731
                    lambda x, w: pallas_linear(x, w, out, tokens=tokens, tuning=tuning), options)
                launch = "/".join(str(v) for v in plan(x.dtype, ws[0], 1, tuning).values())
            progress(f"{label}: {name}")
            try:
                verify = make(None)
                got = verify(x, ws)[1]
                t = pipelined_seconds(verify, x, ws, reps=args.reps) / copies
                td, bits = None, "-"
                if tuning is not None:
                    decode = make(1)
                    bits = "equal" if bits_equal(decode(x, ws)[1][:1], got[:1]) else "DIFFER"
                    td = pipelined_seconds(decode, x, ws, reps=args.reps) / copies
            except Exception as e:  # a variant that fails to compile: reported, the others still run
                say.row(*lead, name, launch, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", "", "",
                        "", "", "", "")
                continue
            e = rel(got, exact)
            say.row(*lead, name, launch, f"{e:.1e}" + ("" if e < 1e-2 else " FAIL"), bits, f"{t * 1e6:.2f}",
                    "" if td is None else f"{td * 1e6:.2f}", f"{floor * 1e6:.2f}", f"{t / floor:.2f}",
                    "" if td is None else f"{td / floor:.2f}")


if __name__ == "__main__":
    main()
