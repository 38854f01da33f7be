"""The Flash projections at verify width (16 padded rows) on one GPU: XLA's GEMM against skinny_linear.

Shapes are one device's share at --tp (default 2) of the preset's projections that run at 16 rows in a
verify: KDA in_proj (column-parallel, bf16 out) and o_proj (row-parallel, f32 partial sums for the
all-reduce), MLA q_proj and o_proj, the dense FFN's gate/up and down. For each: XLA's einsum (what the
model ran before) and skinny_linear tile variants, each checked against the XLA result, then timed
in-graph: a jitted fori_loop calling the projection on R distinct weight copies per iteration
(R x weight bytes >= 512 MB, so L2 never holds a weight), medians of repeated calls. Each figure is
given against its byte floor (weight + x + y bytes over the read bandwidth measured in the same run).

    python bench/linear_bench.py --out results.md       # GPU
    python bench/linear_bench.py --smoke                # CPU, tiny dims, interpret mode (script check)
"""

from __future__ import annotations

import argparse
import datetime
import sys

import jax
import jax.numpy as jnp

from lingjax.config import preset
from lingjax.ops.linear import linear
from lingjax.pallas.skinny_linear import skinny_linear
from measure import floor_row, median_seconds, read_bandwidth, rel, run_or_report  # bench/measure.py
from report import Report  # bench/report.py, beside this script

BF16, F32 = jnp.bfloat16, jnp.float32
ROWS = 16
VARIANTS = {  # label -> skinny_linear options; "default" takes its per-shape tiles (see its docstring)
    "default": {},
    "bn16 stages4": dict(block_n=16, stages=4),
    "bn32 stages3": dict(block_n=32, stages=3),
    "bn32 stages4": dict(block_n=32, stages=4),
    "bn64 stages4": dict(block_n=64, stages=4),
    "bn16 bk128": dict(block_n=16, stages=4, block_k=128),
    "bn16 bk512": dict(block_n=16, stages=4, block_k=512),
    "bn16 stages6": dict(block_n=16, stages=6),
    "bn16 warps1": dict(block_n=16, stages=4, warps=1),
    "bn16 warps4": dict(block_n=16, stages=4, warps=4),
}


def shapes(cfg, tp):
    """name -> (N, K, out dtype): one device's share at `tp`."""
    d, p = cfg.hidden_size, cfg.kda_dim
    return {
        "KDA in_proj": (5 * p // tp, d, BF16),
        "KDA o_proj": (d, p // tp, F32),
        "MLA q_proj": (cfg.num_heads * cfg.qk_head_dim // tp, d, BF16),
        "MLA o_proj": (d, cfg.num_heads * cfg.v_head_dim // tp, F32),
        "dense gate/up": (cfg.intermediate_size // tp, d, BF16),
        "dense down": (d, cfg.intermediate_size // tp, F32),
    }


def timing_loop(fn, iters):
    """Jitted (x, ws) -> `iters` iterations of fn(x', w) for every w. x' = x + 0·i keeps the calls in the
    loop, behind an optimization barrier so that XLA cannot fuse the update into its own GEMM (the
    model's GEMMs read a materialised x). XLA's figures here still sit above the same GEMMs in a Flash
    step's profile (o_proj: 11.7 µs against 6.0 + 1.6 for the GEMM and its split-K reduce), with or
    without the barrier; why is not known, so compare against XLA in the step (step_bench --xla-ops)."""

    def run(x, ws):
        def body(i, carry):
            xi = jax.lax.optimization_barrier(x + (i * 0).astype(x.dtype))
            return tuple(fn(xi, w) for w in ws)

        init = tuple(jnp.zeros(out.shape, out.dtype) for out in (jax.eval_shape(fn, x, w) for w in ws))
        return jax.lax.fori_loop(0, iters, body, init)

    return jax.jit(run)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash")
    ap.add_argument("--tp", type=int, default=2, help="time one device's share of a TP run of this width")
    ap.add_argument("--smoke", action="store_true", help="tiny preset, interpret mode: a CPU check of the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = preset("tiny" if args.smoke else args.model)
    iters, reps, budget = (1, 1, 1) if args.smoke else (20, 9, 512e6)
    say = Report(args.out)
    say(f"# Projections at {ROWS} rows, {args.model if not args.smoke else 'tiny'} TP{args.tp} shares, "
        f"{jax.devices()[0].device_kind} ({jax.default_backend()})")
    say(f"date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, jax {jax.__version__}")
    say("command: python bench/linear_bench.py " + " ".join(sys.argv[1:]))
    bw = read_bandwidth(1 << 20) if args.smoke else read_bandwidth()
    say(f"read bandwidth (bf16 array summed in f32): {bw / 1e12:.2f} TB/s\n")
    say("| projection | N x K | variant | µs | floor µs | x floor | rel. err vs XLA |")
    say("|---|---|---|---|---|---|---|")
    fails = []
    for name, (n, k, out) in shapes(cfg, args.tp).items():
        wbytes = n * k * 2
        copies = max(2, min(64, -(-int(budget) // wbytes)))
        keys = jax.random.split(jax.random.key(hash(name) % 2**31), copies + 1)
        x = jax.random.normal(keys[0], (ROWS, k), F32).astype(BF16)
        ws = [(jax.random.normal(kk, (n, k), F32) * k**-0.5).astype(BF16) for kk in keys[1:]]
        floor_us = (wbytes + x.nbytes + ROWS * n * jnp.dtype(out).itemsize) / bw * 1e6
        want = jax.jit(lambda a, b: linear(a, b, out))(x, ws[0])
        fns = {"XLA einsum": lambda a, b: linear(a, b, out)}
        fns.update({f"pallas {lbl}": (lambda a, b, o=o: skinny_linear(a, b, out, **o)) for lbl, o in VARIANTS.items()})
        for label, fn in fns.items():
            done = run_or_report(lambda: (rel(jax.jit(fn)(x, ws[0]), want), median_seconds(
                timing_loop(fn, iters), x, ws, reps=reps) / (iters * copies) * 1e6),
                say, f"| {name} | {n} x {k} | {label} |", 3, fails, f"{name} {label}")
            if done is None:
                continue
            err, us = done
            ok = err <= (1e-2 if out == BF16 else 1e-5)
            fails += [] if ok else [f"{name} {label} err {err:.1e}"]
            say(floor_row(f"| {name} | {n} x {k} | {label} |", us, floor_us, err, ok))
    say("\n" + ("all variants match XLA" if not fails else "FAILURES: " + "; ".join(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
