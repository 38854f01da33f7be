"""Steady-state step time against its byte floor, per kernel set.

    python bench/step_bench.py --model mid --steps 3 --kernels xla pallas --out report.md

For each kernel set: the plain T=1 decode step and the speculative round (S drafts, verify width
S+1), each timed as N steps dispatched back to back with one block at the end (median of 5 such
batches; random weights, so the MTP drafts fail and every round commits one token). Printed with
- kernels: the step program's launches counted in its optimised HLO (fusions, custom calls, library
  calls, collectives and copies outside fusions; a loop body counts once);
- bytes: weights the step must read (lm_head, attention and dense weights, router, shared expert,
  and the distinct routed experts the routers actually chose in that step, captured from the model),
  KDA state traffic, MTP draft weights;
- floor: bytes / bandwidth, the bandwidth measured in the same run (a bf16 copy of 4 GiB).
"""

from __future__ import annotations

import argparse
import datetime
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import lingjax
from lingjax import engine
from lingjax.config import KDA, MOE
from lingjax.sampling import SamplingParams

LAUNCH = re.compile(r"=\s*\S+\s+(fusion|custom-call|cublas\S*|all-reduce\S*|all-gather\S*|copy|dot|convolution|"
                    r"gather|scatter|sort|dynamic-update-slice|reduce)\(")


def count_kernels(compiled_text: str) -> int:
    """Launch-like instructions outside fused computations (ENTRY and loop/branch bodies)."""
    count, fused = 0, False
    for line in compiled_text.splitlines():
        if line and not line.startswith(" "):
            fused = line.startswith("%fused") or "fused_computation" in line.split("(")[0] or \
                line.lstrip("%").startswith(("region", "wrapped")) and "fusion" in line
        elif not fused and LAUNCH.search(line):
            count += 1
    return count


def bandwidth() -> float:
    x = jnp.ones((2 << 30,), jnp.bfloat16)  # 4 GiB
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
    copy(x).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(times)


def weight_bytes(model, distinct_experts_per_layer, width: int, draft_forwards: int) -> float:
    """Bytes one step reads at batch 1: see the module docstring."""
    cfg, item = model.cfg, jnp.dtype(model.dtype).itemsize
    d = cfg.hidden_size
    expert = 3 * cfg.moe_intermediate_size * d * item
    total = cfg.vocab_size * d * item  # lm_head, read once for all rows
    for i, (attn, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_types)):
        if attn == KDA:
            p, h = cfg.kda_dim, cfg.kda_num_heads
            total += (6 * p * d + h * d) * item + 3 * p * cfg.conv_size * 4
            total += (1 + width) * h * cfg.kda_head_dim**2 * 4  # state read + one staged write per row
        else:
            nh = cfg.num_heads
            total += (nh * cfg.qk_head_dim * d + cfg.mla_cache_dim * d + nh * 256 * cfg.kv_lora_rank
                      + nh * d + d * nh * cfg.v_head_dim) * item
        if mlp == MOE:
            total += cfg.num_experts * d * item + 3 * cfg.shared_intermediate_size * d * item
            total += distinct_experts_per_layer[i] * expert
        else:
            total += 3 * cfg.intermediate_size * d * item
    if draft_forwards:  # MTP: eh_proj + MLA + MoE (k experts) + lm_head per draft forward
        mtp = (2 * d * d + cfg.num_heads * cfg.qk_head_dim * d + cfg.num_experts * d) * item \
            + (cfg.num_experts_per_tok + 1) * expert + cfg.vocab_size * d * item
        total += draft_forwards * mtp
    return total


def distinct_experts(model, prompt, window) -> list[int]:
    """Per layer, how many distinct experts the routers chose for `window` (verify-shaped, after the
    prompt), taken from the model's own forward by wrapping MoE.route while tracing; dense: 0."""
    from lingjax.model import MoE

    def run(params, cache, tokens, start):
        chosen, route = [], MoE.route

        def recording(self, cfg, x, paths):
            weights, experts = route(self, cfg, x, paths)
            chosen.append(experts)
            return weights, experts

        MoE.route = recording
        try:
            model._module(params).forward(tokens, cache, start, tokens.shape[0], model.ex)
        finally:
            MoE.route = route
        return chosen

    _, cache = engine.plain_prefill(model, prompt, window.size, SamplingParams(), jax.random.key(0))
    chosen = iter(jax.jit(run)(model.params, cache, jnp.asarray(window), jnp.int32(prompt.size)))
    return [len(np.unique(np.asarray(next(chosen)))) if kind == MOE else 0 for kind in model.cfg.mlp_types]


def time_steps(fn, n: int) -> float:
    times = []
    for _ in range(5):
        t, done = fn(n)
        jax.block_until_ready(done)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mid")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kernels", nargs="+", default=["xla", "pallas"])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--n", type=int, default=32, help="steps per timed batch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    bw = bandwidth()
    base = lingjax.load(args.model, dtype="bfloat16")
    jax.block_until_ready(base.params)
    say(f"# step_bench: {args.model} ({base.num_params() / 1e9:.2f} B params, bf16, random weights), S={args.steps}")
    say(f"date {datetime.date.today()}, device {jax.devices()[0].device_kind}, jax {jax.__version__}; "
        f"bandwidth (bf16 copy, same run) {bw / 1e12:.2f} TB/s")
    prompt = np.random.default_rng(0).integers(0, base.cfg.vocab_size, args.prompt_len).astype(np.int32)
    width = args.steps + 1
    # the routers' real choices for a verify-width window and for one token
    window = np.random.default_rng(1).integers(0, base.cfg.vocab_size, width).astype(np.int32)
    distinct_w = distinct_experts(base, prompt, window)
    distinct_1 = distinct_experts(base, prompt, window[:1])
    bytes_decode = weight_bytes(base, distinct_1, 1, 0)
    # round = S-1 MTP draft forwards + verify (width S+1) + draft-extend (one MTP forward at width S+1)
    bytes_round = weight_bytes(base, distinct_w, width, args.steps)
    say(f"distinct routed experts per MoE layer: T=1 {[d for d in distinct_1 if d]}, T={width} "
        f"{[d for d in distinct_w if d]}")
    say()
    say("| kernels | step | µs/step | kernels in HLO | MB read (floor) | floor µs | step / floor |")
    say("|---|---|---|---|---|---|---|")
    for kernels in args.kernels:
        model = lingjax.Model(base.module, kernels=kernels, source=args.model)
        sampling = SamplingParams()
        _, decode = model.step_programs(sampling)

        def fresh_decode_state():
            key = jax.random.key(0)
            return (*engine.plain_prefill(model, prompt, 6 * args.n, sampling, key), key)

        def run_decode(n):
            token, cache, key = fresh_decode_state()
            jax.block_until_ready(cache)
            pos = jnp.int32(prompt.size)
            t = time.perf_counter()
            for _ in range(n):
                token, pos, cache = decode(model.params, cache, token, pos, key)
            return t, token

        run_decode(2)  # compile
        t_dec = time_steps(run_decode, args.n)
        token, cache, key = fresh_decode_state()
        k_dec = count_kernels(decode.lower(model.params, cache, token, jnp.int32(prompt.size), key).compile().as_text())

        drafter = engine._make_drafter(model, "nextn", args.steps)
        program = model.spec_program(drafter, sampling)
        def run_round(n):
            state = engine.spec_prefill(model, program, drafter, prompt, 6 * n, key)[1]
            jax.block_until_ready(state)
            t = time.perf_counter()
            for _ in range(n):
                state, out = program.round(model.params, state)
            return t, out

        run_round(2)
        t_round = time_steps(run_round, args.n)
        state = engine.spec_prefill(model, program, drafter, prompt, 6 * args.n, key)[1]
        k_round = count_kernels(program.round.lower(model.params, state).compile().as_text())
        for name, t, k, b in (("decode T=1", t_dec, k_dec, bytes_decode), (f"spec round S={args.steps}", t_round,
                                                                           k_round, bytes_round)):
            floor = b / bw
            say(f"| {kernels} | {name} | {t * 1e6:.0f} | {k} | {b / 1e6:.0f} | {floor * 1e6:.0f} | {t / floor:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
