"""What HTTP adds to a request: the same streamed greedy requests in-process (lingjax.generate) and through
`lingjax serve` (a subprocess on 127.0.0.1, the real HTTP stack), for each speculation mode, side by side.

    python bench/serve_overhead.py --spec none nextn dspark --prompt-len 512 --output-len 256 --requests 8 --out o.md
    python bench/serve_overhead.py --model tiny --spec none --prompt-len 16 --output-len 8 --requests 1   # CPU check

Both sides send the same prompts (random token ids below 1000), EOS ignored, one request at a time after one
warm-up request each (it compiles). TPOT = (latency - TTFT) / (tokens - 1) on each side (the write-up's
definition): in-process from the engine's host times, over HTTP at the client (bench/serve_http.py), so the HTTP
figure also holds the server's queue, the SSE encoding and the socket. The two sides run one after the other, never
at once: the server's process holds the GPU only while its requests run.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

# the two sides' processes share the GPU one after the other: neither may take its memory up front
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import serve_http  # noqa: E402

import lingjax  # noqa: E402
from common import Report, heading  # noqa: E402
from lingjax.config import PRESETS  # noqa: E402


def prompts(n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 1000, length).tolist() for _ in range(n + 1)]  # the first is the warm-up


def in_process(args, spec: str | None, batch: list[list[int]]) -> list[tuple[float, float, float]]:
    """-> per measured request (TTFT s, TPOT s, accept length)."""
    model = lingjax.load(args.model)
    out = []
    for i, prompt in enumerate(batch):
        r = lingjax.generate(model, np.asarray(prompt, np.int32), args.output_len, ignore_eos=True, spec=spec,
                             steps=args.steps)
        if i:
            out.append((r.ttft_s, r.tpot_mean_s, r.mean_accept_len))
    del model
    jax.clear_caches()
    return out


def over_http(args, spec: str | None, batch: list[list[int]]) -> list[tuple[float, float, float]]:
    port = serve_http.free_port()
    cmd = [sys.executable, "-m", "lingjax.cli", "serve", "--port", str(port), "--no-cache"]
    cmd += ["--model", args.model] if args.model in PRESETS else (["--checkpoint", args.model] if args.model else [])
    cmd += ["--spec", spec] if spec else []
    cmd += ["--steps", str(args.steps)] if args.steps and spec else []
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"{args.log_dir}/serve_{spec}.log", "w"),
                              env=os.environ.copy())
    try:
        try:
            serve_http.wait_ready(url, server, args.start_timeout)
        except RuntimeError as e:
            raise RuntimeError(f"`{' '.join(cmd)}`: {e} (its log: {args.log_dir}/serve_{spec}.log)") from None
        name = serve_http.served_model(url)
        out = []
        for i, prompt in enumerate(batch):
            r = serve_http.stream_completion(url, name, prompt, args.output_len)
            if i:
                out.append((r.ttft_s, r.tpot_s, float("nan")))
        return out
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a preset or a checkpoint (default: the shipped model)")
    ap.add_argument("--spec", nargs="+", default=["none", "nextn", "dspark"], choices=["none", "nextn", "dspark"])
    ap.add_argument("--steps", type=int, default=None, help="drafts per round (default: lingjax's per mode)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--requests", type=int, default=8, help="measured requests per side (after one warm-up)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the server to answer /health")
    ap.add_argument("--log-dir", default=".", help="where the servers' logs go")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.requests < 1 or args.output_len < 2 or args.prompt_len < 1:
        ap.error("--requests >= 1, --output-len >= 2 and --prompt-len >= 1")
    batch = prompts(args.requests, args.prompt_len)
    say = Report(args.out)
    heading(say, f"HTTP against in-process: {args.model or 'the shipped model'}")
    say(f"prompt {args.prompt_len} random ids, output {args.output_len}, EOS ignored, greedy, streamed, "
        f"{args.requests} requests a side after a warm-up; the server runs with --no-cache")
    say()
    say.table("spec", "in-process TPOT ms", "HTTP TPOT ms", "HTTP / in-process", "in-process TTFT ms",
              "HTTP TTFT ms", "accept length")
    for spec in args.spec:
        mode = None if spec == "none" else spec
        local = in_process(args, mode, batch)
        remote = over_http(args, mode, batch)
        med = lambda rows, k: statistics.median(r[k] for r in rows)
        say.row(spec, f"{med(local, 1) * 1e3:.3f}", f"{med(remote, 1) * 1e3:.3f}",
                f"{med(remote, 1) / med(local, 1):.3f}", f"{med(local, 0) * 1e3:.1f}", f"{med(remote, 0) * 1e3:.1f}",
                f"{statistics.fmean(r[2] for r in local):.2f}" if mode else "-")
    say()
    say("Medians over the measured requests. The accept length is the in-process side's (the server's requests run "
        "the same programs on the same prompts).")


if __name__ == "__main__":
    main()
