"""The write-up's serving benchmark at concurrency 1: fixed-length random prompts, fixed output length,
greedy, EOS ignored, one request after another.

    python bench/serve_bench.py --model mid --prompt-len 8192 --output-len 1024 --requests 1000 \\
        --time-budget 240 --spec nextn --steps 3 --out report.md

Definitions (sglang bench_serving, speculation.md §7): TPOT per request = (latency - TTFT) /
(output tokens - 1), excluding TTFT; mean and median over requests. Output throughput = output tokens /
benchmark duration (after one warm-up request). Peak output throughput = the most tokens in any
1-second bin of token arrival times, bins from the first request's start. Mean accept length = tokens
committed / verify rounds over all requests (the bonus counts). Derived step time = mean TPOT x mean
accept length. Requests stop at --requests or when --time-budget runs out; the count is reported.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import jax
import numpy as np

import lingjax
from lingjax import engine


def progress(done: int, total: int, started: float, tpot_ms: float) -> None:
    width = 30
    filled = int(width * done / total)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, {time.perf_counter() - started:.0f} s,"
          f" TPOT {tpot_ms:.2f} ms", end="", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mid", help="preset or checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", default="auto", choices=["auto", "xla", "pallas"],
                    help="auto (lingjax.load's default): Pallas on a GPU, the XLA references elsewhere")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--router-precision", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--spec", default=None, choices=[None, "nextn"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds-per-call", type=int, default=1,
                    help="speculative rounds (or decode steps without --spec) per device call")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prefill-chunk", type=int, default=engine.PREFILL_CHUNK,
                    help="prompt tokens per prefill program (a power of two); each chunk reads the weights once")
    ap.add_argument("--time-budget", type=float, default=600.0, help="seconds for the measured requests")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.prefill_chunk & (args.prefill_chunk - 1) or args.prefill_chunk < engine.prefill_bucket(1):
        ap.error(f"--prefill-chunk must be a power of two >= {engine.prefill_bucket(1)}, got {args.prefill_chunk}")
    engine.PREFILL_CHUNK = args.prefill_chunk  # the engine reads it per call

    model = lingjax.load(args.model, dtype=args.dtype, kernels=args.kernels, tp=args.tp,
                         router_precision=args.router_precision)
    rng = np.random.default_rng(0)

    def request():
        prompt = rng.integers(0, model.cfg.vocab_size, args.prompt_len)
        start = time.perf_counter()
        result = lingjax.generate(model, prompt, args.output_len, ignore_eos=True, spec=args.spec, steps=args.steps,
                                  rounds_per_call=args.rounds_per_call)
        return start, result

    t = time.perf_counter()
    request()  # warm-up: compiles every program
    warmup_s = time.perf_counter() - t

    results = []
    began = time.perf_counter()
    while len(results) < args.requests and time.perf_counter() - began < args.time_budget:
        results.append(request())
        progress(len(results), args.requests, began, results[-1][1].tpot_mean_s * 1e3)
    duration = time.perf_counter() - began
    print(file=sys.stderr)

    tpots = [r.tpot_mean_s for _, r in results]
    out_tokens = sum(len(r.tokens) for _, r in results)
    arrivals = np.concatenate([start - began + np.asarray(r.token_times_s) for start, r in results])
    peak = int(np.bincount(arrivals.astype(int)).max())
    rounds = sum(len(r.accept_lens) for _, r in results)
    accept = sum(sum(r.accept_lens) for _, r in results) / rounds if rounds else 1.0
    mean_tpot = statistics.fmean(tpots)
    lines = [
        f"# serve_bench: {args.model}, {args.dtype}, kernels={model.kernels}, router {args.router_precision}, tp={args.tp}, "
        f"spec={args.spec or 'none'}{f' (S={args.steps})' if args.spec else ''}, {args.rounds_per_call} per call",
        f"date {datetime.date.today()}, device {jax.devices()[0].device_kind} x{args.tp}, jax {jax.__version__}; "
        f"prompt {args.prompt_len} (prefill chunks of {args.prefill_chunk}), output {args.output_len}, concurrency 1, "
        f"greedy, EOS ignored; "
        f"warm-up request {warmup_s:.1f} s (compilation)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| requests measured | {len(results)} (asked {args.requests}, budget {args.time_budget:.0f} s) |",
        f"| mean TPOT | {mean_tpot * 1e3:.3f} ms |",
        f"| median TPOT | {statistics.median(tpots) * 1e3:.3f} ms |",
        f"| output throughput | {out_tokens / duration:.1f} tok/s |",
        f"| peak output throughput (1 s bins) | {peak} tok/s |",
        f"| mean accept length | {accept:.2f} |",
        f"| derived step time (mean TPOT x accept) | {mean_tpot * accept * 1e3:.3f} ms |",
        f"| mean TTFT | {statistics.fmean(r.ttft_s for _, r in results) * 1e3:.1f} ms |",
    ]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
