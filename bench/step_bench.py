"""Steady-state step time against its byte floor, per tensor-parallel size and kernel set.

    python bench/step_bench.py --model mid --tp 1 --kernels xla pallas --out step_mid.md
    python bench/step_bench.py --model flash --tp 2 4 --kernels pallas --router-precision bf16 --profile prof/
    python bench/step_bench.py --model flash --tp 2 --kernels pallas --graphs split whole
    python bench/step_bench.py --model flash --tp 2 --kernels pallas --rounds-per-call 1 4
    python bench/step_bench.py --model flash --tp 2 --kernels pallas --kernel-option kda_chain:block_v=16
    python bench/step_bench.py --model mid --kernels pallas --weights dense fp8   # bf16 against fp8 weights
    python bench/step_bench.py --smoke        # the tiny preset, xla kernels, a small probe, few steps: a CPU check
    python bench/step_bench.py --model mid --kernels pallas --baseline df9e41e   # the regression guard

For each TP size (random weights made shard by shard on the devices, the same weights at every size), kernel
set and graph mode (--graphs whole puts the all-reduces inside the CUDA graphs: lingjax.execution.CompileOptions):
the plain T=1 decode step and the speculative round (S drafts, verify width S+1), each timed as N steps
dispatched back to back with one block at the end (median of 5 such batches; random weights, so the MTP drafts
fail and every round commits one token). --rounds-per-call R runs R rounds (or decode steps) in each device call
(a lax.scan) and reports per-round figures.

A/B in one process: --xla-ops (ops on their XLA references), --xla-option (XLA debug options) and
--kernel-option (fields of the ops' Pallas tuning) each add the pallas variants again, so changed (Model.variant:
the same weights, programs of their own); --xla-ops with --xla-option adds one more, with both, last.

Printed with:
- kernels: the step program's launches counted in its optimised HLO (fusions, custom calls, library calls,
  collectives and copies outside fusion bodies; a loop body counts once, so a lower bound), with how many of them
  XLA's rematerialization duplicated ("(M remat)");
- bytes: what one device must read in the step (docs/measuring.md): lm_head, attention and dense weights, router,
  shared expert, the distinct routed experts the routers chose (captured from the model's own forward through
  Exec.tap), KDA state traffic, MLA latent cache, MTP draft weights; split weights count 1/tp, replicated ones in
  full;
- floor: bytes / bandwidth, the read probe measured at the run's start and end, the larger taken;
- host dispatch: the host's time to enqueue a step, back to back (≈ the step time when either side sets the pace:
  a full launch queue holds the host back);
- idle host / call: the host's own time to dispatch one call onto an idle device (lingjax.steady.dispatch_seconds),
  against the call's device time: what the host costs a step once nothing waits in a queue.
--profile DIR traces --profile-steps spec rounds per configuration and prints the GPU-time census of
lingjax.profiling side by side, calibrated against the unprofiled round; the raw traces and the round's optimised
HLO land flat in DIR.
"""

from __future__ import annotations

import dataclasses
import gc
import gzip
import statistics
import sys
import time
from pathlib import Path

import dspark_shapes
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import lingjax
from common import (
    FP8_MATRIX_BYTES,
    Report,
    add_options,
    heading,
    launch_summary,
    layer_bytes,
    parser,
    progress,
    read_bandwidth,
    tuning_for,
    tuning_label,
    xla_label,
)
from lingjax import engine, profiling, steady
from lingjax.config import MOE
from lingjax.execution import CompileOptions
from lingjax.sampling import SamplingParams


def step_bytes(model, distinct_per_layer, width: int, draft_forwards: int, ctx: int) -> float:
    """Bytes one device reads in one step at batch 1 (module docstring): the layers at verify width `width`, then
    `draft_forwards` MTP forwards (eh_proj, an MLA/MoE block reading k experts, lm_head). With fp8 weights the
    quantized matrices count one byte per element plus their scales (common.FP8_MATRIX_BYTES)."""
    cfg, item, tp = model.cfg, jnp.dtype(model.dtype).itemsize, model.tp
    matrix = FP8_MATRIX_BYTES if model.fp8 else item
    d = cfg.hidden_size
    lm_head = cfg.vocab_size * d * item / tp  # read once for all rows
    total = lm_head + sum(layer_bytes(cfg, attn, mlp, distinct_per_layer[i], width, ctx, item, tp, matrix)
                          for i, (attn, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_types)))
    mtp = (2 * d * d * matrix + layer_bytes(cfg, "mla", MOE, cfg.num_experts_per_tok, 1, ctx, item, tp, matrix)
           + lm_head)
    return total + draft_forwards * mtp


def distinct_experts(model, prompt, window) -> list[int]:
    """Per layer, how many distinct experts the routers chose for `window` (a verify-shaped forward after the
    prompt), from the model's own forward: each MoE layer shows its real rows' experts to Exec.tap ("moe_route");
    dense layers: 0."""

    def run(weights, cache, tokens, start):
        chosen = []
        def tap(event, value):
            if event == "moe_route":
                chosen.append(value)

        ex = dataclasses.replace(model.ex, tap=tap)
        model._module(weights).forward(tokens, cache, start, tokens.shape[0], ex)
        return chosen

    n_moe = sum(kind == MOE for kind in model.cfg.mlp_types)
    run = model.sharded(run, (model.weight_specs, model.cache_specs, P(), P()), [P()] * n_moe)
    _, cache = engine.plain_prefill(model, prompt, window.size, SamplingParams(), jax.random.key(0))
    chosen = iter(jax.jit(run)(model.weights, cache, jnp.asarray(window), jnp.int32(prompt.size)))
    return [len(np.unique(np.asarray(next(chosen)))) if kind == MOE else 0 for kind in model.cfg.mlp_types]


def variant_name(model) -> str:
    """The kernel set, its ops on XLA, "+graph-ar" with the all-reduces in the graphs, and the changed options."""
    opts = model.options
    xla_ops = f" (xla: {','.join(opts.xla_ops)})" if opts.xla_ops else ""
    return (opts.kernels + xla_ops + ("+graph-ar" if opts.compile.collectives_in_graphs else "")
            + xla_label(opts.compile.xla_options) + tuning_label(opts.tuning, model.cfg, model.tp))


def time_steps(fn, n: int) -> tuple[float, float]:
    """fn(n) dispatches n steps and returns (start time, last output) -> medians over 5 batches of (seconds per
    step, seconds per step the host took to dispatch)."""
    times, dispatch = [], []
    for _ in range(5):
        t, done = fn(n)
        dispatch.append((time.perf_counter() - t) / n)
        jax.block_until_ready(done)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times), statistics.median(dispatch)


def time_program(what: str, per_call: int, n: int, program):
    """Compile, then time about n steps of a lingjax.steady program that runs per_call steps a call, then count the
    kernels of its compiled HLO (at the timed calls' shapes, so the compilation cache serves it).
    -> (s/step, host s/step, kernels, HLO text, launch maker (Steady.launcher), s/call, host s/call onto an idle
    device)."""
    calls = max(1, n // per_call)
    began = time.perf_counter()
    program.launcher(2)()
    compiled = time.perf_counter()
    t_call, h_call = time_steps(lambda k: program.launcher(k)(), calls)
    idle = steady.dispatch_seconds(program)
    progress(f"{what} compiled in {compiled - began:.0f} s, timed in {time.perf_counter() - compiled:.0f} s")
    hlo = program.lower(program.prepare(calls))
    return (t_call / per_call, h_call / per_call, launch_summary(hlo), hlo, program.launcher, t_call, idle)


def time_decode(model, args, prompt, steps: int):
    """The T=1 decode program at `steps` per call -> time_program's result."""
    program = steady.steady_program(model, "decode", prompt, per_call=steps)
    name = "decode T=1" + (f", {steps} per call" if steps > 1 else "")
    return name, time_program(f"tp={model.tp} {variant_name(model)}: {name}", steps, args.n, program)


def time_round(model, args, prompt, rounds: int, spec: str = "nextn"):
    """The speculative round program at `rounds` per call -> time_program's result."""
    program = steady.steady_program(model, spec, prompt, args.steps if spec == "nextn" else None, per_call=rounds)
    name = (f"spec round S={program.drafts}" if spec == "nextn" else f"DSpark round S={program.drafts}") + (
        f", {rounds} per call" if rounds > 1 else "")
    return name, time_program(f"tp={model.tp} {variant_name(model)}: {name}", rounds, args.n, program)


def bench_model(model, args, prompt, say, measured):
    """Decode-step and speculative-round timings of one model variant, per --rounds-per-call and --programs, each
    handed to measured(kind, name, s/step, host s/step, kernels, idle host / call time) as soon as it is timed (a
    run cut short keeps them) -> the censuses of the traced rounds by round kind."""
    censuses = {}
    if "decode" in args.programs:
        for steps in args.rounds_per_call:
            name, (step_s, host_s, kernels, *_, t_call, idle) = time_decode(model, args, prompt, steps)
            measured("decode", name, step_s, host_s, kernels, idle / t_call)
    specs = [p for p in ("nextn", "dspark") if p in args.programs and (p == "nextn" or model.draft is not None)]
    for rounds in args.rounds_per_call:
        for spec in specs:
            name, (step_s, host_s, kernels, hlo, launches, t_call, idle) = time_round(model, args, prompt, rounds,
                                                                                     spec)
            measured("round" if spec == "nextn" else spec, name, step_s, host_s, kernels, idle / t_call)
            if args.profile and rounds == args.rounds_per_call[0]:  # only the first variant's calls are traced
                census = profile_rounds(model, args, launches, hlo, rounds, t_call, say, spec)
                if census is not None:
                    censuses[spec] = census
    return censuses


def profile_rounds(model, args, launches, round_hlo, rounds, t_call, say, spec: str = "nextn"):
    """Trace --profile-steps calls, save the trace and HLO in --profile -> the GPU-time census per round or None."""
    tag = (f"{Path(args.model).name}_tp{model.tp}_{variant_name(model).replace('+', '_').replace(' ', '_')}"
           f"{'_dspark' if spec == 'dspark' else ''}")
    if rounds > 1 and model.tp == 1:
        say(f"warning: tracing {rounds} rounds per call on one GPU: the loop is one CUDA graph and the profiler "
            "misses most kernels inside it (census 'idle' then means unseen); list --rounds-per-call 1 first")
    with gzip.open(Path(args.profile) / f"{tag}.round_hlo.txt.gz", "wt") as f:
        f.write(round_hlo)
    try:
        return profiling.trace_census(launches(args.profile_steps), round_hlo, args.profile_steps * rounds,
                                      t_call / rounds, keep=Path(args.profile) / f"{tag}.trace.json.gz")
    except ValueError as e:  # the raw trace and HLO are saved: the census can be redone offline
        say(f"census of {tag} failed: {e}")
        return None


def variants(base, args):
    """The models to time over base's weights: each kernel set and graph mode, then the pallas ones again with
    --xla-ops, with --xla-option and with --kernel-option."""
    plain = [(k, g) for k in args.kernels for g in args.graphs if not (g == "whole" and base.tp == 1)]
    pallas = [(k, g) for k, g in plain if k == "pallas"]
    tuning = tuning_for(args.kernel_option, base.cfg, base.tp)
    changes = [dict()]
    changes += [dict(xla_ops=tuple(args.xla_ops))] if args.xla_ops else []
    changes += [dict(tuning=tuning)] if tuning else []
    # the --xla-option variants last: XLA's autotuning, when an option turns it on, must not serve the others
    if args.xla_ops and args.xla_option:
        changes.append(dict(xla_ops=tuple(args.xla_ops), xla_options=tuple(args.xla_option)))
    changes += [dict(xla_options=tuple(args.xla_option))] if args.xla_option else []
    for i, change in enumerate(changes):
        for kernels, graphs in plain if i == 0 else pallas:
            compile_options = CompileOptions(collectives_in_graphs=graphs == "whole",
                                             xla_options=change.get("xla_options", ()))
            yield base.variant(kernels=kernels, xla_ops=change.get("xla_ops", ()), tuning=change.get("tuning", {}),
                               compile=compile_options)


def memory_line(model, capacity: int) -> str:
    """Device 0's memory with the weights and a cache of `capacity` positions held (the serving bench's prompt plus
    its new tokens), the cache then freed."""
    stats = jax.devices()[0].memory_stats() or {}
    cache = model.new_cache(capacity)
    jax.block_until_ready(cache)
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache)) / model.tp
    after = jax.devices()[0].memory_stats() or {}
    del cache
    limit, used = after.get("bytes_limit", 0), after.get("bytes_in_use", 0)
    return (f"memory on device 0: {stats.get('bytes_in_use', 0) / 1e9:.1f} GB in use after loading; a cache for "
            f"{capacity} positions {cache_bytes / 1e9:.2f} GB; in use then {used / 1e9:.1f} GB of the allocator's "
            f"{limit / 1e9:.1f} GB: {(limit - used) / 1e9:.1f} GB left for workspace")


def bench_tp(tp: int, weights: str, args, say) -> tuple[list, dict]:
    """Every variant at one TP size and weight format -> (table rows (tp, weights, variant, step, s/step, host
    s/step, kernels, bytes), censuses by variant)."""
    t0 = time.perf_counter()
    base = lingjax.load(args.model, dtype="bfloat16", tp=tp, router_precision=args.router_precision, weights=weights)
    jax.block_until_ready(base.weights)
    held = sum(w.nbytes for w in base.weights) / tp
    say(f"tp={tp} {weights}: {base.num_params() / 1e9:.2f} B params made on device in {time.perf_counter() - t0:.1f} s "
        f"({held / 1e9:.1f} GB per device, {len(base.weights)} weight arrays: every step program's arguments)")
    if args.capacity:
        say(memory_line(base, args.capacity))
    prompt = np.random.default_rng(0).integers(0, base.cfg.vocab_size, args.prompt_len).astype(np.int32)
    width = args.steps + 1
    window = np.random.default_rng(1).integers(0, base.cfg.vocab_size, width).astype(np.int32)
    progress(f"tp={tp}: measuring the routers' choices")
    distinct_w = distinct_experts(base, prompt, window)
    distinct_1 = [base.cfg.num_experts_per_tok if d else 0 for d in distinct_w]  # one token: k distinct
    say(f"tp={tp}: distinct routed experts per MoE layer: T=1 mean {np.mean([d for d in distinct_1 if d]):.1f}, "
        f"T={width} mean {np.mean([d for d in distinct_w if d]):.1f}")
    bytes_of = {"decode": step_bytes(base, distinct_1, 1, 0, args.prompt_len),
                # a round: S-1 MTP draft forwards + the verify (width S+1) + the draft-extend (one MTP forward)
                "round": step_bytes(base, distinct_w, width, args.steps, args.prompt_len)}
    if args.dspark:  # a random drafter of the released Ling draft's shape, verifying its whole block
        from lingjax.spec import dspark

        base = base.with_draft(
            dspark.random_dspark(dspark_shapes.ling_shaped_config(base.cfg, markov_topk=args.markov_topk), "bfloat16")
        )
    if base.draft is not None:  # --dspark's, or a checkpoint's own (the shipped model's)
        from lingjax.spec import dspark

        if args.markov_topk:
            base = base.with_draft(base.draft.with_markov_topk(args.markov_topk))
        draft_cfg = base.draft.cfg
        block = draft_cfg.block_size
        window = np.random.default_rng(2).integers(0, base.cfg.vocab_size, block + 1).astype(np.int32)
        distinct_d = distinct_experts(base, prompt, window)
        item = jnp.dtype(base.dtype).itemsize
        # the verify of block + 1 rows, the propose (its network, the context cache, the Markov rows) and the
        # lm_head once more for the block's rows
        bytes_of["dspark"] = (step_bytes(base, distinct_d, block + 1, 0, args.prompt_len)
                              + dspark_shapes.propose_bytes(draft_cfg, args.prompt_len, item)
                              + base.cfg.vocab_size * base.cfg.hidden_size * item / tp)
        say(f"tp={tp}: DSpark drafter ({base.draft.source}): {base.draft.num_params() / 1e9:.3f} B params, "
            f"block {block}, markov_topk {draft_cfg.markov_topk}; distinct routed experts per MoE layer at "
            f"T={block + 1}: mean {np.mean([d for d in distinct_d if d]):.1f}")
    rows, censuses = [], {}
    for model in variants(base, args):
        def measured(kind, name, t, host, k, idle_share, model=model):
            rows.append((tp, weights, variant_name(model), name, t, host, idle_share, k, bytes_of[kind]))
            say(f"tp={tp} {variant_name(model)}: {name}: {t * 1e6:.0f} µs/step, host dispatch {host * 1e6:.0f} "
                f"µs/step (idle device: {idle_share:.0%} of the call), {k} kernels, {bytes_of[kind] / 1e6:.0f} MB "
                f"read per device, floor at the start's "
                f"bandwidth {bytes_of[kind] / args.bandwidth * 1e6:.0f} µs")

        model_censuses = bench_model(model, args, prompt, say, measured)
        for spec, census in model_censuses.items():
            censuses[f"tp{tp} {weights} {variant_name(model)}{' DSpark' if spec == 'dspark' else ''}"] = census
        del model
    del base
    gc.collect()
    jax.clear_caches()
    return rows, censuses


def report_table(rows, bw: float, say) -> None:
    say()
    say.table("tp", "weights", "kernels", "step", "µs/step", "host dispatch µs/step", "idle host / call",
              "kernels in HLO", "MB read per device", "floor µs", "step / floor")
    for tp, weights, kernels, name, t, host, idle_share, k, b in rows:
        floor = b / bw
        say.row(
            tp,
            weights,
            kernels,
            name,
            f"{t * 1e6:.0f}",
            f"{host * 1e6:.0f}",
            f"{idle_share:.0%}",
            k,
            f"{b / 1e6:.0f}",
            f"{floor * 1e6:.0f}",
            f"{t / floor:.2f}",
        )


def parse_args(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "tp", "kernels", "router_precision", "weights", "xla_option", "kernel_option", "smoke",
                "out", many=("tp", "kernels", "weights"), kernels=None)
    ap.add_argument("--steps", type=int, default=3, help="NEXTN drafts per round (verify width S+1)")
    ap.add_argument("--graphs", nargs="+", default=["split"], choices=["split", "whole"],
                    help="split: all-reduces outside the CUDA graphs (default); whole: inside")
    ap.add_argument("--rounds-per-call", type=int, nargs="+", default=[1],
                    help="speculative rounds (and decode steps) per device call (a lax.scan); per-round figures")
    ap.add_argument("--xla-ops", nargs="*", default=[],
                    help="also time each pallas variant with these ops (lingjax.kernels.OPS) on their XLA reference")
    ap.add_argument("--dspark", action="store_true",
                    help="also time a DSpark round: a random drafter of the released Ling draft's shape verifying its "
                         "block of 8 (a checkpoint with a drafter of its own, the shipped model's, times that one)")
    ap.add_argument(
        "--markov-topk",
        type=int,
        default=0,
        help="the DSpark round's Markov head over the base logits' top k only (0: the drafter's own setting)",
    )
    ap.add_argument(
        "--programs",
        nargs="+",
        choices=("decode", "nextn", "dspark"),
        default=["decode", "nextn", "dspark"],
        help="which programs to time (dspark: when the model has a drafter)",
    )
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--capacity", type=int, default=0,
                    help="also report device memory with a cache of this many positions held (e.g. 9216: 8192 + 1024)")
    ap.add_argument("--n", type=int, default=32, help="steps per timed batch")
    ap.add_argument("--profile", default=None,
                    help="directory: trace the spec round and print a GPU-time census (of the first --rounds-per-call "
                         "value: list 1 first, since at R > 1 on one GPU the whole call is one CUDA graph and the "
                         "profiler misses most of its kernels)")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--baseline", default=None, metavar="REV|DIR",
                    help="the regression guard (bench/baseline.py): time this command on the working tree and on REV "
                         "(a git revision, or a directory holding a tree), in fresh processes, interleaved")
    ap.add_argument("--baseline-rounds", type=int, default=1, help="with --baseline: pairs of processes")
    args = ap.parse_args(argv)
    if args.kernels is None:  # --smoke: one kernel set (the script's path is the same for each; the Pallas kernels in
        # interpret mode, the CPU's, would triple its time), unless --kernels names them
        args.kernels = ["xla"] if args.smoke else ["xla", "pallas"]
    if args.smoke:
        args.model, args.prompt_len, args.n, args.steps = "tiny", 24, 2, 2
    return args


def without(argv: list[str], *options: str) -> list[str]:
    """argv without each of `options` and the value after it."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=")[0] in options:
            skip = "=" not in arg
        else:
            out.append(arg)
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.baseline:
        import baseline

        say = Report(args.out)
        heading(say, f"step_bench against {args.baseline}: {args.model}, weights {' '.join(args.weights)}, "
                     f"S={args.steps}")
        given = list(sys.argv[1:] if argv is None else argv)
        baseline.compare("bench/step_bench.py", without(given, "--baseline", "--baseline-rounds", "--out"),
                         args.baseline, args.baseline_rounds, say)
        return
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    probe = (lambda: read_bandwidth(1 << 20, warm=1, reps=3)) if args.smoke else read_bandwidth
    say = Report(args.out)
    bw_start = probe()
    heading(say, f"step_bench: {args.model}, bf16 activations, weights {' '.join(args.weights)}, S={args.steps}, "
                 f"router {args.router_precision}, tp {args.tp}")
    say(f"read bandwidth per device at the start {bw_start / 1e12:.2f} TB/s")
    args.bandwidth = bw_start
    rows, censuses = [], {}
    for tp in args.tp:
        for weights in args.weights:
            tp_rows, tp_censuses = bench_tp(tp, weights, args, say)
            rows += tp_rows
            censuses.update(tp_censuses)
    bw_end = probe()
    bw = max(bw_start, bw_end)
    say(f"read bandwidth per device at the end {bw_end / 1e12:.2f} TB/s; floor = bytes one device must read in the "
        f"step / {bw / 1e12:.2f} TB/s, the larger of the two (split weights 1/tp, replicated in full)")
    report_table(rows, bw, say)
    if censuses:
        say()
        say(
            f"GPU-time census of the speculative rounds (device 0, {args.profile_steps} traced rounds; raw traces and "
            f"HLO in {args.profile}):"
        )
        say()
        say(profiling.format_census(censuses))


if __name__ == "__main__":
    main()
