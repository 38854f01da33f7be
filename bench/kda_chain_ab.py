"""KDA chain-verify tunings A/B in one process: ChainTuning values timed in interleaved rounds.

    python bench/kda_chain_ab.py --block-v 16 32 --warps 4 --ts 1 4 6 16 --rounds 3 --out chain_ab.md
    python bench/kda_chain_ab.py --block-v 32 --tiles-per-program 1 2 --profile --graphs --fla-json fla.jsonl
    python bench/kda_chain_ab.py --smoke       # tiny preset, interpret mode: a CPU check

Why: the same kernel's time moves between processes by more than the differences being decided
(docs/measuring.md). Here every tuning (the default, then each --block-v x --warps x --tiles-per-program) is
compiled in one process and timed in --rounds interleaved rounds, each round timing every tuning once in
kda_bench's way (rotating cold input sets in one jitted loop, median of 15 runs); a tuning's figure is the median
over rounds, its spread (min-max) beside it. Before timing, each is checked against lingjax.ops.kda.kda_chain (max
rel. error; kda_bench's chain harness runs the reference op by op). --fla-json (kda_bench.py --fla-child at the
same --ts) adds fla's fused_recurrent_kda in both its forms. --profile adds a second table that splits each
in-graph figure: the chain kernel's own duration in the loop and the loop's other kernels per call (its set-up, once
per loop); the rest of a call's time lies between the loop's launches, and the kernel time is what compares with
fla's graph-captured figures. --graphs also times every tuning with its loop compiled as the step programs are
(lingjax.execution.step_compiler_options: command buffers around the loop too).
"""

from __future__ import annotations

import itertools
import statistics
import sys

from kda_bench import CHAIN_TOL, chain_harness, load_fla

from common import Report, add_options, config_of, heading, kda_shape, median_seconds, parser, rel

PROFILE_ITERS = 2  # loop iterations under the profiler: a copy made once per loop shows as 1/2 a call


def tunings(args) -> dict:
    """label -> ChainTuning: the default, then every combination of the options given."""
    from lingjax.pallas.kda_chain import ChainTuning

    out = {"default": ChainTuning()}
    for bv, w, tiles in itertools.product(args.block_v, args.warps, args.tiles_per_program):
        tuning = ChainTuning(block_v=bv, num_warps=w, tiles_per_program=tiles)
        if tuning != ChainTuning():
            out[f"BV{bv} w{w}" + (f" x{tiles} tiles" if tiles > 1 else "")] = tuning
    return out


def profile_loops(harness, runs, xs_t) -> dict:
    """(label, t) -> the kernels of a timed loop (PROFILE_ITERS iterations over the rotating sets) from a profile:
    the chain kernel's median duration, and how many other kernels (and how many µs of them) the loop ran per call:
    its set-up (the carried buffers' first copies and fills) and the gate's per-iteration add."""
    import jax

    from lingjax import profiling

    out = {}
    for (label, t), fn in runs.items():
        run = harness.loop(fn, PROFILE_ITERS)
        jax.block_until_ready(run(xs_t[t]))
        kernels = profiling.traced_kernels(run, xs_t[t])
        chain = [k.dur_us for k in kernels if "kda_chain_verify" in k.name]
        others = [k.dur_us for k in kernels if "kda_chain_verify" not in k.name]
        calls = PROFILE_ITERS * harness.rotations
        out[label, t] = dict(chain_us=statistics.median(chain) if chain else float("nan"),
                             others_per_call=len(others) / calls, others_us=sum(others) / calls)
    return out


def check(runs, harness, xs_t, say) -> list[str]:
    """Every run against the reference (kda_bench's chain harness) on rotation set 0 -> the failures (rel. error
    above kda_bench.CHAIN_TOL)."""
    import jax

    refs, fails = {t: harness.reference(xs_t[t], t) for t in xs_t}, []
    for (label, t), fn in runs.items():
        o = jax.device_get(fn(*harness.args(xs_t[t], 0)))
        err = max(rel(o[0], refs[t][0]), rel(o[1], refs[t][1]))
        say(f"- check {label} T={t}: max rel. err {err:.1e}{'' if err <= CHAIN_TOL else '  FAIL'}")
        fails += [] if err <= CHAIN_TOL else [f"{label} T={t}"]
    return fails


def timed_rounds(runs, harness, xs_t, args, say) -> dict:
    """(label, t) -> [µs per call, one per round]; with --graphs, also "(label (step graphs), t)"."""
    def timer(fn, compiler_options=None, iters=1 if args.smoke else 8):
        run = harness.loop(fn, iters, compiler_options)
        return lambda xs: median_seconds(run, xs, reps=3 if args.smoke else 15) * 1e6 / (iters * harness.rotations)

    timers = {key: timer(fn) for key, fn in runs.items()}
    if args.graphs:
        from lingjax.execution import step_compiler_options

        for (label, t), fn in runs.items():
            timers[f"{label} (step graphs)", t] = timer(fn, step_compiler_options())
    per_round = {key: [] for key in timers}
    for rnd in range(args.rounds):
        for (label, t), time_one in timers.items():
            per_round[label, t].append(time_one(xs_t[t]))
        say(f"- round {rnd + 1}/{args.rounds} done")
    return per_round


def report(per_round, profiled, fla, args, say) -> None:
    labels = list(dict.fromkeys(label for label, _ in per_round))
    say()
    say(f"median over {args.rounds} interleaved rounds (spread min-max), µs per call in the timed loop")
    say()
    say.table("tuning", *(f"T={t} µs" for t in args.ts))
    for label in labels:
        cells = []
        for t in args.ts:
            us = per_round.get((label, t))
            cells.append(f"{statistics.median(us):.2f} ({min(us):.2f}-{max(us):.2f})" if us else "—")
        say.row(label, *cells)
    if fla:
        for key, label in (("fused_recurrent", "fla fused_recurrent_kda (stages nothing)"),
                           ("fused_recurrent_in_kernel", "fla, l2norm + gate + beta sigmoid in its kernel")):
            say.row(label, *(f"{fla[f'{key}_T{t}']:.2f}" if isinstance(fla.get(f"{key}_T{t}"), float) else "—"
                             for t in args.ts))
    if profiled:
        say()
        say("profiled inside the same loop (command buffers off while profiling): the chain kernel's median duration, "
            "and the other kernels the loop ran per call (count, µs)")
        say()
        say.table("tuning", *(f"T={t} µs" for t in args.ts))
        for label in labels:
            cells = []
            for t in args.ts:
                p = profiled.get((label, t))
                cells.append(f"{p['chain_us']:.2f} (+{p['others_per_call']:.1f} others, {p['others_us']:.2f})"
                             if p else "—")
            say.row(label, *cells)


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "tp", "smoke", "out", model="flash")
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 4, 6, 16], help="chain-verify widths (new tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-v", type=int, nargs="+", default=[16, 32], help="ChainTuning.block_v values")
    ap.add_argument("--warps", type=int, nargs="+", default=[4], help="ChainTuning.num_warps values")
    ap.add_argument("--tiles-per-program", type=int, nargs="+", default=[1],
                    help="ChainTuning.tiles_per_program values")
    ap.add_argument("--rotations", type=int, default=64, help="distinct input sets per timed graph")
    ap.add_argument("--graphs", action="store_true", help="also time every tuning with the step programs' compiler "
                                                          "options (the launch gaps a step sees)")
    ap.add_argument("--profile", action="store_true", help="also each tuning's kernels inside the timed loop")
    ap.add_argument("--fla-json", default=None, help="kda_bench.py --fla-child's output at the same --ts")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.rotations, args.ts, args.rounds = "tiny", 2, [1, 4], 1

    from lingjax.pallas.kda_chain import kda_chain_verify

    shape = kda_shape(config_of(args.model), args.tp)
    say = Report(args.out)
    heading(say, f"KDA chain-verify tunings A/B: {args.model} at TP{args.tp} ({shape.heads} heads, K = V = "
                 f"{shape.dim}), {args.rotations} rotating input sets")
    harness = chain_harness(shape, args.rotations)
    runs = {(label, t): (lambda *x, t=t, tuning=tuning: kda_chain_verify(*x, tokens=t, **harness.cfg, tuning=tuning,
                                                                         in_place=False))
            for label, tuning in tunings(args).items() for t in args.ts}
    xs_t = {t: harness.inputs(t) for t in args.ts}
    fails = check(runs, harness, xs_t, say)
    per_round = timed_rounds(runs, harness, xs_t, args, say)
    profiled = profile_loops(harness, runs, xs_t) if args.profile else {}
    fla = load_fla(args.fla_json) if args.fla_json else {}
    if "error" in fla:
        say(f"- fla: {fla['error']}")
    report(per_round, profiled, fla, args, say)
    say()
    say(f"correctness failures: {fails or 'none'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
