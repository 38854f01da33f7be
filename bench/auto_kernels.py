"""Does kernels="auto" generate with every checkpoint? On a GPU each op runs its Pallas kernel where the kernel's
supports() takes the shapes, else its XLA reference (said once per op and reason); this runs every fixture.

    python bench/auto_kernels.py --out auto_kernels.md                      # tests/fixtures/*, float32 and bfloat16
    python bench/auto_kernels.py --checkpoints tests/fixtures/tiny_c --dtype float32 --new-tokens 8  # on a CPU

Per checkpoint and dtype: the ops that fell back and why; the full forward's logits against HF's (the fixture's
reference.npz, float32); plain greedy against HF's greedy tokens; and NEXTN greedy (S = 3) against plain greedy,
which must be equal (lossless; checkpoints with an MTP layer). Exit status 1 when a run raises or speculation
differs from plain greedy.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np

import lingjax
from common import Report, heading, parser, rel
from lingjax import kernels

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


class Fallbacks(logging.Handler):
    """Collects lingjax's fallback lines (lingjax.kernels)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def check(directory: Path, dtype: str, new_tokens: int, fallbacks: Fallbacks, say: Report) -> bool:
    """One row: True when every step ran and speculation equals plain greedy."""
    ref = np.load(directory / "reference.npz")
    prompt = ref["prompt_ids"].tolist()
    kernels.forget_fallbacks()
    start = len(fallbacks.lines)
    try:
        model = lingjax.load(directory, dtype=dtype, kernels="auto")
        err = rel(model.logits(prompt), ref["logits"])
        plain = lingjax.generate(model, prompt, new_tokens, ignore_eos=True).tokens
        spec = (lingjax.generate(model, prompt, new_tokens, ignore_eos=True, spec="nextn", steps=3).tokens
                if model.has_mtp else None)
    except Exception as e:  # a row, not a crash: the other checkpoints still run
        say.row(directory.name, dtype, "-", f"FAILED: {type(e).__name__}: {str(e)[:120]}", "-", "-", "-")
        return False
    hf = ref["greedy_tokens"].tolist()[:new_tokens]
    fell = "; ".join(line.split("lingjax: ", 1)[-1] for line in fallbacks.lines[start:]) or "none"
    lossless = "no MTP layer" if spec is None else "yes" if spec == plain else "NO"
    say.row(directory.name, dtype, model.kernels, fell, f"{err:.1e}", "yes" if plain == hf else "no", lossless)
    return lossless != "NO"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--checkpoints", nargs="+", type=Path,
                    default=sorted(p for p in FIXTURES.iterdir() if (p / "reference.npz").exists()))
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", help="also write the report to this markdown file")
    args = ap.parse_args()
    fallbacks = Fallbacks()
    logging.getLogger("lingjax").addHandler(fallbacks)
    say = Report(args.out)
    heading(say, 'kernels="auto" on every checkpoint')
    say.table("checkpoint", "dtype", "kernels", "ops on their XLA reference (why)", "logits vs HF (rel)",
              "greedy = HF's", "NEXTN greedy = plain")
    ok = [check(d, dtype, args.new_tokens, fallbacks, say) for d in args.checkpoints for dtype in args.dtype]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
