"""One kernel launched plainly a few times, for Nsight Compute (ncu) to say where its time goes.

    ncu --clock-control none --set full -k regex:kda_chain_verify -s 2 -c 1 -o chain \
        python bench/ncu_kernels.py chain --t 1
    ncu -i chain.ncu-rep --page details                           # per kernel: speed of light, stalls, occupancy
    ncu -i chain.ncu-rep --page source --csv --print-source sass  # warp-state samples per SASS instruction
    ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum -k regex:NAME \
        python bench/ncu_kernels.py chain --t 1 6 --launches 30 --groups g.txt > d.csv
    python bench/ncu_kernels.py summarize d.csv --groups g.txt --out durations.md   # median per configuration

What it launches (--launches times each; ncu flushes the caches before every profiled pass, so each profiled launch
reads cold memory; one configuration per --t, each named in the --groups file for
`summarize`):
  chain  lingjax's kda_chain_verify at --t rows, one device's KDA layer of --model at --tp, kda_bench's rotating
         inputs, the model's tuning (or --kernel-option kda_chain:FIELD=VALUE)
  fla    fla's fused_recurrent_kda at --t rows (PyTorch; --forms plain in: "in" does l2norm, the gate and beta's
         sigmoid in its kernel, the form closest to ours), kda_bench's fla inputs
  moe    one MoE layer of --model at --tp as lingjax.model runs it at --t rows (router GEMV; at T = 1 the up kernel
         routes the token, above it the select launch and the align; up with the shared expert, down, XLA's k-sum),
         moe_bench's layer (--kernel-option moe_experts:FIELD=VALUE or moe_routed_experts:FIELD=VALUE for its tiles)

Why: in-graph timing (kda_bench, moe_bench) says how long a kernel takes; where a kernel is a latency chain, ncu's
warp-state sampling and memory charts say which instructions the warps wait on. Timing stays in those benches:
under ncu the clocks, caches and replays are ncu's, so its durations compare kernels measured the same way (ours
against fla's: each kernel alone, cold, nothing of a harness around it), not a step's time.
Needs XLA_PYTHON_CLIENT_PREALLOCATE=false (ncu saves and restores device memory between its passes).
"""

from __future__ import annotations

import csv
import os
import statistics
import sys

from common import Report, add_options, config_of, kda_shape, moe_shape, parser, tuning_for


def run_chain(args, group):
    import jax
    from kda_bench import chain_harness

    from lingjax.pallas.kda_chain import ChainTuning, kda_chain_verify

    h = chain_harness(kda_shape(config_of(args.model), args.tp), rotations=64)
    tuning = tuning_for(args.kernel_option, config_of(args.model), args.tp).get("kda_chain", ChainTuning())
    for t in args.t:
        xs = h.inputs(t)
        fn = jax.jit(lambda *a, t=t: kda_chain_verify(*a, tokens=t, in_place=False, **h.cfg, tuning=tuning))
        group(f"chain T={t}", args.launches + 1)
        jax.block_until_ready(fn(*h.args(xs, 0)))  # compiles; its launch is the group's first
        for r in range(args.launches):
            jax.block_until_ready(fn(*h.args(xs, r % h.rotations)))


def run_fla(args, group):
    import torch
    from fla.ops.kda import fused_recurrent_kda
    from kda_bench import fla_inputs

    shape = kda_shape(config_of(args.model), args.tp)
    torch.manual_seed(0)
    for t in args.t:
        for form in args.forms:
            fargs, kw, s = fla_inputs(torch, shape, t, 1, form == "in")
            group(f"fla T={t} {form}", args.launches)
            for _ in range(args.launches):
                fused_recurrent_kda(*(a[0] for a in fargs), initial_state=s[0], output_final_state=True, **kw)
            torch.cuda.synchronize()


def run_moe(args, group):
    import jax
    import jax.numpy as jnp
    import moe_bench

    cfg = config_of(args.model)
    shape = moe_shape(cfg, args.tp)
    tuning = tuning_for(args.kernel_option, cfg, args.tp)
    layer = moe_bench.make_layer(jax.random.key(0), shape)
    for t in args.t:
        experts = tuning.get("moe_routed_experts" if t == 1 else "moe_experts")
        fn = jax.jit(lambda x, p, experts=experts: moe_bench.model_layer(x, p, shape, experts))
        x = jax.random.normal(jax.random.key(1), (t, shape.d), jnp.float32).astype(jnp.bfloat16)
        group(f"moe T={t}", args.launches + 1)
        jax.block_until_ready(fn(x, layer))  # compiles; its launches are the group's first
        for _ in range(args.launches):
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


def summarize(argv) -> None:
    ap = parser(__doc__)
    ap.prog = "ncu_kernels.py summarize"
    ap.add_argument("path", help="ncu's CSV of gpu__time_duration.sum")
    ap.add_argument("--groups", required=True, help="the --groups file of the same run")
    ap.add_argument("--skip", type=int, default=2, help="launches of each configuration to leave out first")
    add_options(ap, "out")
    args = ap.parse_args(argv)
    say = Report(args.out)
    say.table("configuration", "kernel", "launches", "median µs", "min-max")
    for label, kernel, n, med, lo, hi in summary_rows(args.path, args.groups, args.skip):
        say.row(label, kernel[:40], n, f"{med:.2f}", f"{lo:.2f}-{hi:.2f}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["summarize"]:
        return summarize(argv[1:])
    ap = parser(__doc__)
    ap.add_argument("kernel", choices=("chain", "fla", "moe"))
    add_options(ap, "model", "tp", "kernel_option", model="flash")
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--groups", default=os.devnull, help="file naming each configuration and its launches")
    ap.add_argument("--t", type=int, nargs="+", default=[1], help="rows (new tokens) per call")
    ap.add_argument("--forms", nargs="+", default=["in"], choices=["plain", "in"],
                    help="fla: plain and/or in (norms, gate, beta's sigmoid in its kernel)")
    args = ap.parse_args(argv)
    with open(args.groups, "w") as out:
        def group(label, n):  # the launches that follow belong to `label`
            out.write(f"{label}\t{n}\n")
            out.flush()

        {"chain": run_chain, "fla": run_fla, "moe": run_moe}[args.kernel](args, group)
    print(f"ncu_kernels: {args.kernel} T={args.t}: {args.launches} launches per configuration done")


if __name__ == "__main__":
    main()
