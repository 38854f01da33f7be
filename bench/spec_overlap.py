"""Does the host keep ahead of the device? Speculative rounds and plain decode steps, timed three ways.

    python bench/spec_overlap.py --model mid --steps 3 --new-tokens 128 --out spec_overlap.md
    python bench/spec_overlap.py --model tiny --new-tokens 16 --prompt-len 24      # a CPU check

- device time per step: N steps dispatched back to back, one block at the end (no host reads);
- dispatch time per step: how long the host's call takes to return (the host's own work);
- loop time per step: lingjax.generate's run-ahead loop, (last token - first token) / steps;
- blocking loop time per step: the same steps with a read right after each dispatch.
If the run-ahead loop's time per step matches the device time while the blocking loop pays
device + host, the host's loop is hidden under the device. The whole generate call also runs under
jax.transfer_guard_device_to_host("disallow") (engine.host_read is the only allowed read), with a
negative control showing the guard fires on this backend. Weights are random (`--model` preset):
the MTP layer drafts badly, so accept lengths are ~1; this measures the loop, not acceptance.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import lingjax
from common import Report, add_options, heading, parser
from lingjax import engine
from lingjax.sampling import SamplingParams
from lingjax.spec import step as spec_step


def _spec_state(model, program, drafter, prompt, max_new):
    return engine.spec_prefill(model, program, drafter, prompt, max_new, jax.random.key(0))[1]


def time_rounds(model, program, drafter, prompt, rounds):
    """(device s/round, dispatch s/round, blocking-loop s/round) over `rounds` rounds, medians of 3."""
    device, dispatch, blocking = [], [], []
    for _ in range(3):
        state = _spec_state(model, program, drafter, prompt, rounds * (drafter.steps + 1))
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        calls = []
        for _ in range(rounds):
            c0 = time.perf_counter()
            state, out = program.round(program.weights, state)
            calls.append(time.perf_counter() - c0)
        jax.block_until_ready(out)
        device.append((time.perf_counter() - t0) / rounds)
        dispatch.append(statistics.median(calls))
        state = _spec_state(model, program, drafter, prompt, rounds * (drafter.steps + 1))
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(rounds):
            state, out = program.round(program.weights, state)
            engine.host_read(out)  # wait for this round before launching the next
        blocking.append((time.perf_counter() - t0) / rounds)
    return statistics.median(device), statistics.median(dispatch), statistics.median(blocking)


def time_decode(model, prompt, steps):
    sampling = SamplingParams()
    _, decode = model.step_programs(sampling)
    key = jax.random.key(0)
    token, cache = engine.plain_prefill(model, prompt, steps, sampling, key)
    jax.block_until_ready(token)
    t0 = time.perf_counter()
    calls = []
    pos = jnp.int32(prompt.size)
    for _ in range(steps):
        c0 = time.perf_counter()
        _, token, pos, cache = decode(model.weights, cache, token, pos, key)
        calls.append(time.perf_counter() - c0)
    jax.block_until_ready(token)
    return (time.perf_counter() - t0) / steps, statistics.median(calls)


def guard_fires() -> bool:
    """Whether reading a device value under transfer_guard_device_to_host("disallow") raises on this backend (the
    negative control of the guarded generate calls)."""
    with jax.transfer_guard_device_to_host("disallow"):
        try:
            int(jnp.int32(3) + 1)
        except Exception:
            return True
    return False


def guarded_runs(model, prompt, args, say):
    """Compile, then the run-ahead loops (plain and speculative) under the transfer guard -> (plain, spec) results."""
    n = args.new_tokens
    t = time.perf_counter()  # compile everything once
    lingjax.generate(model, prompt, n, ignore_eos=True)
    lingjax.generate(model, prompt, n, ignore_eos=True, spec="nextn", steps=args.steps)
    say(f"compile + first runs {time.perf_counter() - t:.1f} s")
    with jax.transfer_guard_device_to_host("disallow"):
        plain = lingjax.generate(model, prompt, n, ignore_eos=True)
        spec = lingjax.generate(model, prompt, n, ignore_eos=True, spec="nextn", steps=args.steps)
    say("generate ran under transfer_guard_device_to_host('disallow'); negative control (int() of a device array "
        "under the guard) " + ("raised" if guard_fires() else "did NOT raise: the guard is blind on this backend"))
    return plain, spec


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "dtype", "kernels", "out")
    ap.add_argument("--steps", type=int, default=3, help="drafts per round")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)

    say = Report(args.out)
    t = time.perf_counter()
    model = lingjax.load(args.model, dtype=args.dtype, kernels=args.kernels)
    jax.block_until_ready(model.weights)
    heading(say, f"spec_overlap: {args.model} ({model.num_params() / 1e9:.2f} B params, {args.dtype}, kernels "
                 f"{model.kernels}), steps {args.steps}")
    say(f"load {time.perf_counter() - t:.1f} s")
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, args.prompt_len).astype(np.int32)
    plain, spec = guarded_runs(model, prompt, args, say)

    drafter = engine.make_drafter(model, "nextn", args.steps)
    program = spec_step.spec_program(model, drafter, SamplingParams())
    rounds = len(spec.accept_lens)
    dev_r, disp_r, block_r = time_rounds(model, program, drafter, prompt, rounds)
    loop_r = (spec.token_times_s[-1] - spec.ttft_s) / max(rounds - 1, 1)
    dev_d, disp_d = time_decode(model, prompt, args.new_tokens - 1)
    loop_d = (plain.token_times_s[-1] - plain.ttft_s) / (len(plain.tokens) - 1)
    say()
    say.table("step", "device µs/step", "host dispatch µs/step", "run-ahead loop µs/step", "loop / device",
              "blocking loop µs/step")
    say.row(f"speculative round (S={args.steps})", f"{dev_r * 1e6:.0f}", f"{disp_r * 1e6:.0f}", f"{loop_r * 1e6:.0f}",
            f"{loop_r / dev_r:.2f}", f"{block_r * 1e6:.0f}")
    say.row("plain decode (T=1)", f"{dev_d * 1e6:.0f}", f"{disp_d * 1e6:.0f}", f"{loop_d * 1e6:.0f}",
            f"{loop_d / dev_d:.2f}", "-")
    say()
    say(f"rounds {rounds}, mean accept length {spec.mean_accept_len:.2f} (random MTP weights); "
        f"TTFT spec {spec.ttft_s * 1e3:.1f} ms, plain {plain.ttft_s * 1e3:.1f} ms")
    first_diff = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b), None)
    same = spec.tokens == plain.tokens
    say(f"greedy speculative == plain ({args.dtype}): {same}"
        + ("" if same else f" (first difference at token {first_diff})"))


if __name__ == "__main__":
    main()
