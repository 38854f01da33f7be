"""What a rounding change between two trees does to the shipped model: this tree against --baseline (a git revision or
a directory holding a tree), each side in a process of its own run from its own tree, measured as
bench/fp8_accuracy.py measures (held-out bits per byte and argmax agreement, greedy agreement, NEXTN accept length
and losslessness), the baseline the reference row.

    python bench/tree_rounding.py --baseline 0f2a485 --out bench/results/shipped/tree_rounding.md
    python bench/tree_rounding.py --baseline HEAD~1 --max-bytes 50000 --count 2 --new-tokens 32      # quicker

Why: bench/op_rounding.py measures an op's kernel against its reference in one process; a change to the
computation itself (an op's reference and kernel both, a fusion's order) exists only as two trees. Each side loads
the checkpoint with --kernels (auto: the Pallas kernels on a GPU, the XLA references elsewhere).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import ROOT, _env, tree  # noqa: E402
from fp8_accuracy import add_accuracy_options, publish, report  # noqa: E402

from common import parser  # noqa: E402

# run in each side's root: that tree's lingjax and bench/fp8_accuracy.measure, the rows as JSON
CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import numpy as np
import lingjax
from fp8_accuracy import measure
opts = json.loads(sys.argv[1])
args = type("Args", (), {**opts, "checkpoint": Path(opts["checkpoint"])})
model = lingjax.load(args.checkpoint, dtype=args.dtype, kernels=opts["kernels"])
rows, data = measure({"side": model}, args)
row = rows["side"]
row["predictions"] = [np.asarray(p).tolist() for p in row["predictions"]]
row["plain"] = [list(map(int, t)) for t in row["plain"]]
Path(opts["json"]).write_text(json.dumps(dict(row=row, data=data, kernels=model.kernels)))
"""


def run_side(root: Path, args, json_path: Path) -> dict:
    opts = dict(checkpoint=str(args.checkpoint.resolve()), dtype=args.dtype, max_bytes=args.max_bytes,
                window=args.window, count=args.count, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                steps=args.steps, kernels=args.kernels, json=str(json_path))
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(opts)], cwd=root, env=_env(root))
    if done.returncode != 0:
        raise SystemExit(f"tree_rounding: the side in {root} failed ({done.returncode})")
    return json.loads(json_path.read_text())


def main(argv=None) -> None:
    ap = parser(__doc__)
    add_accuracy_options(ap)
    ap.add_argument("--baseline", required=True, metavar="REV|DIR", help="the tree before the change")
    ap.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    args = ap.parse_args(argv)
    import numpy as np

    with tree(args.baseline) as (root, label), tempfile.TemporaryDirectory() as tmp:
        sides = {f"baseline {label}": run_side(root, args, Path(tmp) / "base.json"),
                 "this tree": run_side(ROOT, args, Path(tmp) / "this.json")}
    rows = {}
    for name, side in sides.items():
        row = side["row"]
        row["predictions"] = [np.asarray(p) for p in row["predictions"]]
        rows[name] = row
    data = next(iter(sides.values()))["data"]
    kernels = " / ".join(sorted({side["kernels"] for side in sides.values()}))
    setup = f"checkpoint {args.checkpoint}, compute {args.dtype}, kernels {kernels}, each side a process of its own."
    lines = report(f"this tree against {label} on the shipped model", "tree_rounding.py", setup, "tree", rows, data,
                   args, argv)
    publish(lines, args.out)


if __name__ == "__main__":
    main()
