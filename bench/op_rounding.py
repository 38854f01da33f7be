"""What one op's Pallas kernel changes in the shipped model's rounding: the model with every op on its XLA reference
against the same weights with op --op on its Pallas kernel (the rest on their references), in one process, measured
as bench/fp8_accuracy.py measures fp8 weights (held-out bits per byte and argmax agreement, greedy agreement, NEXTN
accept length and losslessness).

    python bench/op_rounding.py --op gemm --out bench/results/shipped/op_rounding_gemm_cpu.md
    python bench/op_rounding.py --op gemm --max-bytes 50000 --count 2 --new-tokens 32      # quicker

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
from fp8_accuracy import add_accuracy_options, measure, report  # noqa: E402

from common import parser  # noqa: E402


def main(argv=None) -> None:
    ap = parser(__doc__)
    add_accuracy_options(ap)
    ap.add_argument("--op", required=True, help="the op whose Pallas kernel is measured (lingjax.kernels.OPS)")
    args = ap.parse_args(argv)

    from lingjax import kernels, target

    if args.op not in kernels.OPS:
        ap.error(f"--op {args.op}: not an op; ops: {', '.join(sorted(kernels.OPS))}")

    import lingjax

    reference = lingjax.load(args.checkpoint, dtype=args.dtype, kernels="xla")
    others = tuple(sorted(set(kernels.OPS) - {args.op}))
    models = {"xla": reference, f"{args.op} on Pallas": reference.variant(kernels="pallas", xla_ops=others)}
    rows, data = measure(models, args)
    where = "on the GPU" if target.platform() == "gpu" else "in interpret mode"
    setup = (f"checkpoint {args.checkpoint}, compute {args.dtype}, every op on its XLA reference; the second row runs "
             f"op {args.op} on its Pallas kernel ({where}).")
    lines = report(f"op {args.op}'s Pallas kernel against its reference on the shipped model", "op_rounding.py",
                   setup, "kernels", rows, data, args, argv)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
