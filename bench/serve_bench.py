"""The serving benchmark at concurrency 1: fixed-length random prompts, fixed output length, greedy, EOS ignored,
one request after another.

    python bench/serve_bench.py --model mid --prompt-len 8192 --output-len 1024 --requests 1000 \\
        --time-budget 240 --spec nextn --steps 3 --out serve_mid.md
    python bench/serve_bench.py --model tiny --prompt-len 40 --output-len 9 --requests 2 --prefill-chunk 32  # CPU
    python bench/serve_bench.py --model flash --weights fp8 --prompt-len 512 2048 8192 --output-len 64 --requests 3
        # several prompt lengths, one after another in one process (the model loaded once), a table each
    python bench/serve_bench.py --url http://127.0.0.1:8000 --prompt-len 8192 --output-len 1024 --requests 50
        # over HTTP, against a running `lingjax serve` (its --spec is the server's); bench/serve_http.py

Definitions (SGLang's bench_serving; docs/speculation.md): TPOT per request = (latency - TTFT) / (output tokens
- 1), excluding TTFT; mean and median over requests. Output throughput = output tokens / benchmark duration (after
one warm-up request). Peak output throughput = the most tokens in any 1-second bin of token arrival times, bins from
the first request's start. Mean accept length = tokens committed / verify rounds over all requests (the bonus
counts). Derived step time = mean TPOT x mean accept length. Requests stop at --requests or when --time-budget runs
out; the count is reported.
"""

from __future__ import annotations

import statistics
import sys
import time

import dspark_shapes
import numpy as np

import lingjax
from common import Report, add_options, heading, parser
from lingjax import engine, requests
from lingjax.spec import dspark_io


def show_progress(done: int, total: int, started: float, tpot_ms: float) -> None:
    width = 30
    filled = int(width * done / total)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, {time.perf_counter() - started:.0f} s,"
          f" TPOT {tpot_ms:.2f} ms", end="", file=sys.stderr, flush=True)


def run_requests(model, args, prompt_len: int):
    """One warm-up request (compiles every program), then requests of prompt_len tokens until --requests or
    --time-budget -> (warm-up seconds, [(start time, GenerationResult)], began, duration)."""
    rng = np.random.default_rng(0)

    def request():
        prompt = rng.integers(0, model.cfg.vocab_size, prompt_len)
        start = time.perf_counter()
        result = lingjax.generate(model, prompt, args.output_len, ignore_eos=True, spec=args.spec, steps=args.steps,
                                  prefill_chunk=args.prefill_chunk,
                                  rounds_per_call=args.rounds_per_call)
        return start, result

    t = time.perf_counter()
    request()
    warmup_s = time.perf_counter() - t
    results = []
    began = time.perf_counter()
    while len(results) < args.requests and time.perf_counter() - began < args.time_budget:
        results.append(request())
        show_progress(len(results), args.requests, began, results[-1][1].tpot_mean_s * 1e3)
    duration = time.perf_counter() - began
    print(file=sys.stderr)
    return warmup_s, results, began, duration


def report(say: Report, args, prompt_len: int, warmup_s, results, began, duration) -> None:
    tpots = [r.tpot_mean_s for _, r in results]
    out_tokens = sum(len(r.tokens) for _, r in results)
    arrivals = np.concatenate([start - began + np.asarray(r.token_times_s) for start, r in results])
    peak = int(np.bincount(arrivals.astype(int)).max())
    rounds = sum(len(r.accept_lens) for _, r in results)
    accept = sum(sum(r.accept_lens) for _, r in results) / rounds if rounds else 1.0
    mean_tpot = statistics.fmean(tpots)
    say()
    say(f"prompt {prompt_len} (prefill chunks of {args.prefill_chunk}), output {args.output_len}, concurrency 1, "
        f"greedy, EOS ignored; warm-up request {warmup_s:.1f} s (compilation)")
    say.table("metric", "value")
    say.row("requests measured", f"{len(results)} (asked {args.requests}, budget {args.time_budget:.0f} s)")
    say.row("mean TPOT", f"{mean_tpot * 1e3:.3f} ms")
    say.row("median TPOT", f"{statistics.median(tpots) * 1e3:.3f} ms")
    say.row("output throughput", f"{out_tokens / duration:.1f} tok/s")
    say.row("peak output throughput (1 s bins)", f"{peak} tok/s")
    say.row("mean accept length", f"{accept:.2f}")
    say.row("derived step time (mean TPOT x accept)", f"{mean_tpot * accept * 1e3:.3f} ms")
    say.row("mean TTFT", f"{statistics.fmean(r.ttft_s for _, r in results) * 1e3:.1f} ms")


def run_http(args) -> None:
    """--url: the same requests through a running server, TTFT and TPOT measured at the client."""
    import serve_http

    model = serve_http.served_model(args.url)
    rng = np.random.default_rng(0)

    def request():
        return serve_http.stream_completion(args.url, model, rng.integers(0, 1000, args.prompt_len).tolist(),
                                            args.output_len)

    t = time.perf_counter()
    request()  # the warm-up: the server compiles its programs for these shapes
    warmup_s = time.perf_counter() - t
    results, began = [], time.perf_counter()
    while len(results) < args.requests and time.perf_counter() - began < args.time_budget:
        results.append(request())
        show_progress(len(results), args.requests, began, results[-1].tpot_s * 1e3)
    duration = time.perf_counter() - began
    print(file=sys.stderr)
    say = Report(args.out)
    say(f"# serve_bench over HTTP: {model} at {args.url}")
    say(f"command: `python {' '.join(sys.argv)}`")
    say(f"prompt {args.prompt_len} random ids, output {args.output_len}, concurrency 1, greedy, EOS ignored, "
        f"streamed; warm-up request {warmup_s:.1f} s")
    say()
    tpots = [r.tpot_s for r in results]
    say.table("metric", "value")
    say.row("requests measured", f"{len(results)} (asked {args.requests}, budget {args.time_budget:.0f} s)")
    say.row("mean TPOT", f"{statistics.fmean(tpots) * 1e3:.3f} ms")
    say.row("median TPOT", f"{statistics.median(tpots) * 1e3:.3f} ms")
    say.row("output throughput", f"{sum(r.tokens for r in results) / duration:.1f} tok/s")
    say.row("mean TTFT", f"{statistics.fmean(r.ttft_s for r in results) * 1e3:.1f} ms")


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "dtype", "kernels", "tp", "router_precision", "weights", "out")
    ap.add_argument("--spec", default=None, choices=[None, "nextn", "dspark"])
    ap.add_argument("--steps", type=int, default=None, help="drafts per round with --spec (nextn: 3; dspark: the "
                    "drafter's block)")
    ap.add_argument("--draft", default="random", help="--spec dspark: the drafter, a directory or 'random' (the "
                    "released Ling draft's shape, bench/dspark_shapes.py, for a preset)")
    ap.add_argument("--rounds-per-call", type=int, default=1,
                    help="speculative rounds (or decode steps without --spec) per device call")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[8192],
                    help="prompt tokens; several: each length's requests in turn, a table each")
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prefill-chunk", type=int, default=engine.PREFILL_CHUNK,
                    help="prompt tokens per prefill program (a power of two); each chunk reads the weights once")
    ap.add_argument("--time-budget", type=float, default=600.0, help="seconds for the measured requests")
    ap.add_argument("--url", default=None, help="measure over HTTP against a running `lingjax serve` at this URL "
                    "(the model and speculation are the server's)")
    args = ap.parse_args(argv)
    if args.url is not None:
        if args.spec is not None or args.steps is not None:
            ap.error("--spec and --steps are the server's with --url: start it with `lingjax serve --spec ...`")
        if args.requests < 1 or args.output_len < 2 or len(args.prompt_len) != 1 or args.prompt_len[0] < 1:
            ap.error("--url needs --requests >= 1, --output-len >= 2 and one --prompt-len >= 1")
        args.prompt_len = args.prompt_len[0]
        return run_http(args)
    if min(args.prompt_len) < 1:
        ap.error(f"--prompt-len must be >= 1, got {min(args.prompt_len)}")
    try:
        requests.check_prefill_chunk(args.prefill_chunk)
    except ValueError as e:
        ap.error(f"--prefill-chunk: {e}")
    if args.spec == "nextn" and args.steps is None:
        args.steps = 3
    model = lingjax.load(args.model, dtype=args.dtype, kernels=args.kernels, tp=args.tp,
                         router_precision=args.router_precision, weights=args.weights, draft=None)
    if args.spec == "dspark":
        from lingjax.spec import dspark

        draft = (dspark.random_dspark(dspark_shapes.ling_shaped_config(model.cfg), args.dtype) if args.draft == "random"
                 else dspark_io.load_dspark(args.draft, args.dtype, model.cfg))
        model = model.with_draft(draft)
    say = Report(args.out)
    heading(
        say,
        f"serve_bench: {args.model}, {args.dtype}, weights {args.weights}, kernels={model.kernels}, "
        f"router {args.router_precision}, tp={args.tp}, spec={args.spec or 'none'}"
        f"{f' (S={args.steps or "its block"})' if args.spec else ''}, "
        f"{args.rounds_per_call} per call",
    )
    for prompt_len in args.prompt_len:
        report(say, args, prompt_len, *run_requests(model, args, prompt_len))


if __name__ == "__main__":
    main()
