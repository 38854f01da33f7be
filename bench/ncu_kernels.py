"""One kernel launched plainly a few times, for Nsight Compute (ncu) to say where its time goes.

  ncu --clock-control none --set full -k regex:kda_chain_verify -s 2 -c 1 -o chain python bench/ncu_kernels.py chain --t 1
  ncu -i chain.ncu-rep --page details                           # per kernel: speed of light, stalls, occupancy
  ncu -i chain.ncu-rep --page source --csv --print-source sass  # warp-state samples per SASS instruction
  ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum -k regex:NAME \
      python bench/ncu_kernels.py chain --t 1,6 --launches 30 --groups g.txt > d.csv
  python bench/ncu_kernels.py summarize d.csv --groups g.txt     # median duration per configuration

What it launches (--launches times each, on the same inputs: ncu flushes the caches before every profiled
pass, so each profiled launch reads cold memory; --t and the kernel's own options take comma-separated
lists, run one configuration after another, each named in the --groups file for `summarize`):
  chain  lingjax's kda_chain_verify at --t rows, 32 heads, K = V = 128, kda_bench's inputs, the model's
         defaults (or --block-v / --warps)
  fla    fla's fused_recurrent_kda at --t rows (PyTorch; --forms plain,in: "in" does l2norm, the gate and
         beta's sigmoid in its kernel, the form closest to ours), kda_bench's fla inputs
  moe    one Flash MoE layer as lingjax.model runs it at --t rows (router GEMV; at T = 1 the up kernel routes
         the token, above it the select launch and the align; up with the shared expert, down, XLA's k-sum),
         moe_bench's layer

Why: in-graph timing (kda_bench, moe_bench) says how long a kernel takes; the kernels still far from their
floor at T = 1 (#4's chain, #5's MoE) are latency chains, and ncu's warp-state sampling and memory
charts say which instructions the warps wait on. Timing stays in those benches: under ncu the clocks,
caches and replays are ncu's, so its durations compare kernels measured the same way (ours against fla's:
each kernel alone, cold, nothing of a harness around it), not a step's time.
Needs XLA_PYTHON_CLIENT_PREALLOCATE=false (ncu saves and restores device memory between its passes).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kda_bench, moe_bench beside this script


def run_chain(ts, launches: int, block_v: int | None, warps: int | None, group):
    import kda_bench

    kda_bench._import_kernels_only()
    import jax

    from lingjax.pallas.kda_chain import kda_chain_verify

    h = kda_bench.chain_harness()
    opts = {k: v for k, v in dict(block_v=block_v, num_warps=warps).items() if v is not None}
    for t in ts:
        xs = h.inputs(t)
        fn = jax.jit(lambda *a, t=t: kda_chain_verify(*a, tokens=t, in_place=False, **h.cfg, **opts))
        group(f"chain T={t}", launches + 1)
        jax.block_until_ready(fn(*h.args(xs, 0)))  # compiles; its launch is the group's first
        for r in range(launches):
            jax.block_until_ready(fn(*h.args(xs, r % kda_bench.R)))


def run_fla(ts, launches: int, forms, group):
    import torch
    from fla.ops.kda import fused_recurrent_kda

    from kda_bench import fla_inputs

    torch.manual_seed(0)
    for t in ts:
        for form in forms:
            args, kw, s = fla_inputs(torch, t, 1, form == "in")
            group(f"fla T={t} {form}", launches)
            for _ in range(launches):
                fused_recurrent_kda(*(a[0] for a in args), initial_state=s[0], output_final_state=True, **kw)
            torch.cuda.synchronize()


def run_moe(ts, launches: int, group):
    import jax
    import jax.numpy as jnp

    import moe_bench

    dims = moe_bench.FLASH_DIMS
    layer = moe_bench.make_layer(jax.random.key(0), **dims)
    fn = jax.jit(lambda x, p: moe_bench.model_layer(x, p, moe_bench.ROUTING))
    for t in ts:
        x = jax.random.normal(jax.random.key(1), (t, dims["d"]), jnp.float32).astype(jnp.bfloat16)
        group(f"moe T={t}", launches + 1)
        jax.block_until_ready(fn(x, layer))  # compiles; its launches are the group's first
        for _ in range(launches):
            jax.block_until_ready(fn(x, layer))


def summary_rows(path: str, groups_path: str, skip: int) -> list[tuple]:
    """(configuration, kernel, launches kept, median, min, max µs) from one `ncu --csv --print-units base
    --metrics gpu__time_duration.sum` output (ns) and the --groups file of the same run (each line: a label
    and how many launches of each profiled kernel it made, in launch order); the first `skip` launches of
    each configuration are left out (first touch)."""
    with open(path) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    head, body = rows[0], rows[1:]
    name, metric, value = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
    seq = {}  # kernel name -> its durations in launch order
    for r in body:
        if r[metric] == "gpu__time_duration.sum":
            seq.setdefault(r[name], []).append(float(r[value].replace(",", "")) / 1e3)
    with open(groups_path) as f:
        groups = [(label, int(n)) for label, n in (line.rstrip("\n").rsplit("\t", 1) for line in f if line.strip())]
    out = []
    for kernel, durations in seq.items():
        if sum(n for _, n in groups) != len(durations):
            raise ValueError(f"{kernel}: {len(durations)} launches profiled, the groups name "
                             f"{sum(n for _, n in groups)}: was every launch profiled (ncu -c)?")
        at = 0
        for label, n in groups:
            v, at = durations[at:at + n][skip:], at + n
            if v:
                out.append((label, kernel, len(v), statistics.median(v), min(v), max(v)))
    return out


def summarize(path: str, groups_path: str, skip: int):
    print("| configuration | kernel | launches | median µs | min-max |\n|---|---|---|---|---|")
    for label, kernel, n, med, lo, hi in summary_rows(path, groups_path, skip):
        print(f"| {label} | {kernel[:40]} | {n} | {med:.2f} | {lo:.2f}-{hi:.2f} |")


def main():
    if sys.argv[1:2] == ["summarize"]:
        ap = argparse.ArgumentParser(prog="ncu_kernels.py summarize")
        ap.add_argument("path")
        ap.add_argument("--groups", required=True)
        ap.add_argument("--skip", type=int, default=2, help="launches of each configuration to leave out first")
        a = ap.parse_args(sys.argv[2:])
        return summarize(a.path, a.groups, a.skip)
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", choices=("chain", "fla", "moe"))
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--groups", default=os.devnull, help="file naming each configuration and its launches")
    ap.add_argument("--t", default="1", help="rows (new tokens) per call, comma-separated")
    ap.add_argument("--block-v", type=int, default=None, help="chain: V columns per tile")
    ap.add_argument("--warps", type=int, default=None, help="chain: warps per program")
    ap.add_argument("--forms", default="in", help="fla: plain and/or in (norms, gate, beta's sigmoid in its kernel)")
    a = ap.parse_args()
    ts = [int(t) for t in a.t.split(",")]
    with open(a.groups, "w") as out:
        def group(label, n):  # the launches that follow belong to `label`
            out.write(f"{label}\t{n}\n")
            out.flush()

        if a.kernel == "chain":
            run_chain(ts, a.launches, a.block_v, a.warps, group)
        elif a.kernel == "fla":
            run_fla(ts, a.launches, a.forms.split(","), group)
        else:
            run_moe(ts, a.launches, group)
    print(f"ncu_kernels: {a.kernel} T={a.t}: {a.launches} launches per configuration done")


if __name__ == "__main__":
    main()
