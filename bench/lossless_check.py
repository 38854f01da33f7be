"""Is greedy speculation lossless on this backend? Speculative greedy tokens against plain greedy ones.

    python bench/lossless_check.py --model tiny mid --kernels xla pallas --dtype bfloat16 --out lossless.md
    python bench/lossless_check.py --model tiny --kernels xla --new-tokens 16     # a CPU check

For each model (preset: random weights) and kernel set, and each random prompt: plain greedy (ignore_eos), then
greedy with three drafters, S drafts a round: the MTP chain (spec="nextn"; random weights draft badly, accept ~1),
the plain output replayed (ReplayDrafter, every draft right: full acceptance), and the replay with irregular wrong
drafts (corrupt_every=3: accept lengths vary). A row says whether the tokens equal plain greedy's, the first index
where they differ, and the mean accept length. Exit status 1 when any row differs. Row invariance
(lingjax/model.py) makes every row equal in bfloat16 too: a verify rounds each row as the decode does.
"""

from __future__ import annotations

import sys

import numpy as np

import lingjax
from common import Report, add_options, heading, parser
from lingjax.spec.drafters import ReplayDrafter


def first_difference(got, want) -> int | None:
    """The first index where two token lists differ (the shorter's length if one is a prefix), or None."""
    diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if diff is None and len(got) != len(want):
        diff = min(len(got), len(want))
    return diff


def check_prompt(model, name, kernels, seed, args, say) -> bool:
    """The three drafters against plain greedy on one random prompt: one row each; True when all are equal."""
    prompt = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, args.prompt_len).tolist()
    plain = lingjax.generate(model, prompt, args.new_tokens, ignore_eos=True).tokens
    runs = {
        f"nextn S={args.steps}": dict(spec="nextn", steps=args.steps),
        "replay, all accepted": dict(drafter=ReplayDrafter.replaying(model, prompt, plain, args.steps)),
        "replay, corrupt_every=3": dict(drafter=ReplayDrafter.replaying(model, prompt, plain, args.steps,
                                                                         corrupt_every=3)),
    }
    equal = True
    for label, how in runs.items():
        spec = lingjax.generate(model, prompt, args.new_tokens, ignore_eos=True, **how)
        diff = first_difference(spec.tokens, plain)
        equal &= diff is None
        say.row(name, kernels, seed, label, "yes" if diff is None else "NO", "-" if diff is None else diff,
                f"{spec.mean_accept_len:.2f}")
    return equal


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "kernels", "dtype", "tp", "out", many=("model", "kernels"), model=["tiny"],
                kernels=["xla", "pallas"])
    ap.add_argument("--steps", type=int, default=3, help="drafts per round")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=2, help="how many random prompts (seeds 0..N-1)")
    args = ap.parse_args(argv)

    say = Report(args.out)
    heading(say, f"lossless_check: greedy speculative == plain greedy, {args.dtype}, S={args.steps}, tp {args.tp}")
    say(f"{args.prompts} random prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each")
    say()
    say.table("model", "kernels", "prompt", "drafter", "tokens equal to plain", "first differing index",
              "mean accept length")
    equal = True
    for name in args.model:
        for kernels in args.kernels:
            model = lingjax.load(name, dtype=args.dtype, kernels=kernels, tp=args.tp)
            for seed in range(args.prompts):
                equal &= check_prompt(model, name, model.kernels, seed, args, say)
    say()
    say("all equal" if equal else "SOME ROWS DIFFER")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
