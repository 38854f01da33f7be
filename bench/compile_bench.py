"""Compile time of the programs a generation needs, cold and warm: trace, lower and compile each, separately.

    python bench/compile_bench.py --model flash18 --weights fp8 --spec plain nextn dspark --out compile.md
    python bench/compile_bench.py --model flash --weights fp8 --spec dspark \
        --xla-option xla_gpu_memory_limit_slop_factor=300      # full Flash's programs on an 80 GB GPU
    python bench/compile_bench.py --smoke

The weights are abstract (shapes only, on the first device), so any preset compiles on any device and nothing
runs: the figures are the host's work before a first call, the part of a first token (and of a warm-up request)
that is not the GPU's. The programs are those `lingjax generate` compiles for a prompt of --prompt-len tokens:
- plain: the prefill of one chunk and the T=1 decode step;
- nextn, dspark: the speculative prefill of a chunk (one program for every chunk), then the round (NEXTN at
  --steps drafts; DSpark: a random drafter of the released Ling draft's shape, verifying its whole block, as
  bench/step_bench.py --dspark).
Each pass is a new process; both share one persistent compilation cache, empty before the first:
- cold: an empty cache, as on a new machine (XLA compiles every program);
- warm: the cache the cold pass filled, as a second process (tracing and lowering again, then a cache read).
With --store, two more passes on a cache of their own compile each generation's programs as `lingjax generate`
does (lingjax.precompile.compile_together, the program store on): cold, the programs also stored; warm, read back
from the store (neither traced nor lowered) and the executables from the cache.
--passes picks passes by name (e.g. `--passes store`: the two store passes alone, for a same-call A/B of trees).
A program's `compile` is XLA's work (the GPU compiler, Triton for the Pallas kernels) or, warm, the cache read.

A full Flash's arguments (128 GB in fp8) exceed an 80 GB GPU's memory, and XLA's scheduler then rematerialises
(a different program, compiled differently); xla_gpu_memory_limit_slop_factor lifts its limit (a percentage of
the device's memory) to stand in for an H200's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from common import Report, add_options, heading, parser, progress, tuning_for, xla_label

SPECS = ("plain", "nextn", "dspark")
PASSES = ("one-by-one", "concurrent", "store")


def abstract_model(args):
    """A Model over abstract weights (ShapeDtypeStructs on the first device) with --kernels and the options."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from lingjax import model as model_lib
    from lingjax.config import preset
    from lingjax.execution import CompileOptions
    from lingjax.runtime import Model, RunOptions

    cfg = preset(args.model)
    fp8 = model_lib.fp8_layout(cfg) if args.weights == "fp8" else None
    module = model_lib.abstract_model(cfg, jnp.bfloat16, fp8=fp8)
    graphdef, state = nnx.split(module)
    state = typed(state, SingleDeviceSharding(jax.devices()[0]))
    options = RunOptions(kernels=args.kernels, tuning=tuning_for(args.kernel_option, cfg),
                         compile=CompileOptions(xla_options=tuple(args.xla_option)))
    return Model(nnx.merge(graphdef, state), options, source=args.model)


def typed(tree, device):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


def programs(model, spec: str, args):
    """[(name, jitted program, abstract arguments)] of one generation's first token and step, in the order a
    generation calls them."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from lingjax import engine
    from lingjax.requests import PREFILL_CHUNK
    from lingjax.sampling import SamplingParams
    from lingjax.spec.step import SpecState, spec_program

    device = SingleDeviceSharding(jax.devices()[0])
    i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=device)
    key = typed(jax.eval_shape(lambda: jax.random.key(0)), device)
    sampling = SamplingParams()
    rows = engine.prefill_bucket(min(args.prompt_len, PREFILL_CHUNK))
    tokens = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=device)
    if spec == "plain":
        capacity = engine.cache_capacity(args.prompt_len, args.new_tokens)
        cache = typed(jax.eval_shape(lambda: model.new_cache(capacity)), device)
        prefill, decode = model.step_programs(sampling)
        return [(f"prefill ({rows} rows)", prefill, (model.weights, cache, tokens, i32, i32, key)),
                ("decode T=1", decode, (model.weights, cache, i32, i32, key))]
    if spec == "dspark":
        import dspark_shapes

        from lingjax.spec.dspark import DSpark
        from lingjax.spec.dspark_model import abstract_draft

        net_cfg = dspark_shapes.ling_shaped_config(model.cfg)
        draft = DSpark(abstract_draft(net_cfg, jnp.bfloat16), source="abstract")
        draft.params = typed(draft.params, device)
        model = copy.copy(model)  # Model.with_draft, but for weights that stay abstract (with_draft places them)
        model.draft = draft
        model._set_options(model.options)
        drafter = engine.make_drafter(model, "dspark", net_cfg.block_size)
    else:
        drafter = engine.make_drafter(model, "nextn", args.steps)
    program = spec_program(model, drafter, sampling)
    capacity = engine.cache_capacity(args.prompt_len, args.new_tokens, drafter.steps + 1)
    cache = typed(jax.eval_shape(lambda: model.new_cache(capacity)), device)
    draft_state = typed(jax.eval_shape(lambda: drafter.init(model.module, capacity)), device)
    weights = (model.weights, typed(program.draft_params, device))
    state = SpecState(cache=cache, draft=draft_state, s=i32, bonus=i32, round=i32, key=key)
    last = jax.ShapeDtypeStruct((), jnp.bool_, sharding=device)
    chunk_args = (weights, cache, draft_state, tokens, i32, i32, i32, last, key)
    out = [(f"{spec} prefill chunk ({rows} rows)", program.prefill_program, chunk_args)]
    width = drafter.steps + 1
    out.append((f"{spec} round (verify {width})", program.round, (weights, state)))
    return out


def one_pass(args) -> list[dict]:
    """This process's pass: each program traced, lowered and compiled -> [{name, trace, lower, compile}]; in the
    concurrent pass, a generation's programs are traced and lowered one by one, then compiled all at once on a
    thread pool, and `compile` is the pool's wall time (the same for each of them)."""
    from concurrent.futures import ThreadPoolExecutor

    from lingjax import compilation_cache

    compilation_cache.enable(args.cache_dir)
    model = abstract_model(args)
    if args.pass_name.endswith("store"):
        return store_pass(model, args)
    rows = []
    for spec in args.spec:
        lowered = []
        for name, fn, fargs in programs(model, spec, args):
            t0 = time.perf_counter()
            traced = fn.trace(*fargs)
            t1 = time.perf_counter()
            lowered.append(traced.lower())
            t2 = time.perf_counter()
            rows.append(dict(name=name, trace=t1 - t0, lower=t2 - t1))
            if not args.pass_name.endswith("concurrent"):
                lowered.pop().compile()
                rows[-1]["compile"] = time.perf_counter() - t2
                progress(f"{args.pass_name}: {name}: trace {t1 - t0:.1f} s, lower {t2 - t1:.1f} s, "
                         f"compile {rows[-1]['compile']:.1f} s")
        if lowered:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(lowered)) as pool:
                list(pool.map(lambda low: low.compile(), lowered))
            for row in rows[-len(lowered):]:
                row["compile"] = time.perf_counter() - t0
            progress(f"{args.pass_name}: {spec}'s {len(lowered)} programs compiled together in "
                     f"{time.perf_counter() - t0:.1f} s")
    return rows


def store_pass(model, args) -> list[dict]:
    """A --store pass: each generation's programs compiled as `lingjax generate` compiles them (together, through
    the program store) -> [{name, seconds, stored}], stored: the files in the store after it."""
    from lingjax import program_store
    from lingjax.precompile import Job, compile_together

    rows = []
    for spec in args.spec:
        jobs = [Job(name, fn, fargs) for name, fn, fargs in programs(model, spec, args)]
        t0 = time.perf_counter()
        compile_together(set(), jobs)
        seconds = time.perf_counter() - t0
        stored = len(list(program_store.directory().glob("*.jaxexport"))) if program_store.directory() else 0
        rows.append(dict(name=spec, seconds=seconds, stored=stored))
        progress(f"{args.pass_name}: {spec}'s {len(jobs)} programs in {seconds:.1f} s ({stored} stored)")
    return rows


def run_pass(name: str, cache_dir: str, argv: list[str]) -> tuple[list[dict], float]:
    """One pass in a new process -> (its rows, the process's wall seconds)."""
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "LINGJAX_NO_CACHE"}  # the pass keeps its own cache, as asked
    proc = subprocess.run([sys.executable, __file__, *argv, "--pass-name", name, "--cache-dir", cache_dir],
                          stdout=subprocess.PIPE, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"compile_bench: the {name} pass failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def main() -> None:
    p = parser(__doc__)
    add_options(p, "model", "kernels", "xla_option", "kernel_option", "weights", "smoke", "out")
    p.add_argument("--spec", nargs="+", default=list(SPECS), choices=SPECS, help="the generations' programs")
    p.add_argument("--steps", type=int, default=3, help="NEXTN drafts a round")
    p.add_argument("--prompt-len", type=int, default=8192, help="prompt tokens (chunks of 2048 rows)")
    p.add_argument("--new-tokens", type=int, default=1024, help="tokens generated (the cache's capacity)")
    p.add_argument("--concurrent", action="store_true",
                   help="also a cold pass that compiles each generation's programs at once, on a thread pool")
    p.add_argument("--store", action="store_true",
                   help="also a cold and a warm pass compiling as lingjax generate does, through the program store")
    p.add_argument("--passes", nargs="+", default=None, choices=PASSES,
                   help="the passes to run, of one-by-one (cold and warm), concurrent and store (cold and warm); "
                        "default one-by-one, plus those --concurrent and --store ask for")
    p.add_argument("--pass-name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.model, args.prompt_len, args.new_tokens, args.kernels = "tiny", 100, 16, "xla"
        args.spec, args.concurrent, args.store = ["nextn"], True, True
    if args.passes is None:
        args.passes = ["one-by-one"] + ["concurrent"] * args.concurrent + ["store"] * args.store
    one_by_one, args.concurrent, args.store = (name in args.passes for name in PASSES)
    if args.pass_name is not None:  # a child: one pass, its rows as the last line of stdout
        rows = one_pass(args)
        print(json.dumps(rows))
        return
    argv = [a for a in sys.argv[1:] if a != "--smoke"]
    argv += ["--model", args.model, "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
             "--kernels", args.kernels, "--spec", *args.spec]
    say = Report(args.out)
    common.CACHE_NOTE = "compilation cache: a fresh directory per cold pass (below)"
    heading(say, f"Compile time of {args.model}'s programs ({args.weights} weights), cold and warm")
    say(f"kernels {args.kernels}{xla_label(args.xla_option)}; prompt {args.prompt_len} tokens, {args.new_tokens} "
        f"new; each pass a new process, one persistent compilation cache between them (empty before the cold pass)")
    passes = {}
    if one_by_one:
        with tempfile.TemporaryDirectory(prefix="lingjax-compile-bench-") as cache_dir:
            passes = {name: run_pass(name, cache_dir, argv) for name in ("cold", "warm")}
            entries = sum(1 for _ in Path(cache_dir).rglob("*") if _.is_file())
    if args.concurrent:
        with tempfile.TemporaryDirectory(prefix="lingjax-compile-bench-") as cache_dir:
            passes["cold, concurrent"] = run_pass("cold, concurrent", cache_dir, argv)
    if args.store:
        with tempfile.TemporaryDirectory(prefix="lingjax-compile-bench-") as cache_dir:
            stored = {name: run_pass(name, cache_dir, argv) for name in ("cold, store", "warm, store")}
    if one_by_one:
        say.table("program", "cold: trace s", "lower s", "compile s", "total s", "warm: trace s", "lower s",
                  "cache read s", "total s")
        for c, w in zip(passes["cold"][0], passes["warm"][0], strict=True):
            say.row(c["name"], *(f"{c[k]:.2f}" for k in ("trace", "lower", "compile")),
                    f"{c['trace'] + c['lower'] + c['compile']:.1f}",
                    *(f"{w[k]:.2f}" for k in ("trace", "lower", "compile")),
                    f"{w['trace'] + w['lower'] + w['compile']:.1f}")
    for name, (rows, wall) in passes.items():
        say(f"- {name}: the programs {programs_seconds(rows, name):.1f} s, the process {wall:.1f} s (imports and "
            "the abstract model included)")
    if one_by_one:
        say(f"- the cache held {entries} files after both passes")
    if args.concurrent:
        rows, wall = passes["cold, concurrent"]
        say()
        cold = passes["cold"][0] if one_by_one else None
        say.table("generation", "cold, one by one: trace + lower s", "compile s", "cold, concurrent: trace + lower s",
                  "compile (together) s", "one by one / concurrent")
        for spec in args.spec:
            con = [r for r in rows if spec_of(r["name"]) == spec]
            par = sum(r["trace"] + r["lower"] for r in con) + con[0]["compile"]
            mine = (f"{sum(r['trace'] + r['lower'] for r in con):.1f}", f"{con[0]['compile']:.1f}")
            if cold is None:  # no one-by-one pass to compare with
                say.row(spec, "-", "-", *mine, "-")
                continue
            one = [r for r in cold if spec_of(r["name"]) == spec]
            seq = sum(r["trace"] + r["lower"] + r["compile"] for r in one)
            say.row(spec, f"{sum(r['trace'] + r['lower'] for r in one):.1f}", f"{sum(r['compile'] for r in one):.1f}",
                    *mine, f"{seq / par:.2f}")
        say(f"- concurrent pass: the process {wall:.1f} s")
    if args.store:
        (cold_rows, cold_wall), (warm_rows, warm_wall) = stored["cold, store"], stored["warm, store"]
        say()
        say("As `lingjax generate` compiles them (lingjax.precompile.compile_together; the program store on), "
            "each pass a new process on a cache of its own:")
        say.table("generation", "cold s", "warm s (read back)", "programs stored")
        for c, w in zip(cold_rows, warm_rows, strict=True):
            say.row(c["name"], f"{c['seconds']:.1f}", f"{w['seconds']:.1f}", str(w["stored"]))
        say(f"- the processes: cold {cold_wall:.1f} s, warm {warm_wall:.1f} s (imports and the abstract model "
            "included)")


def programs_seconds(rows: list[dict], pass_name: str) -> float:
    """The wall seconds of a pass's programs: a concurrent pass counts each generation's pool once."""
    if not pass_name.endswith("concurrent"):
        return sum(r["trace"] + r["lower"] + r["compile"] for r in rows)
    pools = {spec_of(r["name"]): r["compile"] for r in rows}
    return sum(r["trace"] + r["lower"] for r in rows) + sum(pools.values())


def spec_of(name: str) -> str:
    first = name.split()[0]
    return first if first in SPECS else "plain"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
