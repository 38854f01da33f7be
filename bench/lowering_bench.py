"""Lowering seconds of the step programs for an H200, on any machine (no GPU): with lingjax.pallas.dialect_lookup
against without it, each pass a new process, alternating.

    python bench/lowering_bench.py --model flash18 --rounds 3 --out lowering.md

A warm process (its programs in the persistent cache) still traces and lowers every program before the cache can
answer, so lowering is part of a warm start's first token. The programs: the NEXTN round (S = 3), a prefill
chunk (2048 rows) and the decode step, over abstract weights in fp8 with the Pallas kernels, lowered for "cuda"
(Pallas's Triton lowering runs on the host; nothing compiles). Each pass also counts the imports MLIR's bindings
search sys.path for the Triton dialect's Python module (".tt"), and hashes each program's lowered text: the two
variants must lower the same text.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.abc
import json
import statistics
import subprocess
import sys
import time

import common
from common import Report, heading, parser


def one_pass(model_name: str, variant: str) -> dict:
    """This process's pass: {program: [lower seconds, text hash]}, and the ".tt" module searches."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import gpu_info

    import lingjax.pallas  # noqa: F401  (installs the alias)
    from lingjax import engine, target
    from lingjax import model as model_lib
    from lingjax.config import preset
    from lingjax.pallas.dialect_lookup import ALIAS
    from lingjax.runtime import Model, RunOptions
    from lingjax.sampling import SamplingParams
    from lingjax.spec.step import SpecState, spec_program

    if variant == "without":
        sys.modules.pop(ALIAS)
    searched = []

    class Probe(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            searched.append(name)

    gpu_info.get_gpu_info = lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    cfg = preset(model_name)
    out = {}
    with target.compile_for("gpu", jax.devices()[:1]):
        model = Model(model_lib.abstract_model(cfg, jnp.bfloat16, fp8=model_lib.fp8_layout(cfg)),
                      RunOptions(kernels="pallas"))
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        key = jax.eval_shape(lambda: jax.random.key(0))
        cache = jax.eval_shape(lambda: model.new_cache(16384))
        drafter = engine.make_drafter(model, "nextn", 3)
        draft = jax.eval_shape(lambda: drafter.init(model.module, 16384))
        program = spec_program(model, drafter, SamplingParams())
        _, decode = model.step_programs(SamplingParams())
        state = SpecState(cache=cache, draft=draft, s=i32, bonus=i32, round=i32, key=key)
        chunk = jax.ShapeDtypeStruct((2048,), jnp.int32)
        programs = [("NEXTN round (S = 3)", program.round_program, (program.weights, state)),
                    ("prefill chunk (2048 rows)", program.prefill_program,
                     (program.weights, cache, draft, chunk, i32, i32, i32, jax.ShapeDtypeStruct((), jnp.bool_), key)),
                    ("decode step", decode, (model.weights, cache, i32, i32, key))]
        sys.meta_path.insert(0, Probe())
        for name, fn, args in programs:
            traced = fn.trace(*args)
            t0 = time.perf_counter()
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            out[name] = [time.perf_counter() - t0, hashlib.sha256(text.encode()).hexdigest()[:16]]
    return {"programs": out, "searches": sum(name.endswith(".tt") for name in searched)}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", default="flash18")
    p.add_argument("--rounds", type=int, default=3, help="pairs of passes (without, with), alternating")
    p.add_argument("--out", default=None)
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_pass(*args.child)))
        return
    say = Report(args.out)
    common.CACHE_NOTE = "nothing is compiled: lowering only, no compilation cache involved"
    heading(say, f"Lowering seconds of {args.model}'s step programs for an H200, with and without the dialect alias")
    passes = {"without": [], "with": []}
    for _ in range(args.rounds):
        for variant in passes:
            run = subprocess.run([sys.executable, __file__, "--child", args.model, variant], stdout=subprocess.PIPE,
                                 text=True, check=True)
            passes[variant].append(json.loads(run.stdout.strip().splitlines()[-1]))
    names = list(passes["with"][0]["programs"])
    say.table("program", "without: lower s (median)", "with: lower s (median)", "with / without", "same text")
    for name in names:
        t = {v: statistics.median(r["programs"][name][0] for r in runs) for v, runs in passes.items()}
        hashes = {r["programs"][name][1] for runs in passes.values() for r in runs}
        say.row(name, f"{t['without']:.2f}", f"{t['with']:.2f}", f"{t['with'] / t['without']:.2f}",
                "yes" if len(hashes) == 1 else "DIFFER")
    total = {v: statistics.median(sum(x[0] for x in r["programs"].values()) for r in runs)
             for v, runs in passes.items()}
    say.row("all three", f"{total['without']:.2f}", f"{total['with']:.2f}", f"{total['with'] / total['without']:.2f}",
            "")
    say(f"- imports searched for the Triton dialect's module a pass: without {passes['without'][0]['searches']}, "
        f"with {passes['with'][0]['searches']}; {args.rounds} passes each, alternating, medians")


if __name__ == "__main__":
    main()
