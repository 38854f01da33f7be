"""Steady-state step time against its byte floor, per tensor-parallel size and kernel set.

    python bench/step_bench.py --model mid --tp 1 2 --steps 3 --kernels xla pallas --out report.md
    python bench/step_bench.py --model flash --tp 4 --kernels pallas --router-precision bf16 --profile prof/
    python bench/step_bench.py --model flash --tp 2 --kernels pallas --graphs split whole
    python bench/step_bench.py --model flash --tp 2 --kernels pallas --rounds-per-call 1 4
    python bench/step_bench.py --model flash --tp 2 --kernels pallas --kernel-option kda_chain:block_v=16

A/B in one process: --xla-ops (ops on their XLA references), --xla-option (XLA debug options) and
--kernel-option (options of the ops' Pallas kernels) each add the pallas variant again, so changed.

For each TP size (random weights made shard by shard on the devices, the same weights for every
size), kernel set and graph mode (--graphs whole puts the all-reduces inside the CUDA graphs, see
lingjax.runtime.step_jit): the plain T=1 decode step and the speculative round (S drafts, verify width
S+1), each timed as N steps dispatched back to back with one block at the end (median of 5 such
batches; random weights, so the MTP drafts fail and every round commits one token);
--rounds-per-call R runs R rounds (or decode steps) in each device call (a lax.scan) and reports per-round
figures. Printed with
- kernels: the step program's launches counted in its optimised HLO (fusions, custom calls, library
  calls, collectives and copies outside fusion bodies; a loop body counts once, so a lower bound), with
  how many of them XLA's rematerialization duplicated ("(M remat)"). Until 2026-11-30 the count missed
  tuple-shaped launches (multi-output fusions, kda_chain_verify, the router's select, moe_align) and
  counted a GEMM fusion's inner dot when its body was not named like a fused computation;
- bytes: what one device must read in the step: lm_head, attention and dense weights, router,
  shared expert, the distinct routed experts the routers actually chose (captured from the model),
  KDA state traffic, MLA latent cache, MTP draft weights; split weights count 1/tp, replicated
  ones (router, MLA kv_a_proj, latent cache) in full;
- floor: bytes / bandwidth, the read bandwidth (a 4 GiB bf16 array summed) measured in the same run, at
  its start and its end, the larger taken (one probe alone moved 2.73-3.48 TB/s between processes);
- host dispatch: the host's time to enqueue a step (≈ the step time when the host sets the pace).
--profile DIR traces --profile-steps spec rounds per configuration and prints the GPU-time census
of lingjax.profiling side by side (kernel sets and TP sizes), calibrated against the unprofiled
round; the raw traces and the round's optimised HLO land flat in DIR.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import re
import shutil
import tempfile
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import lingjax
from lingjax import engine, profiling
from lingjax.config import KDA, MOE
from lingjax.sampling import SamplingParams
from measure import read_bandwidth  # bench/measure.py, beside this script
from report import Report  # bench/report.py, beside this script

# an instruction's result shape is one token or a tuple "(s1, s2, ...)": multi-output fusions and custom
# calls (kda_chain_verify, the router's select, moe_align) have tuple shapes
LAUNCH = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+(?P<op>fusion|custom-call|cublas\S*|all-reduce\S*|all-gather\S*|"
                    r"copy|dot|convolution|gather|scatter|sort|dynamic-update-slice|reduce)\(")
FUSION_BODY = re.compile(r"\sfusion\(.*?calls=(%[\w.\-]+)")


def launch_lines(compiled_text: str) -> list[str]:
    """The launch-like instructions of an optimised HLO module: those of every computation that is not a
    fusion's body (ENTRY, loop and branch bodies, command buffers), a loop body counted once. Fusion
    bodies are found by the fusions' `calls=`, not by name: a GEMM fusion's body is named
    %gemm_fusion_dot.N_computation, and its dot is the fusion's, not a launch of its own."""
    bodies = set(FUSION_BODY.findall(compiled_text))
    out, inside = [], False
    for line in compiled_text.splitlines():
        if line and not line.startswith(" "):
            inside = line.split(" ")[0] in bodies
        elif not inside and LAUNCH.search(line):
            out.append(line)
    return out


def launch_summary(compiled_text: str) -> str:
    """"N" launches, or "N (M remat)" when XLA's rematerialization duplicated M of them (named *.remat) to
    fit its memory limit: the device memory it is given less the program's arguments. Flash's weights at
    TP2 nearly fill that limit (bench/results/aot_census_2026-11-30.md)."""
    lines = launch_lines(compiled_text)
    remat = sum(".remat" in line.split("=")[0] for line in lines)
    return f"{len(lines)} ({remat} remat)" if remat else str(len(lines))


def _layer_bytes(cfg, attn, mlp, distinct, width, ctx, item, tp) -> float:
    """One layer's bytes on one device at batch 1, verify width `width`, `ctx` cached positions:
    split weights count 1/tp, replicated ones (router, MLA kv_a_proj and latent cache) in full."""
    d = cfg.hidden_size
    total = 0.0
    if attn == KDA:
        p, h = cfg.kda_dim, cfg.kda_num_heads
        total += ((6 * p * d + h * d) * item + 3 * p * cfg.conv_size * 4) / tp
        total += (1 + width) * h * cfg.kda_head_dim**2 * 4 / tp  # state read + one staged write per row
    else:
        nh = cfg.num_heads
        total += (nh * cfg.qk_head_dim * d + nh * 256 * cfg.kv_lora_rank + nh * d + d * nh * cfg.v_head_dim) * item / tp
        total += cfg.mla_cache_dim * d * item + ctx * cfg.mla_cache_dim * item  # kv_a_proj + latent cache
    if mlp == MOE:
        expert = 3 * cfg.moe_intermediate_size * d * item
        total += cfg.num_experts * d * item + (3 * cfg.shared_intermediate_size * d * item + distinct * expert) / tp
    else:
        total += 3 * cfg.intermediate_size * d * item / tp
    return total


def weight_bytes(model, distinct_experts_per_layer, width: int, draft_forwards: int, ctx: int, tp: int = 1) -> float:
    """Bytes one device reads in one step at batch 1: see the module docstring."""
    cfg, item = model.cfg, jnp.dtype(model.dtype).itemsize
    d = cfg.hidden_size
    lm_head = cfg.vocab_size * d * item / tp  # read once for all rows
    total = lm_head + sum(_layer_bytes(cfg, attn, mlp, distinct_experts_per_layer[i], width, ctx, item, tp)
                          for i, (attn, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_types)))
    # MTP draft forwards (S-1 drafts of one row + the draft-extend): eh_proj + an MLA/MoE block whose
    # MoE reads k experts + lm_head
    mtp = 2 * d * d * item + _layer_bytes(cfg, "mla", MOE, cfg.num_experts_per_tok, 1, ctx, item, tp) + lm_head
    return total + draft_forwards * mtp


def distinct_experts(model, prompt, window) -> list[int]:
    """Per layer, how many distinct experts the routers chose for `window` (verify-shaped, after the
    prompt), taken from the model's own forward by wrapping MoE.route while tracing; dense: 0."""
    from jax.sharding import PartitionSpec as P

    from lingjax.model import MoE

    def run(params, cache, tokens, start):
        chosen, route = [], MoE.route

        def recording(self, cfg, x, paths):
            weights, experts = route(self, cfg, x, paths)
            chosen.append(experts[: paths.tokens])  # the padded rows' choices reach no expert
            return weights, experts

        MoE.route = recording
        try:
            model._module(params).forward(tokens, cache, start, tokens.shape[0], model.ex)
        finally:
            MoE.route = route
        return chosen

    n_moe = sum(kind == MOE for kind in model.cfg.mlp_types)
    run = model.sharded(run, (model.weight_specs, model.cache_specs, P(), P()), [P()] * n_moe)
    _, cache = engine.plain_prefill(model, prompt, window.size, SamplingParams(), jax.random.key(0))
    chosen = iter(jax.jit(run)(model.weights, cache, jnp.asarray(window), jnp.int32(prompt.size)))
    return [len(np.unique(np.asarray(next(chosen)))) if kind == MOE else 0 for kind in model.cfg.mlp_types]


def time_steps(fn, n: int) -> tuple[float, float]:
    """fn(n) dispatches n steps and returns (start time, last output) -> medians over 5 batches of
    (seconds per step, seconds per step the host took to dispatch). Dispatch ≈ step time means the
    host, not the GPU, sets the pace."""
    times, dispatch = [], []
    for _ in range(5):
        t, done = fn(n)
        dispatch.append((time.perf_counter() - t) / n)
        jax.block_until_ready(done)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times), statistics.median(dispatch)


def compile_then_time(what: str, fn, n: int) -> tuple[float, float]:
    """time_steps(fn, n) after a first call that compiles; reports both durations on stderr."""
    began = time.perf_counter()
    fn(2)
    compiled = time.perf_counter()
    result = time_steps(fn, n)
    progress(f"{what} compiled in {compiled - began:.0f} s, timed in {time.perf_counter() - compiled:.0f} s")
    return result


def variant_name(model) -> str:
    xla_ops = f" (xla: {','.join(model.ex.xla_ops)})" if model.ex.xla_ops else ""
    return (model.kernels + xla_ops + ("+graph-ar" if model.collectives_in_graphs else "")
            + options_label(model.xla_options, model.ex.kernel_options))


def options_label(xla_options, kernel_options) -> str:
    """" NAME=VALUE ... OP:NAME=VALUE ...": XLA debug options, then kernel options grouped as Model takes them."""
    return ("".join(f" {name}={value}" for name, value in xla_options)
            + "".join(f" {op}:{name}={value}" for op, opts in kernel_options for name, value in opts))


def xla_option(text: str) -> tuple[str, object]:
    """NAME=VALUE from the command line: VALUE as int, float, true/false, or as the string given."""
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("xla_"):
        raise argparse.ArgumentTypeError(f"expected xla_NAME=VALUE, got {text!r}")
    return name, typed(value)


def kernel_option(text: str) -> tuple[str, str, object]:
    """OP:NAME=VALUE from the command line (OP in lingjax.kernels.OPS): VALUE typed as xla_option's."""
    op, colon, rest = text.partition(":")
    name, sep, value = rest.partition("=")
    if not colon or not sep or not op or not name:
        raise argparse.ArgumentTypeError(f"expected OP:NAME=VALUE, got {text!r}")
    return op, name, typed(value)


def grouped(kernel_opts) -> tuple:
    """[(op, name, value), ...] -> Model's kernel_options: ((op, ((name, value), ...)), ...)."""
    ops = {}
    for op, name, value in kernel_opts:
        ops.setdefault(op, []).append((name, value))
    return tuple((op, tuple(opts)) for op, opts in ops.items())


def typed(value: str):
    """int, float, true/false, or the string given."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def prepared_calls(prepare, call, n: int):
    """-> launch(): n calls from a fresh state (prepare(n)), -> (start time, last output); call(state) ->
    (state, output)."""
    state = prepare(n)
    jax.block_until_ready(state)

    def launch():
        nonlocal state
        t = time.perf_counter()
        for _ in range(n):
            state, out = call(state)
        return t, out
    return launch


def time_program(what: str, per_call: int, n: int, prepare, call, lower):
    """Compile, then time about n steps of a program that runs per_call steps a call, then count the
    kernels of its compiled HLO (lower(state) -> HLO text, at the timed calls' shapes so the compilation
    cache serves it). -> (s/step, host s/step, kernels, HLO text, launch maker, s/call)."""
    calls = max(1, n // per_call)
    t_call, h_call = compile_then_time(what, lambda k: prepared_calls(prepare, call, k)(), calls)
    hlo = lower(prepare(calls))
    return (t_call / per_call, h_call / per_call, launch_summary(hlo), hlo,
            lambda k: prepared_calls(prepare, call, k), t_call)


def bench_kernels(model, args, prompt, say):
    """Decode-step and speculative-round timings of one loaded model, per --rounds-per-call ->
    (rows of (kind, name, s/step, host s/step, kernels), spec-round census or None)."""
    sampling = SamplingParams()
    key = jax.random.key(0)
    label = f"tp={model.tp} {variant_name(model)}"
    rows, census = [], None
    for steps in args.rounds_per_call:
        _, decode = model.step_programs(sampling, steps)

        def prepare(n, steps=steps):  # (token, cache, pos) after the prompt, room for n calls
            token, cache = engine.plain_prefill(model, prompt, 6 * n * steps, sampling, key, steps)
            return token, cache, jnp.int32(prompt.size)

        def call(state, decode=decode):
            token, cache, pos = state
            _, token, pos, cache = decode(model.weights, cache, token, pos, key)
            return (token, cache, pos), token

        def lower(state, decode=decode):
            token, cache, pos = state
            return decode.lower(model.weights, cache, token, pos, key).compile().as_text()

        name = "decode T=1" + (f", {steps} per call" if steps > 1 else "")
        step_s, host_s, kernels, *_ = time_program(f"{label}: {name}", steps, args.n, prepare, call, lower)
        rows.append(("decode", name, step_s, host_s, kernels))

    drafter = engine._make_drafter(model, "nextn", args.steps)
    for rounds in args.rounds_per_call:
        program = model.spec_program(drafter, sampling, rounds)

        def prepare(n, program=program, rounds=rounds):  # the speculative state after the prompt
            return engine.spec_prefill(model, program, drafter, prompt, 6 * n * rounds, key)[1]

        def call(state, program=program):
            return program.round(model.weights, state)

        def lower(state, program=program):
            return program.round.lower(model.weights, state).compile().as_text()

        name = f"spec round S={args.steps}" + (f", {rounds} per call" if rounds > 1 else "")
        step_s, host_s, kernels, hlo, launches, t_call = time_program(f"{label}: {name}", rounds, args.n,
                                                                      prepare, call, lower)
        rows.append(("round", name, step_s, host_s, kernels))
        if args.profile and rounds == args.rounds_per_call[0]:  # only the first variant's calls are traced
            census = profile_rounds(model, args, launches, hlo, rounds, t_call, say)
    return rows, census


def profile_rounds(model, args, launches, round_hlo, rounds, t_call, say):
    """Trace --profile-steps calls, save the trace and HLO in --profile, -> the GPU-time census per
    round or None."""
    tag = f"{args.model}_tp{model.tp}_{variant_name(model).replace('+', '_')}"
    if rounds > 1 and model.tp == 1:
        say(f"warning: tracing {rounds} rounds per call on one GPU: the loop is one CUDA graph and the profiler "
            "misses most kernels inside it (census 'idle' then means unseen); list --rounds-per-call 1 first")
    launch = launches(args.profile_steps)
    with tempfile.TemporaryDirectory() as raw:
        with profiling.capture(raw) as trace:
            jax.block_until_ready(launch()[1])
        kernels = profiling.load_kernels(trace.path)
        shutil.copy(trace.path, Path(args.profile) / f"{tag}.trace.json.gz")
    with gzip.open(Path(args.profile) / f"{tag}.round_hlo.txt.gz", "wt") as f:
        f.write(round_hlo)
    try:
        return profiling.census(kernels, profiling.op_scopes(round_hlo), args.profile_steps * rounds, t_call / rounds)
    except ValueError as e:  # the raw trace and HLO are saved: the census can be redone offline
        say(f"census of {tag} failed: {e}")
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mid", help="preset (random weights made on the device) or checkpoint")
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes, run one after another")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kernels", nargs="+", default=["xla", "pallas"])
    ap.add_argument("--graphs", nargs="+", default=["split"], choices=["split", "whole"],
                    help="split: all-reduces outside the CUDA graphs (default); whole: inside (runtime.step_jit)")
    ap.add_argument("--rounds-per-call", type=int, nargs="+", default=[1],
                    help="speculative rounds (and decode steps) per device call (a lax.scan); per-round figures")
    ap.add_argument("--xla-ops", nargs="*", default=[],
                    help="also time each pallas variant with these ops (lingjax.kernels.OPS) on their XLA "
                         "reference, in the same process: an A/B of single kernels inside the step")
    ap.add_argument("--xla-option", type=xla_option, action="append", default=[], metavar="xla_NAME=VALUE",
                    help="also time each pallas variant with these XLA debug options in its step programs, in "
                         "the same process (e.g. xla_gpu_experimental_force_split_k=1; repeatable: all at once)")
    ap.add_argument("--kernel-option", type=kernel_option, action="append", default=[], metavar="OP:NAME=VALUE",
                    help="also time each pallas variant with these options of the ops' Pallas kernels, in the same "
                         "process (e.g. kda_chain:block_v=16, moe_route:k_splits=2; repeatable: all at once)")
    ap.add_argument("--router-precision", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--n", type=int, default=32, help="steps per timed batch")
    ap.add_argument("--profile", default=None,
                    help="directory: trace the spec round and print a GPU-time census (of the first "
                         "--rounds-per-call value: list 1 first, since at R > 1 on one GPU the whole call is one "
                         "CUDA graph and the profiler missed most of its kernels)")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    say = Report(args.out)

    bw_start = read_bandwidth()
    say(f"# step_bench: {args.model}, bf16, S={args.steps}, router {args.router_precision}, tp {args.tp}")
    say(f"date {datetime.date.today()}, device {jax.devices()[0].device_kind} x{len(jax.devices())} visible, "
        f"jax {jax.__version__}; read bandwidth per device at the start {bw_start / 1e12:.2f} TB/s")
    measured_rows, censuses = [], {}  # (tp, kernels, step, s/step, host s/step, kernels in HLO, bytes)
    for tp in args.tp:
        t0 = time.perf_counter()
        base = lingjax.load(args.model, dtype="bfloat16", tp=tp, router_precision=args.router_precision)
        jax.block_until_ready(base.weights)
        say(f"tp={tp}: {base.num_params() / 1e9:.2f} B params made on device in {time.perf_counter() - t0:.1f} s")
        prompt = np.random.default_rng(0).integers(0, base.cfg.vocab_size, args.prompt_len).astype(np.int32)
        width = args.steps + 1
        # the routers' real choices for a verify-width window and for one token
        window = np.random.default_rng(1).integers(0, base.cfg.vocab_size, width).astype(np.int32)
        progress(f"tp={tp}: measuring the routers' choices")
        distinct_w = distinct_experts(base, prompt, window)
        distinct_1 = [base.cfg.num_experts_per_tok if d else 0 for d in distinct_w]  # one token: k distinct
        say(f"tp={tp}: distinct routed experts per MoE layer: T=1 mean {np.mean([d for d in distinct_1 if d]):.1f}, "
            f"T={width} mean {np.mean([d for d in distinct_w if d]):.1f}")
        ctx = args.prompt_len
        bytes_decode = weight_bytes(base, distinct_1, 1, 0, ctx, tp)
        # round = S-1 MTP draft forwards + verify (width S+1) + draft-extend (one MTP forward)
        bytes_round = weight_bytes(base, distinct_w, width, args.steps, ctx, tp)
        # (kernels, graphs, xla_ops, xla_options, kernel_options): each kernel set and graph mode, then the
        # pallas ones again with --xla-ops, then with --xla-option, then with --kernel-option
        plain = [(k, g) for k in args.kernels for g in args.graphs]
        pallas = [(k, g) for k, g in plain if k == "pallas"]
        variants = [(k, g, (), (), ()) for k, g in plain]
        variants += [(k, g, tuple(args.xla_ops), (), ()) for k, g in pallas if args.xla_ops]
        variants += [(k, g, (), tuple(args.xla_option), ()) for k, g in pallas if args.xla_option]
        variants += [(k, g, (), (), grouped(args.kernel_option)) for k, g in pallas if args.kernel_option]
        for kernels, graphs, xla_ops, options, kernel_opts in variants:
            if graphs == "whole" and tp == 1:
                continue  # no collectives: the same program as split
            model = lingjax.Model(base.module, kernels=kernels, source=args.model, tp=tp, xla_ops=xla_ops,
                                  router_precision=args.router_precision, collectives_in_graphs=graphs == "whole",
                                  xla_options=options, kernel_options=kernel_opts)
            measured, census = bench_kernels(model, args, prompt, say)
            for kind, name, t, host, k in measured:
                b = bytes_decode if kind == "decode" else bytes_round
                measured_rows.append((tp, variant_name(model), name, t, host, k, b))
                say(f"tp={tp} {variant_name(model)}: {name}: {t * 1e6:.0f} µs/step, {b / 1e6:.0f} MB read per device")
            if census is not None:
                censuses[f"tp{tp} {variant_name(model)}"] = census
            del model
        del base
        gc.collect()
        jax.clear_caches()
    bw_end = read_bandwidth()
    bw = max(bw_start, bw_end)
    say(f"read bandwidth per device at the end {bw_end / 1e12:.2f} TB/s; floor = bytes one device must read in the "
        f"step / {bw / 1e12:.2f} TB/s, the larger of the two (split weights 1/tp, replicated in full)")
    say()
    say("| tp | kernels | step | µs/step | host dispatch µs/step | kernels in HLO | MB read per device | floor µs | "
        "step / floor |")
    say("|---|---|---|---|---|---|---|---|---|")
    for tp, kernels, name, t, host, k, b in measured_rows:
        floor = b / bw
        say(f"| {tp} | {kernels} | {name} | {t * 1e6:.0f} | {host * 1e6:.0f} | {k} | {b / 1e6:.0f} | "
            f"{floor * 1e6:.0f} | {t / floor:.2f} |")
    if censuses:
        say()
        say(f"GPU-time census of the spec round (device 0, {args.profile_steps} traced rounds; raw traces and HLO "
            f"in {args.profile}):")
        say()
        say(profiling.format_census(censuses))


if __name__ == "__main__":
    main()
