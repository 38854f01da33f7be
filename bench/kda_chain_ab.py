"""KDA chain-verify kernels A/B in one process: this tree's variants against other trees' kernels.

  python bench/kda_chain_ab.py [--tree old=/path/to/other/checkout ...] [--ts 1,4,6,16] [--rounds 3]
                               [--block-v 16,32] [--warps 4] [--norms-first] [--graphs] [--profile]
                               [--fla-json fla.jsonl] [--out ab.json]

Why: the same kernel's time moved ~15% between processes on the H200 (T = 6: 11.7-14.1 µs), more than the
differences being decided. Here every variant is compiled in one process and timed in `rounds`
interleaved rounds (each round times every variant once, in kda_bench's way: R = 64 rotating cold
input sets in one jitted loop, median of 15 runs); a variant's figure is the median over rounds.
Another tree's kernel (its lingjax/pallas/kda_chain.py) runs with its own defaults (one that takes beta's
logits and the window precomputed gets them from XLA inside the timed call: load_tree_kernel). Before timing, each
variant is checked against lingjax.ops.kda.kda_chain (max rel. error, printed), and pairs that must round
alike are compared bit for bit: this tree's row loop against its unrolled kernel at each BV and warp
count, and each other tree's default against this tree's unrolled kernel at BV16 w4 (when timed). Prints
a table last: µs per call, with fla's fused_recurrent_kda in both its forms where --fla-json
(kda_bench.py --fla-child with KDA_BENCH_TS set to the same widths) is given. With --profile, a second table
splits each in-graph figure: the chain kernel's own duration in the loop, and the loop's other kernels per
call (its set-up, once per loop). The rest of a call's time lies between the loop's launches; the kernel time is
what compares with fla's graph-captured figures, whose graphs hold nothing else
(bench/results/kda_h200_2026-12-01.md). --graphs times each variant also with the loop compiled as the
model's steps are (command buffers around the loop too).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kda_bench  # noqa: E402  (bench/, beside this script: its kernel import and chain harness)

R = kda_bench.R
PROFILE_ITERS = 2  # loop iterations under the profiler: a copy made once per loop shows as 1/2 a call


def load_tree_kernel(label: str, root: str):
    """kda_chain_verify from root/lingjax/pallas/kda_chain.py, as module kda_chain_<label>, taking this tree's
    arguments. A kernel from before beta's logits and the conv ring moved into it (its second argument is
    b [rows, H], its fourth the window [W-1, 3P]) gets b = x·b_projᵀ from XLA's reduction fusion and the
    window gathered from the ring, in the timed call: two of the XLA launches the model paid beside it
    (not the window's update after it: a gather and a copy at decode, a copy at a verify's commit)."""
    path = os.path.join(root, "lingjax", "pallas", "kda_chain.py")
    spec = importlib.util.spec_from_file_location(f"kda_chain_{label}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernel = mod.kda_chain_verify
    params = inspect.signature(kernel).parameters
    if "in_place" in params:  # out of place, as this tree's variants: the bench's states are not donated
        kernel = functools.partial(kernel, in_place=False)
    if list(params)[1] != "b":
        return kernel
    from lingjax.ops.kda import ring_window
    from lingjax.ops.linear import dot_rows

    def older(proj, x, b_proj, ring, start, conv_w, *rest, **kw):  # its window from the ring, its ring unchanged
        window = ring_window(ring, start, conv_w.shape[1])
        return kernel(proj, dot_rows(x, b_proj), window, conv_w, *rest, **kw) + (ring,)
    return older


def variants_here(block_vs, warps, norms_first=False):
    """(label, kda_chain_verify options, the T it runs at or None for all, bit-identity partner label).
    norms_first: each variant also with deferred_norms=False (kda_chain's docstring)."""
    out = []
    for first in (False, True) if norms_first else (False,):
        extra, sfx = (dict(deferred_norms=False), " norms first") if first else ({}, "")
        out.append((f"default{sfx}", extra, None, None))
        for bv in block_vs:
            for w in warps:
                tag, base = f"BV{bv} w{w}{sfx}", dict(block_v=bv, num_warps=w, **extra)
                out.append((f"unrolled {tag}", dict(base, row_loop=False), lambda t: t <= 8, None))
                out.append((f"row loop {tag}", dict(base, row_loop=True), None, f"unrolled {tag}"))
    return out


def profile_loops(harness, runs, xs_t) -> dict:
    """(label, t) -> the kernels of a timed loop (PROFILE_ITERS iterations of R calls) from a profile: the
    chain kernel's median duration, and how many other kernels (and how many µs of them) the loop ran per
    call: its set-up (the carried buffers' first copies and fills) and the gate's per-iteration add. The
    in-graph µs per call is kernel time plus these plus XLA's gaps between launches."""
    import jax

    from lingjax import profiling

    out = {}
    for key, fn in runs.items():
        run = harness.loop(fn, PROFILE_ITERS)
        xs = xs_t[key[1]]
        jax.block_until_ready(run(xs))
        kernels = profiling.traced_kernels(run, xs)
        chain = [k.dur_us for k in kernels if "kda_chain_verify" in k.name]
        others = [k.dur_us for k in kernels if "kda_chain_verify" not in k.name]
        calls = PROFILE_ITERS * R
        out[key] = dict(chain_us=statistics.median(chain) if chain else float("nan"), chain_n=len(chain),
                        others_per_call=len(others) / calls, others_us=sum(others) / calls,
                        other_names=sorted({k.name for k in kernels if "kda_chain_verify" not in k.name})[:8])
    return out


def _profiled_cell(p) -> str:
    """profile_loops' figures for one variant and T as a table cell ("—" where not profiled)."""
    return f"{p['chain_us']:.2f} (+{p['others_per_call']:.1f} others, {p['others_us']:.2f})" if p else "—"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", default=[], help="label=path of another checkout (repeatable)")
    ap.add_argument("--ts", default="1,4,6,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-v", default="16,32", help="BV of this tree's unrolled and row-loop variants")
    ap.add_argument("--warps", default="4", help="num_warps of those variants")
    ap.add_argument("--norms-first", action="store_true",
                    help="also every variant with deferred_norms=False (the norms before the state's sums)")
    ap.add_argument("--graphs", action="store_true",
                    help="also time every variant with its loop compiled as lingjax.runtime.step_jit compiles the "
                         "model's steps (command buffers for the loop too): the launch gaps a step sees")
    ap.add_argument("--profile", action="store_true",
                    help="also each variant's kernels inside the timed loop, from a profile: the chain kernel's "
                         "median duration and the other kernels the loop runs per call")
    ap.add_argument("--fla-json", default=None)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kda_chain_ab.json"))
    a = ap.parse_args()
    ts = [int(t) for t in a.ts.split(",")]
    variants = variants_here([int(x) for x in a.block_v.split(",")], [int(x) for x in a.warps.split(",")],
                             a.norms_first)

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    kda_bench._import_kernels_only()
    import jax
    import numpy as np

    from measure import median_seconds, rel
    from lingjax.ops import kda
    from lingjax.pallas.kda_chain import kda_chain_verify

    harness = kda_bench.chain_harness()  # kda_bench's weights, rotating inputs and in-graph loop
    cfg, args_of = harness.cfg, harness.args

    def timed_loop(fn, iters=8, compiler_options=None):  # -> timer(xs): µs per call, median of 15 runs of iters x R
        run = harness.loop(fn, iters, compiler_options)
        return lambda xs: median_seconds(run, xs, reps=15) * 1e6 / (iters * R)

    runs = {}  # (label, t) -> the call on one input set
    for label, opts, at, _ in variants:
        for t in ts:
            if at is None or at(t):
                runs[label, t] = lambda *x, t=t, opts=opts: kda_chain_verify(*x, tokens=t, **cfg, in_place=False,
                                                                             **opts)
    for spec in a.tree:
        name, root = spec.split("=", 1)
        other = load_tree_kernel(name, root)
        for t in ts:
            runs[f"{name} tree default", t] = lambda *x, t=t, k=other: k(*x, tokens=t, **cfg)

    xs_t = {t: harness.inputs(t) for t in ts}
    with jax.default_matmul_precision("highest"):
        refs = {t: jax.jit(lambda *x, t=t: kda.kda_chain(*x, tokens=t, **cfg))(*args_of(xs_t[t], 0)) for t in ts}
    outs, res = {}, {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "errors": {}, "bitwise": {},
                     "us": {}}
    for (label, t), fn in runs.items():
        o = jax.device_get(fn(*args_of(xs_t[t], 0)))
        outs[label, t] = o
        err = max(rel(o[0], refs[t][0]), rel(o[1], refs[t][1]))
        res["errors"][f"{label} T={t}"] = err
        print(f"check {label} T={t}: max rel err {err:.1e}{'' if err < 1e-5 else '  FAIL'}", flush=True)
    pairs = [(label, partner) for label, _, _, partner in variants if partner]
    pairs += [(f"{spec.split('=')[0]} tree default", "unrolled BV16 w4") for spec in a.tree]
    for x, y in pairs:
        for t in ts:
            if (x, t) in outs and (y, t) in outs:
                same = all(np.array_equal(p, q) for p, q in zip(outs[x, t], outs[y, t]))
                res["bitwise"][f"{x} | {y} T={t}"] = same
                print(f"bitwise {x} | {y} T={t}: {'identical' if same else 'DIFFER'}", flush=True)

    timers = {key: timed_loop(fn) for key, fn in runs.items()}
    if a.graphs:  # each variant again, its loop compiled as the model's step programs are
        from lingjax.runtime import step_compiler_options

        opts = step_compiler_options()
        for (label, t), fn in runs.items():
            timers[f"{label} (step graphs)", t] = timed_loop(fn, compiler_options=opts)
    per_round = {key: [] for key in timers}
    for rnd in range(a.rounds):
        for key, timer in timers.items():
            per_round[key].append(timer(xs_t[key[1]]))
        print(f"round {rnd + 1}/{a.rounds} done", flush=True)
    for (label, t), us in per_round.items():
        res["us"][f"{label} T={t}"] = us
    profiled = profile_loops(harness, runs, xs_t) if a.profile else {}
    res["profiled"] = {f"{label} T={t}": v for (label, t), v in profiled.items()}

    fla = kda_bench.load_fla(a.fla_json) if a.fla_json else {}
    if "error" in fla:
        print(f"fla: {fla['error']}", flush=True)
    labels = list(dict.fromkeys(label for label, _ in timers))
    head = "| variant | " + " | ".join(f"T={t} µs" for t in ts) + " |"
    lines = [f"{res['device']}, jax {res['jax']}: median over {a.rounds} interleaved rounds (spread min-max)", "",
             head, "|---" * (len(ts) + 1) + "|"]
    for label in labels:
        cells = []
        for t in ts:
            us = per_round.get((label, t))
            cells.append(f"{statistics.median(us):.2f} ({min(us):.2f}-{max(us):.2f})" if us else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for key, label in (("fused_recurrent", "fla fused_recurrent_kda (stages nothing)"),
                       ("fused_recurrent_in_kernel", "fla, l2norm + gate + beta sigmoid in its kernel")):
        if fla:
            cells = [f"{fla[f'{key}_T{t}']:.2f}" if isinstance(fla.get(f"{key}_T{t}"), float) else "—" for t in ts]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if profiled:
        lines += ["", "Profiled inside the same loop (CUPTI, command buffers off while profiling): the chain kernel's "
                  "median duration, and the other kernels the loop ran per call (count, µs)", "",
                  head, "|---" * (len(ts) + 1) + "|"]
        for label in labels:
            cells = [_profiled_cell(profiled.get((label, t))) for t in ts]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    print("\n".join(lines), flush=True)
    res["table"] = "\n".join(lines)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
