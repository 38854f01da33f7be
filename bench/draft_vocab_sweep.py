"""Issue 52's sweep: speculation's depth (NEXTN S, DSpark verified drafts) against the draft vocabulary's size,
as accept length with the shipped pair, round time on a timing model, and the derived TPOT = round / accept.

    python bench/draft_vocab_sweep.py --model flash --weights fp8 --kernels pallas \\
        --out bench/results/spec/draft_vocab_sweep_h200_DATE.md                  # the GPU run (one H200)
    python bench/draft_vocab_sweep.py --smoke                                    # a CPU check, a minute

1. Accept length: the shipped code model and its DSpark drafter on embedded_bench's held-out prompts (greedy, each
   run checked token for token against plain greedy), draft vocabulary over its token_frequencies.npy.
2. Round time: the speculative round of --model (a preset's random weights, or a checkpoint directory) with the same
   S and vocabulary sizes, its draft vocabulary over --table (a .npy of vocab-size counts), the checkpoint's own
   table, or else a synthetic Zipf table (lingjax.spec.draft_vocab.zipf_counts: the round's time does not depend
   on which ids are in the subset, only on how many). DSpark rounds take the checkpoint's own drafter (the shipped
   model's), else a random drafter shaped for the model (load's draft="random"), S clipped to its block. Rounds
   dispatched back to back, one block at the end, median of 5.
3. TPOT = round time / accept length (the write-up's derived step time), and the round and TPOT against the full
   vocabulary's at the same S.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parser, progress  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--model", default="flash", help="timing model: a preset name or a checkpoint directory")
    ap.add_argument("--weights", default="auto", choices=["auto", "fp8", "dense"])
    ap.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--table", type=Path, help="the timing model's frequency table (.npy); default: Zipf")
    ap.add_argument("--nextn-steps", type=_ints, default=_ints("1,2,3,4,5,6,7"))
    ap.add_argument("--dspark-steps", type=_ints, default=_ints("3,5,7,9,15"),
                    help="DSpark drafts verified a round (verify width S+1); the shipped drafter's block is 15")
    ap.add_argument("--draft-vocab", default="full,50%,25%,12.5%")
    ap.add_argument("--count", type=int, default=16, help="held-out prompts for the accept lengths")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=50, help="rounds per timed batch")
    ap.add_argument("--context", type=int, default=1024, help="the timing prompt's tokens")
    ap.add_argument("--skip-accept", action="store_true", help="round times only")
    ap.add_argument("--skip-time", action="store_true", help="accept lengths only")
    ap.add_argument("--smoke", action="store_true", help="tiny preset, 1 prompt, NEXTN S=3 at full and 25%%: CPU")
    ap.add_argument("--out", help="markdown report (also printed)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.nextn_steps, args.dspark_steps, args.draft_vocab = "tiny", [3], [], "full,25%"
        args.count, args.new_tokens, args.rounds, args.context = 1, 16, 4, 64
    args.vocabs = [v for v in args.draft_vocab.split(",") if v]
    from lingjax.spec.draft_vocab import check_size

    try:
        for v in args.vocabs:
            check_size(v)
    except ValueError as e:
        ap.error(f"--draft-vocab: {e}")
    return args


def points(args) -> list[tuple[str, int, str]]:
    return ([("nextn", s, v) for s in args.nextn_steps for v in args.vocabs]
            + [("dspark", s, v) for s in args.dspark_steps for v in args.vocabs])


# ---- 1. accept length with the shipped pair --------------------------------------------------------------
def accept_lengths(args) -> tuple[dict, str]:
    """(spec, S, vocab) -> (mean accept length, lossless prompts, prompts); and the prompts' description."""
    import embedded_bench
    import jax

    import lingjax
    from lingjax import loading
    from lingjax.shipped import DEFAULT_CHECKPOINT

    prompts = embedded_bench.make_prompts(DEFAULT_CHECKPOINT, args.count, 256)
    model = lingjax.load(dtype="bfloat16")
    models = {v: loading.with_draft_vocab(model, loading.draft_vocab_ids(v, None, model.cfg, DEFAULT_CHECKPOINT))
              for v in args.vocabs}
    plain = [lingjax.generate(model, ids, args.new_tokens, ignore_eos=True).tokens for ids in prompts["ids"]]
    out = {}
    for spec, s, v in points(args):
        if spec == "dspark" and s > model.draft.cfg.block_size:
            continue
        kw = dict(spec=spec, steps=s, ignore_eos=True)
        runs = [lingjax.generate(models[v], ids, args.new_tokens, **kw) for ids in prompts["ids"]]
        out[spec, s, v] = (statistics.fmean(r.mean_accept_len for r in runs),
                           sum(r.tokens == p for r, p in zip(runs, plain)), len(runs))
        progress(f"accept {spec} S={s} vocab {v}: {out[spec, s, v][0]:.2f}, lossless {out[spec, s, v][1]}/{len(runs)}")
        # each point compiles programs of its own: free them, or a long CPU sweep runs out of memory mappings for
        # XLA's JIT code ("LLVM ERROR: Unable to allocate section memory")
        jax.clear_caches()
    desc = (f"{len(prompts['ids'])} held-out prompts of 256 tokens, {args.new_tokens} greedy tokens each, "
            f"bfloat16, the shipped pair ({DEFAULT_CHECKPOINT.name}, its drafter's block "
            f"{model.draft.cfg.block_size})")
    return out, desc


# ---- 2. round time on the timing model ------------------------------------------------------------------
def round_times(args) -> tuple[dict, str]:
    """(spec, S, vocab) -> seconds per round on the timing model; and its description."""
    import jax
    import numpy as np

    import lingjax
    from lingjax import engine, loading
    from lingjax.sampling import SamplingParams
    from lingjax.spec import draft_vocab, step

    model = lingjax.load(args.model, weights=args.weights, kernels=args.kernels, tp=args.tp, draft="auto")
    if model.draft is None:  # no drafter of its own (a preset): a random one shaped for it (times, not accepts)
        model = model.with_draft(loading.load_draft("random", model.cfg, "bfloat16", shipped=False))
    own = Path(model.source) / draft_vocab.TABLE_NAME  # a checkpoint's own table (the shipped model has one)
    table = (draft_vocab.read_table(args.table or own, model.cfg.vocab_size) if args.table or own.is_file()
             else draft_vocab.zipf_counts(model.cfg.vocab_size))
    models = {v: loading.with_draft_vocab(model, loading.draft_vocab_ids(v, table, model.cfg, None, args.tp))
              for v in args.vocabs}
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, args.context).astype(np.int32)
    key, out = jax.random.key(0), {}
    timed = {}  # (spec, S run, vocab) -> s/round: a DSpark S past the drafter's block runs at the block
    for spec, asked, v in points(args):
        m = models[v]
        s = min(asked, m.draft.cfg.block_size) if spec == "dspark" else asked
        if (spec, s, v) in timed:
            out[spec, asked, v] = timed[spec, s, v]
            continue
        drafter = engine.make_drafter(m, spec, s)
        program = step.spec_program(m, drafter, SamplingParams())
        times = []
        for batch in range(6):  # the first compiles and warms
            state = engine.spec_prefill(m, program, drafter, prompt, 2 * args.rounds * (s + 1), key)[1]
            jax.block_until_ready(state)
            t = time.perf_counter()
            for _ in range(args.rounds):
                state, row = program.round(program.weights, state)
            jax.block_until_ready(row)
            if batch:
                times.append((time.perf_counter() - t) / args.rounds)
        out[spec, asked, v] = timed[spec, s, v] = statistics.median(times)
        progress(f"round {spec} S={s} vocab {v}: {timed[spec, s, v] * 1e3:.3f} ms")
    dev = jax.devices()[0]
    desc = (f"{args.model} ({args.weights} weights, kernels {model.kernels}, tp {args.tp}) on {dev.device_kind}; "
            f"prompt {args.context} tokens, {args.rounds} rounds a batch, median of 5; draft vocabulary over "
            f"{args.table or (own if own.is_file() else 'a Zipf table')}; DSpark: "
            f"drafter {model.draft.source}, block {model.draft.cfg.block_size}")
    return out, desc


# ---- 3. the table -----------------------------------------------------------------------------------------
def report(args, accept: dict, accept_desc: str, rounds: dict, round_desc: str, say) -> None:
    say.table("spec", "S (verify width)", "draft vocab", "accept (shipped pair)", "vs full", "lossless",
              "round", "vs full", "TPOT = round / accept", "vs full")
    for spec, s, v in points(args):
        a, r = accept.get((spec, s, v)), rounds.get((spec, s, v))
        a0, r0 = accept.get((spec, s, "full")), rounds.get((spec, s, "full"))
        tpot = r / a[0] if a and r else None
        tpot0 = r0 / a0[0] if a0 and r0 else None

        def ratio(x, x0):
            return f"{x / x0:.3f}" if x is not None and x0 else ""

        say.row("NEXTN" if spec == "nextn" else "DSpark", f"{s} ({s + 1})", v,
                f"{a[0]:.2f}" if a else "", ratio(a[0] if a else None, a0[0] if a0 else None),
                f"{a[1]}/{a[2]}" if a else "", f"{r * 1e3:.3f} ms" if r else "", ratio(r, r0),
                f"{tpot * 1e3:.3f} ms" if tpot else "", ratio(tpot, tpot0))
    say()
    if accept_desc:
        say(f"Accept: {accept_desc}.")
    if round_desc:
        say(f"Round: {round_desc}.")


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax

    from common import Report

    accept, accept_desc = ({}, "") if args.skip_accept else accept_lengths(args)
    rounds, round_desc = ({}, "") if args.skip_time else round_times(args)
    say = Report(args.out)
    say("# Draft vocabulary × speculation depth: accept length, round time, TPOT (issue 52)")
    say(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), jax {jax.__version__}")
    say("command: `python bench/draft_vocab_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`")
    say()
    report(args, accept, accept_desc, rounds, round_desc, say)


if __name__ == "__main__":
    main()
