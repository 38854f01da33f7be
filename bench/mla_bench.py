"""Absorbed MLA attention at decode / verify widths on one GPU: XLA's form against the Pallas kernel.

One device's share at --tp (default 2) of the preset's MLA (Flash TP2: 16 heads, rank 512, rope 64), 16
query rows of which T are real (a decode/verify forward), a cache of --capacity slots (the serving
bench's 8192 + 1024) holding `context` tokens. For each (T, context): lingjax.ops.mla.mla_absorbed (what
the model ran before; it reads and converts the whole capacity) and the kernel's variants
(lingjax.pallas.mla_decode), each checked against XLA's result (tf32 dots there, bf16 halves here: 5e-3) and, for
the kernel, row invariance on the GPU (row 0 bit for bit at T = 1 and T = 4). Timed in-graph: a jitted
fori_loop over `copies` distinct caches (>= 64 MB in all, past the 50 MB L2), medians of repeated
calls. Floor: the visible cache slots (context x (R + r) bf16) plus kv_b_proj's weight, q and o, over the
read bandwidth measured in the same run.

    python bench/mla_bench.py --out results.md          # GPU
    python bench/mla_bench.py --breakdown               # also each kernel's µs (profiled), BREAKDOWN variants
    python bench/mla_bench.py --smoke                   # CPU, tiny preset, interpret mode (script check)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import sys

import jax
import jax.numpy as jnp
import numpy as np

from lingjax import profiling
from lingjax.config import preset
from lingjax.ops.mla import mla_absorbed
from lingjax.pallas.mla_decode import mla_decode_attention
from measure import floor_row, median_seconds, read_bandwidth, rel, run_or_report  # bench/measure.py
from report import Report  # bench/report.py, beside this script

BF16, F32 = jnp.bfloat16, jnp.float32
ROWS = 16
VARIANTS = {  # label -> mla_decode_attention options
    "default": {},
    "stages 1": dict(num_stages=1),
    "stages 4": dict(num_stages=4),
    "s64": dict(splits=64),
    "s64 stages 4": dict(splits=64, num_stages=4),
    "s128": dict(splits=128),
    "s64 w8": dict(splits=64, num_warps=8),
}
BREAKDOWN = ("XLA (mla_absorbed)", "pallas default", "pallas stages 1")  # --breakdown profiles these


def timing_loop(fn, iters):
    """Jitted (q_nope, q_pe, caches, w, positions) -> `iters` passes of fn over every cache."""

    def run(q_nope, q_pe, caches, w, positions):
        def body(i, carry):
            qi = q_nope + (i * 0).astype(q_nope.dtype)  # not loop-invariant: every pass runs
            return tuple(fn(qi, q_pe, c, w, positions) for c in caches)

        init = tuple(jnp.zeros(jax.eval_shape(fn, q_nope, q_pe, c, w, positions).shape, F32) for c in caches)
        return jax.lax.fori_loop(0, iters, body, init)

    return jax.jit(run)


def call(opts, tokens, scale, interpret):
    """(q_nope, q_pe, cache, w_kvb, positions) -> o: XLA's form (opts None) or the kernel with opts."""
    if opts is None:
        return lambda a, b, c, w, p: mla_absorbed(a, b, c, w, p, scale, tokens=tokens)
    return lambda a, b, c, w, p: mla_decode_attention(a, b, c, w, p, scale, tokens=tokens, interpret=interpret, **opts)


def kernel_times(loop, args, calls: int, top: int = 6) -> str:
    """One call of `loop` under the profiler: its `top` kernels by time, as 'name µs' per attention call
    (device 0; `calls` attention calls in the loop)."""
    kernels = profiling.traced_kernels(loop, *args)
    total = collections.Counter()
    for k in kernels:
        total[k.name[:40]] += k.dur_us / calls
    return ", ".join(f"{name} {us:.1f}" for name, us in total.most_common(top)) or "(no GPU kernels traced)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash")
    ap.add_argument("--tp", type=int, default=2, help="time one device's share of a TP run of this width")
    ap.add_argument("--capacity", type=int, default=9216)
    ap.add_argument("--contexts", default="256,8192", help="tokens in the cache (the rows sit at its end)")
    ap.add_argument("--tokens", default="1,4", help="real rows of the 16 (T)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile the BREAKDOWN variants: µs per kernel per call")
    ap.add_argument("--smoke", action="store_true", help="tiny preset, interpret mode: a CPU check of the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = preset("tiny" if args.smoke else args.model)
    capacity = 64 if args.smoke else args.capacity
    contexts = [16, 40] if args.smoke else [int(c) for c in args.contexts.split(",")]
    iters, reps, budget = (1, 1, 1) if args.smoke else (10, 9, 64e6)
    interp = True if args.smoke else None
    h, n, r, rank, v = (cfg.num_heads // args.tp, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                        cfg.v_head_dim)
    scale = cfg.qk_head_dim**-0.5
    say = Report(args.out)
    say(f"# Absorbed MLA attention, {args.model if not args.smoke else 'tiny'} TP{args.tp} share ({h} heads, rank "
        f"{rank}, rope {r}), {ROWS} rows, capacity {capacity}, "
        f"{jax.devices()[0].device_kind} ({jax.default_backend()})")
    say(f"date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, jax {jax.__version__}")
    say("command: python bench/mla_bench.py " + " ".join(sys.argv[1:]))
    bw = read_bandwidth(1 << 20) if args.smoke else read_bandwidth()
    say(f"read bandwidth (bf16 array summed in f32): {bw / 1e12:.2f} TB/s\n")

    cache_bytes = capacity * (rank + r) * 2
    copies = max(2, min(64, -(-int(budget) // cache_bytes)))
    keys = jax.random.split(jax.random.key(0), copies + 4)
    caches = [jax.random.normal(k, (capacity, rank + r), F32).astype(BF16) for k in keys[4:]]
    q_nope = jax.random.normal(keys[0], (ROWS, h, n), F32).astype(BF16)
    q_pe = jax.random.normal(keys[1], (ROWS, h, r), F32).astype(BF16)
    w = (jax.random.normal(keys[2], (h * (n + v), rank), F32) * rank**-0.5).astype(BF16)

    say("| T | context | path | µs | floor µs | x floor | rel. err vs XLA |")
    say("|---|---|---|---|---|---|---|")
    fails, breakdowns = [], []
    for ctx in contexts:
        positions = ctx - 1 + jnp.arange(ROWS)  # row 0 is the context's last token; later rows see more slots
        for t in (int(x) for x in args.tokens.split(",")):
            visible = min(ctx + t - 1, capacity)
            floor_us = (visible * (rank + r) * 2 + w.nbytes + q_nope.nbytes + q_pe.nbytes + ROWS * h * v * 4) / bw * 1e6
            want = jax.jit(call(None, t, scale, interp))(q_nope, q_pe, caches[0], w, positions)
            for label, opts in [("XLA (mla_absorbed)", None)] + [(f"pallas {k}", o) for k, o in VARIANTS.items()]:
                fn = call(opts, t, scale, interp)
                loop = timing_loop(fn, iters)
                done = run_or_report(lambda: (jax.jit(fn)(q_nope, q_pe, caches[0], w, positions), median_seconds(
                    loop, q_nope, q_pe, caches, w, positions, reps=reps) / (iters * copies) * 1e6),
                    say, f"| {t} | {ctx} | {label} |", 3, fails, f"T={t} ctx={ctx} {label}")
                if done is None:
                    continue
                got, us = done
                err = rel(got[:t], want[:t])
                ok = err <= 5e-3
                if opts is not None and t > 1:  # row 0 must equal the T = 1 call's row 0 bit for bit
                    row0 = jax.jit(call(opts, 1, scale, interp))(q_nope, q_pe, caches[0], w, positions)[0]
                    ok = ok and np.array_equal(np.asarray(row0), np.asarray(got[0]))
                fails += [] if ok else [f"T={t} ctx={ctx} {label} err {err:.1e} (or row 0 not bit-equal to T=1)"]
                say(floor_row(f"| {t} | {ctx} | {label} |", us, floor_us, err, ok))
                if args.breakdown and label in BREAKDOWN:
                    loop_args = (q_nope, q_pe, caches, w, positions)
                    breakdowns.append(f"- T={t}, context {ctx}, {label}: "
                                      f"{kernel_times(loop, loop_args, iters * copies)}")
    if breakdowns:
        say("\nµs per attention call by kernel (one profiled loop call, device 0):")
        for line in breakdowns:
            say(line)
    passed = "all variants match XLA (and rows bit-equal across T)"
    say("\n" + (passed if not fails else "FAILURES: " + "; ".join(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
