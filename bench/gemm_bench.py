"""Prefill projections at M rows: lingjax.pallas.gemm against XLA's GEMM (an fp8 weight dequantized in the graph)
compiled as the step programs are (autotuning off) and with autotuning on, per shape of Flash, over tunings.

    python bench/gemm_bench.py [--rows 2048]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from lingjax.execution import step_compiler_options
from lingjax.ops.fp8 import quantize_on_device
from lingjax.ops.linear import linear
from lingjax.pallas.gemm import GemmTuning, gemm, plan

BF16, F32 = jnp.bfloat16, jnp.float32

SHAPES = [  # label, N, K, fp8
    ("kda in_proj fp8", 5 * 4096, 2560, True),
    ("kda o_proj fp8", 2560, 4096, True),
    ("dense gate fp8", 6144, 2560, True),
    ("dense down fp8", 2560, 6144, True),
    ("kda in_proj bf16", 5 * 4096, 2560, False),
    ("lm_head bf16", 157184, 2560, False),
]

TUNINGS = [
    GemmTuning(),
    GemmTuning(swap=True),
    GemmTuning(swap=True, warps=4, stages=4),
    GemmTuning(swap=True, bm=256, stages=3),
    GemmTuning(bk=256),
]


def seconds(fn, *args, reps=20):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / reps)
    return min(times)


def compiled(f, args, options):
    return jax.jit(f).lower(*args).compile(compiler_options=options)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--only", default="")
    p.add_argument("--no-xla-off", action="store_true", help="skip XLA with autotuning off (slow to time)")
    a = p.parse_args()
    off = step_compiler_options()
    on = {**off, "xla_gpu_autotune_level": 4}
    key = jax.random.key(0)
    for label, n, k, fp8 in SHAPES:
        if a.only and a.only not in label:
            continue
        kx, kw = jax.random.split(jax.random.fold_in(key, n * k))
        x = jax.random.normal(kx, (a.rows, k), F32).astype(BF16)
        w = jax.random.normal(kw, (n, k), F32) * k**-0.5
        w = quantize_on_device(w, (128, 128)) if fp8 else w.astype(BF16)
        flop = 2 * a.rows * n * k
        exact = jnp.einsum("mk,nk->mn", x.astype(F32), (w.dequantize(F32) if fp8 else w.astype(F32)),
                           precision="highest")
        rows = []
        for name, opts in (("xla autotune off", off), ("xla autotune on", on))[1 if a.no_xla_off else 0:]:
            fn = compiled(lambda x, w: linear(x, w), (x, w), opts)
            rows.append((name, seconds(fn, x, w), fn(x, w)))
        for t in TUNINGS:
            try:
                fn = compiled(lambda x, w, t=t: gemm(x, w, tuning=t), (x, w), off)
                rows.append((f"gemm {t} {plan(x, w, t)}", seconds(fn, x, w), fn(x, w)))
            except Exception as e:  # noqa: BLE001
                rows.append((f"gemm {t} FAILED {type(e).__name__}: {str(e)[:200]}", float("nan"), None))
        print(f"## {label} [{n}, {k}] M={a.rows}", flush=True)
        for name, s, y in rows:
            err = float("nan") if y is None else float(
                jnp.linalg.norm(y.astype(F32) - exact) / jnp.linalg.norm(exact))
            print(f"  {s * 1e3:8.3f} ms {flop / s / 1e12:7.1f} TFLOP/s err {err:.2e}  {name}", flush=True)


if __name__ == "__main__":
    main()
