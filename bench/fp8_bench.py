"""fp8 weights at Flash's shapes, one layer's ops at a time: the error fp8 adds, and the kernels against their byte
floor and against bf16 weights in the same process.

    python bench/fp8_bench.py --out fp8_h200.md
    python bench/fp8_bench.py --smoke       # tiny shapes, interpret mode on the CPU: a script check

(1) Projections (every matrix a Flash decode reads through lingjax.pallas.fp8_linear, at --tp's per-device shape
    and device blocks): random bf16 weights (normal, std 1/sqrt(in)), quantized as lingjax does
    (lingjax.model.quantizer_block, scales cut for the TP size); x [16, K] bf16 normal. Error: the fp8 kernel's
    output against the same op on the bf16 weights, max |Δ| / max |y|. Timing: each variant reads --copies weight
    copies (cold: together over L2) in one program; µs per call; floor = fp8 bytes + scales + x / bandwidth.
    Variants: the kernel's tunings, XLA's GEMM on the bf16 weights (the peer), XLA on the fp8 weights
    dequantized in the graph (what kernels="xla" runs).
(2) The MoE layer at T = 1 (routed_experts: router, top 8 + shared expert, fused), fp8 against bf16: error, and
    time per layer over --copies different tokens (each routes to other experts: cold).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from common import Report, heading, median_seconds, parser, read_bandwidth, rel
from lingjax.config import preset
from lingjax.model import fp8_layout, quantizer_block
from lingjax.ops import fp8 as fp8_ops
from lingjax.ops import moe as moe_ops
from lingjax.ops.linear import linear
from lingjax.pallas import moe_experts
from lingjax.pallas.fp8_linear import Fp8LinearTuning, fp8_linear

F32, BF16 = jnp.float32, jnp.bfloat16
TUNINGS = [Fp8LinearTuning(), Fp8LinearTuning(bn=64), Fp8LinearTuning(bn=32, k_splits=2), Fp8LinearTuning(bk=128),
           Fp8LinearTuning(stages=3), Fp8LinearTuning(warps=8)]
EXACT_TOL = 1e-4  # a kernel against x · (q·s)ᵀ in f32: reassociation only


def quantized(w, path, layout):
    """w quantized as lingjax quantizes a weight at `path` (quantizer blocks, scales cut for the layout's TP)."""
    block = quantizer_block(w.shape, layout.block)
    q = fp8_ops.quantize_on_device(w, block)
    device = layout.device_block(path, w.shape)
    return fp8_ops.Fp8Array(q.q, fp8_ops.refine_scales_on_device(q.scale, w.shape, block, device))


def projections(cfg, tp):
    """(label, parameter path, per-device [N, K]) of the projections a Flash decode reads through fp8_linear."""
    d, p, nh = cfg.hidden_size, cfg.kda_dim, cfg.num_heads
    return [
        ("KDA in_proj (q|k|v|f|g)", ("layers", 2, "attn", "in_proj"), (5 * p // tp, d)),
        ("KDA o_proj", ("layers", 2, "attn", "o_proj"), (d, p // tp)),
        ("MLA q_proj", ("layers", 5, "attn", "q_proj"), (nh * cfg.qk_head_dim // tp, d)),
        ("MLA kv_a_proj", ("layers", 5, "attn", "kv_a_proj"), (cfg.mla_cache_dim, d)),
        ("MLA o_proj", ("layers", 5, "attn", "o_proj"), (d, nh * cfg.v_head_dim // tp)),
        ("dense gate_proj", ("layers", 0, "mlp", "gate_proj"), (cfg.intermediate_size // tp, d)),
        ("dense down_proj", ("layers", 0, "mlp", "down_proj"), (d, cfg.intermediate_size // tp)),
        ("MTP eh_proj", ("mtp", "eh_proj"), (d, 2 * d)),
    ]


def over_copies(fn, interpret):
    """One program applying fn(x, w) to each weight copy (a Python loop: no slicing of stacked weights)."""
    @jax.jit
    def run(x, ws):
        return sum(jnp.sum(fn(x, w)[:1, :8].astype(F32)) for w in ws)

    return run


def bench_projections(say, cfg, tp, bw, copies, reps, interpret):
    layout = fp8_layout(cfg, tp)
    say(f"\n## (1) projections at TP{tp}: fp8_linear against bf16 weights, {copies} cold copies per program")
    say("error vs bf16: the kernel's output against the op on the unquantized bf16 weights; vs exact: each kernel "
        f"variant against x · (q·s)ᵀ computed in f32 (FAIL above {EXACT_TOL:g})")
    say.table("projection", "[N, K]", "device block", "fp8 error vs bf16", "variant", "vs exact", "µs", "floor µs",
              "x floor")
    key = jax.random.key(0)
    for label, path, (n, k) in projections(cfg, tp):
        key, kx, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (16, k), F32).astype(BF16)
        dense = [(jax.random.normal(jax.random.fold_in(kw, c), (n, k), F32) * k**-0.5).astype(BF16)
                 for c in range(copies)]
        q = [quantized(w, path, layout) for w in dense]
        err = rel(fp8_linear(x, q[0], F32, interpret=interpret), linear(x, dense[0], F32))
        fp8_bytes = n * k + q[0].scale.size * 4 + x.size * 2
        floor = fp8_bytes / bw
        first = True
        variants = [(f"pallas {t}", functools.partial(fp8_linear, tuning=t, interpret=interpret), q) for t in TUNINGS]
        variants.insert(1, ("pallas default, tokens=1 (a decode: x's row 0 broadcast)",
                            functools.partial(fp8_linear, tokens=1, interpret=interpret), q))
        variants += [("XLA bf16 weights (peer)", linear, dense), ("XLA fp8 dequantized in the graph", linear, q)]
        exact = jnp.einsum("rk,nk->rn", x.astype(F32), q[0].dequantize(F32), precision="highest")
        for name, fn, ws in variants:
            check = "-"
            if name.startswith("pallas"):
                rows = 1 if "tokens=1" in name else x.shape[0]
                e = rel(fn(x, q[0], F32)[:rows], exact[:rows])
                check = f"{e:.1e}" + ("" if e < EXACT_TOL else " FAIL")
            t = median_seconds(over_copies(fn, interpret), x, ws, reps=reps) / copies
            peer_floor = (n * k * 2 + x.size * 2) / bw if "bf16" in name else floor
            say.row(label if first else "", f"[{n}, {k}]" if first else "", str(q[0].block) if first else "",
                    f"{err:.2e}" if first else "", name.replace("Fp8LinearTuning", ""), check, f"{t * 1e6:.2f}",
                    f"{peer_floor * 1e6:.2f}", f"{t / peer_floor:.2f}")
            first = False


def bench_moe(say, cfg, tp, bw, copies, reps, interpret):
    layout = fp8_layout(cfg, tp)
    d, e, i, k = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size // tp, cfg.num_experts_per_tok
    base = ("layers", 5, "mlp")
    keys = jax.random.split(jax.random.key(1), 9)
    std = lambda fan: fan**-0.5
    wg = (jax.random.normal(keys[0], (e, i, d), F32) * std(d)).astype(BF16)
    wu = (jax.random.normal(keys[1], (e, i, d), F32) * std(d)).astype(BF16)
    wd = (jax.random.normal(keys[2], (e, d, i), F32) * std(cfg.moe_intermediate_size)).astype(BF16)
    sg = (jax.random.normal(keys[3], (i, d), F32) * std(d)).astype(BF16)
    su = (jax.random.normal(keys[4], (i, d), F32) * std(d)).astype(BF16)
    sd = (jax.random.normal(keys[5], (d, i), F32) * std(cfg.moe_intermediate_size)).astype(BF16)
    router = (jax.random.normal(keys[6], (e, d), F32) * std(d)).astype(BF16)
    bias = jax.random.normal(keys[7], (e,), F32) * 0.1
    dense = (wg, wu, wd, (sg, su, sd))
    q = tuple(quantized(w, base + (name,), layout) for w, name in ((wg, "w_gate"), (wu, "w_up"), (wd, "w_down")))
    q_shared = tuple(quantized(w, base + ("shared", name), layout)
                     for w, name in ((sg, "gate_proj"), (su, "up_proj"), (sd, "down_proj")))
    fp8 = (*q, q_shared)
    del wg, wu, wd
    routing = dict(top_k=k, n_group=cfg.n_group, topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
                   renormalize=cfg.norm_topk_prob, precision="f32")
    xs = [jax.random.normal(jax.random.fold_in(keys[8], c), (16, d), F32).astype(BF16) for c in range(copies)]

    def layer(x, w):
        gate, up, down, shared = w
        return moe_experts.routed_experts(x, router, bias, gate, up, down, 4.0, tokens=1, **routing, shared=shared,
                                          shared_limit=7.0, interpret=interpret)

    err = rel(layer(xs[0], fp8), layer(xs[0], dense))
    f32 = lambda w: w.dequantize(F32)
    exact = moe_ops.routed_experts(xs[0], router, bias, *map(f32, q), 4.0, tokens=1, **routing,
                                   shared=tuple(map(f32, q_shared)), shared_limit=7.0)
    exact_err = rel(layer(xs[0], fp8), exact)
    say(f"\n## (2) MoE layer at T = 1, TP{tp} (routed_experts: router + top {k} + shared, fused), {copies} tokens "
        "per program (each routes to other experts)")
    say(f"fp8 error vs bf16 weights (the same layer's output, max |Δ| / max |y|): {err:.2e}; the fp8 kernels against "
        f"the reference on the fp8 weights dequantized to f32: {exact_err:.1e}"
        + ("" if exact_err < 1e-2 else " FAIL"))
    say.table("weights", "µs per layer", "floor µs", "x floor")
    for name, w, item in (("bf16", dense, 2), ("fp8", fp8, 1)):
        run = jax.jit(lambda xs, w: sum(jnp.sum(layer(x, w)[:1, :8]) for x in xs))
        t = median_seconds(run, xs, w, reps=reps) / copies
        nbytes = (k + 1) * 3 * i * d * item + e * d * 2
        say.row(name, f"{t * 1e6:.2f}", f"{nbytes / bw * 1e6:.2f}", f"{t / (nbytes / bw):.2f}")


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="per-device shapes of these TP sizes")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    say = Report(args.out)
    cfg = preset("tiny" if args.smoke else "flash")
    if args.smoke:
        args.copies, args.reps = 2, 1
    interpret = args.smoke
    heading(say, f"fp8_bench: {'tiny (smoke)' if args.smoke else 'flash'} shapes, tp {args.tp}")
    bw = read_bandwidth(1 << 20, warm=1, reps=3) if args.smoke else read_bandwidth()
    say(f"read bandwidth {bw / 1e12:.2f} TB/s (floors divide by it)")
    for tp in args.tp:
        bench_projections(say, cfg, tp, bw, args.copies, args.reps, interpret)
        bench_moe(say, cfg, tp, bw, max(2, args.copies), args.reps, interpret)


if __name__ == "__main__":
    main()
