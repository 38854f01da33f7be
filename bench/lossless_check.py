"""Is greedy speculation lossless on this backend? Speculative greedy tokens against plain greedy ones.

    python bench/lossless_check.py --model tiny mid --kernels xla pallas --dtype bfloat16 --out report.md

For each model (preset: random weights) and kernel set, and each random prompt: plain greedy
(ignore_eos), then greedy with three drafters, S drafts a round: the MTP chain (spec="nextn"; random
weights draft badly, accept ~1), the plain output replayed (ReplayDrafter, every draft right: full
acceptance), and the replay with irregular wrong drafts (corrupt_every=3: accept lengths vary). A row
says whether the tokens equal plain greedy's, the first index where they differ, and the mean accept
length. Exit status 1 when any row differs. In float32 every row should be equal; in bfloat16 the
verify's GEMMs (M = S+1 rows) may round a row differently from the decode's M=1 GEMV, and greedy
drifts where two logits are close.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import jax
import numpy as np

import lingjax
from lingjax.spec.drafters import ReplayDrafter
from report import Report  # bench/report.py, beside this script


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["tiny"], help="presets (random weights) or checkpoints")
    ap.add_argument("--kernels", nargs="+", default=["xla", "pallas"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=2, help="how many random prompts (seeds 0..N-1)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    args = ap.parse_args()

    say = Report(args.out)

    say(f"# lossless_check: greedy speculative == plain greedy, {args.dtype}, S={args.steps}, tp {args.tp}")
    say(f"date {datetime.date.today()}, device {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}")
    say(f"command: `{' '.join(sys.argv)}`")
    say(f"{args.prompts} random prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each")
    say()
    say("| model | kernels | prompt | drafter | tokens equal to plain | first differing index | mean accept length |")
    say("|---|---|---|---|---|---|---|")
    failed = False
    for name in args.model:
        for kernels in args.kernels:
            model = lingjax.load(name, dtype=args.dtype, kernels=kernels, tp=args.tp)
            for seed in range(args.prompts):
                prompt = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, args.prompt_len).tolist()
                plain = lingjax.generate(model, prompt, args.new_tokens, ignore_eos=True).tokens
                runs = {
                    f"nextn S={args.steps}": dict(spec="nextn", steps=args.steps),
                    "replay, all accepted": dict(drafter=ReplayDrafter.replaying(model, prompt, plain, args.steps)),
                    "replay, corrupt_every=3": dict(
                        drafter=ReplayDrafter.replaying(model, prompt, plain, args.steps, corrupt_every=3)),
                }
                for label, how in runs.items():
                    spec = lingjax.generate(model, prompt, args.new_tokens, ignore_eos=True, **how)
                    diff = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain)) if a != b), None)
                    if diff is None and len(spec.tokens) != len(plain):
                        diff = min(len(spec.tokens), len(plain))
                    failed |= diff is not None
                    say(f"| {name} | {kernels} | {seed} | {label} | {'yes' if diff is None else 'NO'} | "
                        f"{'-' if diff is None else diff} | {spec.mean_accept_len:.2f} |")
    say()
    say("all equal" if not failed else "SOME ROWS DIFFER")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
