"""Absorbed MLA attention at decode / verify widths on one GPU: XLA's form against the Pallas kernel's tunings.

    python bench/mla_bench.py --out mla.md              # Flash's TP2 share
    python bench/mla_bench.py --tp 1 --breakdown        # also each kernel's µs (profiled) for the BREAKDOWN rows
    python bench/mla_bench.py --smoke                   # tiny preset, interpret mode: a CPU check

One device's share at --tp (default 2) of the preset's MLA (Flash at TP2: 16 heads, rank 512, rope 64), 16 query
rows of which T are real (a decode/verify forward), a cache of --capacity slots (the serving bench's 8192 + 1024)
holding `context` tokens. For each (T, context): lingjax.ops.mla.mla_absorbed (XLA's form: it reads and converts
the whole capacity) and the kernel (lingjax.pallas.mla_decode) at each of TUNINGS (MLATuning values, the default
first), each checked against XLA's result (tf32 dots there, bf16 halves here: 5e-3) and, for the kernel, row
invariance (row 0 bit for bit at T = 1 and at T). Timed in-graph: a jitted fori_loop over `copies` distinct caches
(>= 64 MB in all, past the L2), medians of repeated calls. Floor: the visible cache slots (context x (R + r) bf16)
plus kv_b_proj's weight, q and o, over the read bandwidth measured in the same run.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from common import (
    Report,
    add_options,
    config_of,
    floor_row,
    heading,
    median_seconds,
    parser,
    read_bandwidth,
    rel,
    run_or_report,
)
from lingjax import profiling
from lingjax.config import VERIFY_ROWS
from lingjax.ops.mla import mla_absorbed
from lingjax.pallas.mla_decode import MLATuning, mla_decode_attention

BF16, F32 = jnp.bfloat16, jnp.float32
ROWS = VERIFY_ROWS  # the query rows of a decode / verify forward
TUNINGS = {  # label -> MLATuning fields
    "default": {},
    "stages 1": dict(num_stages=1),
    "stages 4": dict(num_stages=4),
    "s64": dict(splits=64),
    "s64 stages 4": dict(splits=64, num_stages=4),
    "s128": dict(splits=128),
    "s64 w8": dict(splits=64, num_warps=8),
}
SMOKE_TUNINGS = ("default", "s64")  # --smoke: the default and one other split count, each code path once
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


def call(tuning, tokens, scale):
    """(q_nope, q_pe, cache, w_kvb, positions) -> o: XLA's form (tuning None) or the kernel at that MLATuning."""
    if tuning is None:
        return lambda a, b, c, w, p: mla_absorbed(a, b, c, w, p, scale, tokens=tokens)
    return lambda a, b, c, w, p: mla_decode_attention(a, b, c, w, p, scale, tokens=tokens, tuning=tuning)


def kernel_times(loop, args, calls: int, top: int = 6) -> str:
    """One call of `loop` under the profiler: its `top` kernels by time, as 'name µs' per attention call
    (device 0; `calls` attention calls in the loop)."""
    kernels = profiling.traced_kernels(loop, *args)
    total = collections.Counter()
    for k in kernels:
        total[k.name[:40]] += k.dur_us / calls
    return ", ".join(f"{name} {us:.1f}" for name, us in total.most_common(top)) or "(no GPU kernels traced)"


def inputs(cfg, args):
    """(q_nope, q_pe, caches, w_kvb): one device's rows, `copies` distinct caches (>= 64 MB in all), kv_b_proj."""
    h, n, r, rank, v = (cfg.num_heads // args.tp, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                        cfg.v_head_dim)
    cache_bytes = args.capacity * (rank + r) * 2
    copies = max(2, min(64, -(-int(1 if args.smoke else 64e6) // cache_bytes)))
    keys = jax.random.split(jax.random.key(0), copies + 4)
    caches = [jax.random.normal(k, (args.capacity, rank + r), F32).astype(BF16) for k in keys[4:]]
    q_nope = jax.random.normal(keys[0], (ROWS, h, n), F32).astype(BF16)
    q_pe = jax.random.normal(keys[1], (ROWS, h, r), F32).astype(BF16)
    w = (jax.random.normal(keys[2], (h * (n + v), rank), F32) * rank**-0.5).astype(BF16)
    return q_nope, q_pe, caches, w


def bench_case(t, ctx, data, scale, bw, args, say, fails, breakdowns) -> None:
    """XLA's form and every tuning at T real rows and `ctx` cached tokens: one table row each."""
    q_nope, q_pe, caches, w = data
    iters, reps = (1, 1) if args.smoke else (10, 9)
    h, v, rank_r = q_nope.shape[1], w.shape[0] // q_nope.shape[1] - q_nope.shape[2], caches[0].shape[1]
    positions = ctx - 1 + jnp.arange(ROWS)  # row 0 is the context's last token; later rows see more slots
    visible = min(ctx + t - 1, args.capacity)
    floor_us = (visible * rank_r * 2 + w.nbytes + q_nope.nbytes + q_pe.nbytes + ROWS * h * v * 4) / bw * 1e6
    want = jax.jit(call(None, t, scale))(q_nope, q_pe, caches[0], w, positions)
    cases = [("XLA (mla_absorbed)", None)] + [(f"pallas {k}", dataclasses.replace(MLATuning(), **f))
                                              for k, f in TUNINGS.items() if not args.smoke or k in SMOKE_TUNINGS]
    for label, tuning in cases:
        fn = call(tuning, t, scale)
        loop = timing_loop(fn, iters)
        done = run_or_report(lambda: (jax.jit(fn)(q_nope, q_pe, caches[0], w, positions), median_seconds(
            loop, q_nope, q_pe, caches, w, positions, reps=reps) / (iters * len(caches)) * 1e6),
            say, f"| {t} | {ctx} | {label} |", 3, fails, f"T={t} ctx={ctx} {label}")
        if done is None:
            continue
        got, us = done
        err = rel(got[:t], want[:t])
        ok = err <= 5e-3
        if tuning is not None and t > 1:  # row 0 must equal the T = 1 call's row 0 bit for bit
            row0 = jax.jit(call(tuning, 1, scale))(q_nope, q_pe, caches[0], w, positions)[0]
            ok = ok and np.array_equal(np.asarray(row0), np.asarray(got[0]))
        fails += [] if ok else [f"T={t} ctx={ctx} {label} err {err:.1e} (or row 0 not bit-equal to T=1)"]
        say(floor_row(f"| {t} | {ctx} | {label} |", us, floor_us, err, ok))
        if args.breakdown and label in BREAKDOWN:
            breakdowns.append(f"- T={t}, context {ctx}, {label}: "
                              f"{kernel_times(loop, (q_nope, q_pe, caches, w, positions), iters * len(caches))}")


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "tp", "smoke", "out", model="flash", tp=2)
    ap.add_argument("--capacity", type=int, default=9216, help="cache slots")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 8192], help="tokens in the cache")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="real rows of the 16 (T)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile the BREAKDOWN rows: µs per kernel per call")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.capacity, args.contexts = "tiny", 64, [40]
    cfg = config_of(args.model)
    scale = cfg.qk_head_dim**-0.5
    say = Report(args.out)
    heading(say, f"Absorbed MLA attention, {args.model} TP{args.tp} share ({cfg.num_heads // args.tp} heads, rank "
                 f"{cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}), {ROWS} rows, capacity {args.capacity}")
    bw = read_bandwidth(1 << 20) if args.smoke else read_bandwidth()
    say(f"read bandwidth (bf16 array summed in f32): {bw / 1e12:.2f} TB/s")
    say()
    data = inputs(cfg, args)
    say.table("T", "context", "path", "µs", "floor µs", "x floor", "rel. err vs XLA")
    fails, breakdowns = [], []
    for ctx in args.contexts:
        for t in args.tokens:
            bench_case(t, ctx, data, scale, bw, args, say, fails, breakdowns)
    if breakdowns:
        say("\nµs per attention call by kernel (one profiled loop call, device 0):")
        for line in breakdowns:
            say(line)
    passed = "all variants match XLA (and rows bit-equal across T)"
    say("\n" + (passed if not fails else "FAILURES: " + "; ".join(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
