"""What one op's Pallas kernel changes in the shipped model's rounding: the model with every op on its XLA reference
against the same weights with op --op on its Pallas kernel (the rest on their references), in one process, measured
as bench/fp8_accuracy.py measures fp8 weights (held-out bits per byte and argmax agreement, greedy agreement, NEXTN
accept length and losslessness). With --kernel-option the A/B is between two tunings of the kernels instead: the
ops --op on their Pallas kernels at their defaults against the same with those fields changed.

    python bench/op_rounding.py --op gemm --out bench/results/shipped/op_rounding_gemm_cpu.md
    python bench/op_rounding.py --op gemm --max-bytes 50000 --count 2 --new-tokens 32      # quicker
    python bench/op_rounding.py --weights fp8 --op gemm moe_experts \
        --kernel-option gemm:fp8_dots=f16 --kernel-option moe_experts:fp8_dots=f16       # a tuning's rounding

Why: a kernel that sums in another order than its reference rounds differently; the brief asks every such change
to be declared and measured on the trained model, not only held to a tolerance. Off the GPU the kernel runs in
interpret mode: its own order of sums (tiles, K steps), computed by the CPU, not the tensor cores' order within a
step.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8_accuracy import add_accuracy_options, measure, publish, report  # noqa: E402

from common import add_options, parser, tuning_for, tuning_label  # noqa: E402


def main(argv=None) -> None:
    ap = parser(__doc__)
    add_accuracy_options(ap)
    add_options(ap, "kernel_option")
    ap.add_argument("--op", required=True, nargs="+", help="the ops whose Pallas kernels are measured "
                                                           "(lingjax.kernels.OPS)")
    ap.add_argument("--weights", choices=["auto", "fp8"], default="auto",
                    help="fp8: the checkpoint's matrices quantized as it loads (lingjax.load), so the kernels "
                         "take their fp8 forms")
    args = ap.parse_args(argv)

    from lingjax import kernels, target

    for op in args.op:
        if op not in kernels.OPS:
            ap.error(f"--op {op}: not an op; ops: {', '.join(sorted(kernels.OPS))}")
    if stray := sorted({op for op, _, _ in args.kernel_option} - set(args.op)):
        ap.error(f"--kernel-option for {', '.join(stray)}, not among --op")

    import lingjax

    reference = lingjax.load(args.checkpoint, dtype=args.dtype, kernels="xla", weights=args.weights)
    ops = " ".join(args.op)
    on_pallas = reference.variant(kernels="pallas", xla_ops=tuple(sorted(set(kernels.OPS) - set(args.op))))
    where = "on the GPU" if target.platform() == "gpu" else "in interpret mode"
    setup = f"checkpoint {args.checkpoint} (weights {args.weights}), compute {args.dtype}, "
    if args.kernel_option:
        tuning = tuning_for(args.kernel_option, reference.cfg)
        changed = tuning_label(tuning, reference.cfg).strip()
        models = {f"{ops} on Pallas": on_pallas, changed: on_pallas.variant(tuning=tuning)}
        title = f"the kernels' tuning {changed} against their defaults on the shipped model"
        setup += (f"ops {ops} on their Pallas kernels ({where}), the rest on their XLA references; the second row "
                  f"changes their tuning: {changed}.")
    else:
        models = {"xla": reference, f"{ops} on Pallas": on_pallas}
        title = f"op {ops}'s Pallas kernel against its reference on the shipped model"
        setup += (f"every op on its XLA reference; the second row runs op {ops} on its Pallas kernel ({where}).")
    rows, data = measure(models, args)
    lines = report(title, "op_rounding.py", setup, "kernels", rows, data, args, argv)
    publish(lines, args.out)


if __name__ == "__main__":
    main()
