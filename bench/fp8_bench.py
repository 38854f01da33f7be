"""fp8 weights at Flash's shapes, one layer's ops at a time: the error fp8 adds, and the kernels against their byte
floor and against bf16 weights in the same process, each at several tunings.

    python bench/fp8_bench.py --out fp8_h200.md
    python bench/fp8_bench.py --sections moe --out fp8_moe.md   # the MoE layer alone
    python bench/fp8_bench.py --smoke       # tiny shapes, interpret mode on the CPU: a script check

(1) The MoE layer at T = 1 (routed_experts as the model's decode runs it: router, top 8 + shared expert, fused), at
    --tp's per-device width, fp8 against bf16: --layers layers of different weights, each with its own token (so
    each routes to other experts: cold), chained in one loop compiled as the step programs are
    (lingjax.execution.step_compiler_options). Per variant (MOE_VARIANTS: the decode's tiles, the previous reading of
    x, other ExpertTunings): µs per layer, its floor (the touched experts' and the router's bytes), the kernels'
    profiled times, the error against the reference on the weights dequantized to f32, and whether the decode's row
    is bit-equal to the same token's row in a verify (T = 6: route, then fused_experts at the default tiles: row
    invariance). And the error fp8 adds against the bf16 weights.
(2) Projections (every matrix a Flash decode reads through lingjax.pallas.linear, at --tp's per-device shape
    and device blocks; a shape met twice is timed once): random bf16 weights (normal, std 1/sqrt(in)), quantized as
    lingjax does (lingjax.model.quantizer_block, scales cut for the TP size); x [16, K] bf16 normal. Error: the fp8
    kernel's output against the same op on the bf16 weights, max |Δ| / max |y|. Timing: each variant reads --copies
    weight copies (cold: together over L2) in one program compiled as the step programs are, calls dispatched back
    to back (common.pipelined_seconds): µs per copy; floor = fp8 bytes + scales + x / bandwidth. Variants: the
    decode (tokens=1) at each of LINEAR_VARIANTS, the verify (16 rows) at the default tuning, XLA's GEMM on the
    bf16 weights (the peer). Each is checked against x · (q·s)ᵀ in f32, and the default's and the split x row's
    decode row against its verify row, bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from moe_bench import loop_over_layers

from common import (
    FP8_MATRIX_BYTES,
    Report,
    add_options,
    heading,
    median_seconds,
    parser,
    pipelined_seconds,
    read_bandwidth,
    rel,
    tuning_label,
)
from lingjax import profiling, target
from lingjax.config import preset
from lingjax.execution import step_compiler_options
from lingjax.model import fp8_layout, quantizer_block
from lingjax.ops import fp8 as fp8_ops
from lingjax.ops import moe as moe_ops
from lingjax.ops.linear import linear
from lingjax.pallas import moe_experts
from lingjax.pallas.linear import LinearTuning, plan, supports
from lingjax.pallas.linear import linear as pallas_linear
from lingjax.pallas.moe_experts import one_token_tiles

F32, BF16 = jnp.float32, jnp.bfloat16
EXACT_TOL = 1e-4  # a kernel against x · (q·s)ᵀ in f32: reassociation only
# the decode's Pallas linear tunings on fp8 weights; the first is the default
LINEAR_VARIANTS = [
    ("default", LinearTuning()),
    ("dots in bf16 (weight tiles to x's dtype)", LinearTuning(fp8_dots="x")),
    ("previous x read: a row per scale block", LinearTuning(x_row_min_bytes=256)),
    ("x row per K step, split", LinearTuning(x_row_split=True)),
    ("8 warps", LinearTuning(warps=8)),
    ("3 stages, split", LinearTuning(stages=3, x_row_split=True)),
    ("N tile 64, split", LinearTuning(bn=64, x_row_split=True)),
    ("5 K splits, split", LinearTuning(k_splits=5, x_row_split=True)),  # K steps of 256 where K = 2560
]
BITS_CHECKED = ("default", "x row per K step, split")  # their decode rows against their verify rows; the smoke run's
# the decode's MoE layer: (label, weights, changes to the decode's tiles (one_token_tiles) or None for them)
MOE_VARIANTS = [
    ("fp8, decode tiles (default)", "fp8", None),
    ("fp8, dots in bf16 (weight tiles to x's dtype)", "fp8", dict(fp8_dots="x")),
    ("fp8, previous x read: a row per scale block, 4 warps", "fp8", dict(x_row_min_bytes=256, warps_up=4)),
    ("bf16, decode tiles", "bf16", None),
    ("fp8, 4 warps up", "fp8", dict(warps_up=4)),
    ("fp8, x row per K step, split", "fp8", dict(x_row_split=True)),
    ("fp8, K step 512, split", "fp8", dict(bk_up=512, x_row_split=True)),
    ("fp8, 8 warps down", "fp8", dict(warps_down=8)),
    ("fp8, up tiles 32 wide", "fp8", dict(bn_up=32)),
    ("fp8, 4 up stages", "fp8", dict(stages_up=4)),
]
SMOKE_MOE = 3  # variants the smoke run takes


def compile_options():
    """The step programs' GPU options (None off the GPU: the smoke run)."""
    return step_compiler_options() if target.platform() == "gpu" else None


def quantized(w, path, layout):
    """w quantized as lingjax quantizes a weight at `path` (quantizer blocks, scales cut for the layout's TP)."""
    block = quantizer_block(w.shape, layout.block)
    q = fp8_ops.quantize_on_device(w, block)
    device = layout.device_block(path, w.shape)
    return fp8_ops.Fp8Array(q.q, fp8_ops.refine_scales_on_device(q.scale, w.shape, block, device))


def projections(cfg, tp):
    """(label, parameter path, per-device [N, K]) of the projections a Flash decode reads through the Pallas linear."""
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


def over_copies(fn):
    """One program applying fn(x, w) to each weight copy (a Python loop: no slicing of stacked weights) -> (a
    scalar of every copy's output, the first copy's whole output), compiled as the step programs are."""
    def run(x, ws):
        outs = [fn(x, w) for w in ws]
        return sum(jnp.sum(o[:1, :8].astype(F32)) for o in outs), outs[0]

    return jax.jit(run, compiler_options=compile_options())


def bits_equal(a, b) -> bool:
    return bool(np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32)))


def bench_projections(say, cfg, tp, bw, copies, reps, smoke, interpret):
    layout = fp8_layout(cfg, tp)
    say(
        f"\n## (2) projections at TP{tp}: the Pallas linear on fp8 weights against XLA on bf16 ones, {copies} cold "
        "copies per program"
    )
    say("error vs bf16: the kernel's output against the op on the unquantized bf16 weights; vs exact: each variant "
        f"against x · (q·s)ᵀ in f32 (FAIL above {EXACT_TOL:g}; a decode's row 0); bits: the decode's row 0 against "
        "the same tuning's verify row 0 (row invariance); launch: N tile / K splits / K step / partial-sum width / "
        "how a decode reads x (lingjax.pallas.x_row_mode)")
    say.table("projection", "[N, K]", "device block", "fp8 error vs bf16", "variant", "launch", "vs exact", "bits",
              "µs", "floor µs", "x floor")
    key, timed = jax.random.key(0), {}
    for label, path, (n, k) in projections(cfg, tp):
        block = layout.device_block(path, (n, k))
        if (n, k, block) in timed:
            say.row(label, f"[{n}, {k}]", str(block), "", f"as {timed[n, k, block]}", "", "", "", "", "", "")
            continue
        timed[n, k, block] = label
        key, kx, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (16, k), F32).astype(BF16)
        dense = [(jax.random.normal(jax.random.fold_in(kw, c), (n, k), F32) * k**-0.5).astype(BF16)
                 for c in range(copies)]
        q = [quantized(w, path, layout) for w in dense]
        err = rel(pallas_linear(x, q[0], F32, interpret=interpret), linear(x, dense[0], F32))
        floor = (n * k + q[0].scale.size * 4 + x.size * 2) / bw
        exact = jnp.einsum("rk,nk->rn", x.astype(F32), q[0].dequantize(F32), precision="highest")
        variants = [(f"decode: {name}", tuning, 1) for name, tuning in LINEAR_VARIANTS
                    if not smoke or name in BITS_CHECKED]
        variants.append(("verify (16 rows): default", LinearTuning(), None))
        first = True
        for name, tuning, tokens in variants + [("XLA bf16 weights (peer)", None, None)]:
            lead = (label, f"[{n}, {k}]", str(q[0].block), f"{err:.2e}") if first else ("", "", "", "")
            first = False
            if tuning is None:
                t = pipelined_seconds(over_copies(lambda x, w: linear(x, w, F32)), x, dense, reps=reps) / copies
                peer_floor = (n * k * 2 + x.size * 2) / bw
                say.row(*lead, name, "", "-", "-", f"{t * 1e6:.2f}", f"{peer_floor * 1e6:.2f}", f"{t / peer_floor:.2f}")
                continue
            fn = lambda x, w, tuning=tuning, tokens=tokens: pallas_linear(x, w, F32, tokens=tokens, tuning=tuning,
                                                                      interpret=interpret)
            if reason := supports(x, q[0], F32, tokens=tokens, tuning=tuning):
                say.row(*lead, name, "", f"unsupported: {reason}", "", "", "", "")
                continue
            launch = "/".join(str(v) for v in plan(x.dtype, q[0], tokens, tuning).values())
            try:
                program = over_copies(fn)
                out = program(x, q)[1]
                t = pipelined_seconds(program, x, q, reps=reps) / copies
            except Exception as e:  # a variant that fails to compile: reported, the others still run
                say.row(*lead, name, launch, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", "", "",
                        "", "")
                continue
            rows = 1 if tokens == 1 else x.shape[0]
            e = rel(out[:rows], exact[:rows])
            bits = "-"
            if tokens == 1 and name.removeprefix("decode: ") in BITS_CHECKED:
                verify = jax.jit(lambda x, w, tuning=tuning: pallas_linear(x, w, F32, tuning=tuning,
                                                                          interpret=interpret))(x, q[0])
                bits = "equal" if bits_equal(out[:1], verify[:1]) else "DIFFER"
            say.row(*lead, name, launch, f"{e:.1e}" + ("" if e < EXACT_TOL else " FAIL"), bits, f"{t * 1e6:.2f}",
                    f"{floor * 1e6:.2f}", f"{t / floor:.2f}")


def moe_layers(cfg, tp, n_layers):
    """n_layers MoE layers at tp's per-device width: each {bf16: weights, fp8: the same quantized} and its token."""
    layout = fp8_layout(cfg, tp)
    d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size // tp
    base = ("layers", 5, "mlp")
    out = []
    for layer in range(n_layers):
        keys = jax.random.split(jax.random.key(100 + layer), 9)
        w = lambda kk, shape, fan_in: (jax.random.normal(kk, shape, F32) * fan_in**-0.5).astype(BF16)
        bf16 = dict(wg=w(keys[0], (e, i, d), d), wu=w(keys[1], (e, i, d), d),
                    wd=w(keys[2], (e, d, i), cfg.moe_intermediate_size),
                    shared=(w(keys[3], (i, d), d), w(keys[4], (i, d), d),
                            w(keys[5], (d, i), cfg.moe_intermediate_size)),
                    router=w(keys[6], (e, d), d), bias=jax.random.normal(keys[7], (e,), F32) * 0.1)
        names = (("w_gate", "w_up", "w_down"), ("gate_proj", "up_proj", "down_proj"))
        fp8 = dict(bf16, **{k: quantized(bf16[k], base + (n,), layout) for k, n in zip(("wg", "wu", "wd"), names[0])},
                   shared=tuple(quantized(s, base + ("shared", n), layout) for s, n in zip(bf16["shared"], names[1])))
        x = jax.random.normal(keys[8], (1, d), F32).astype(BF16)
        out.append(({"bf16": bf16, "fp8": fp8}, x))
    return out


def bench_moe(say, cfg, tp, bw, n_layers, reps, smoke, interpret):
    i, k = cfg.moe_intermediate_size // tp, cfg.num_experts_per_tok
    d, e = cfg.hidden_size, cfg.num_experts
    routing = dict(top_k=k, n_group=cfg.n_group, topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
                   renormalize=cfg.norm_topk_prob, precision="f32")
    limit, shared_limit = 4.0, 7.0
    layers = moe_layers(cfg, tp, n_layers)

    def call(x, p, tuning, tokens=None):  # the layer's f32 result, as lingjax.model.MoE calls routed_experts
        return moe_experts.routed_experts(x, p["router"], p["bias"], p["wg"], p["wu"], p["wd"], limit, tokens=tokens,
                                          **routing, shared=p["shared"], shared_limit=shared_limit, tuning=tuning,
                                          interpret=interpret)

    p0, x0 = layers[0][0], layers[0][1]
    p_last, x_last = layers[-1]
    others = jax.random.normal(jax.random.key(7), (5, d), F32).astype(BF16)
    x6 = jnp.concatenate([x0, others])  # a verify whose first token is layer 0's decode token
    f32 = lambda w: w.dequantize(F32)
    exact = moe_ops.routed_experts(x0, p0["bf16"]["router"], p0["bf16"]["bias"], f32(p0["fp8"]["wg"]),
                                   f32(p0["fp8"]["wu"]), f32(p0["fp8"]["wd"]), limit, **routing,
                                   shared=tuple(map(f32, p0["fp8"]["shared"])), shared_limit=shared_limit)
    decode = jax.jit(call, static_argnames=("tuning", "tokens"))

    def verify_row(kind, dots):  # the verify's default tiles at the variant's fp8_dots: a row of the same rounding
        tuning = dataclasses.replace(moe_experts.many_token_tiles(6, k, e), fp8_dots=dots)
        return decode(x6, p0[kind], tuning, tokens=6)[:1]

    fp8_err = rel(decode(x0, p0["fp8"], None), decode(x0, p0["bf16"], None))
    n_iter = 1 if smoke else 10
    say(f"\n## (1) MoE layer at T = 1, TP{tp} (routed_experts: router + top {k} + shared, fused; I = {i}), {n_layers} "
        f"layers of other weights in one loop, {n_iter} rounds, compiled as the step programs are")
    say(f"fp8 error vs bf16 weights (the layer's output, max |Δ| / max |y|): {fp8_err:.2e}")
    say("vs exact: the fp8 layer against the reference on the fp8 weights dequantized to f32 (FAIL above 1e-2: h is "
        "rounded to bf16 between the GEMMs); bits: the decode's row against the same token's row in a verify (T = 6, "
        "default tiles at the variant's fp8_dots); kernels: the router GEMV, up and down launches, profiled in one "
        "call of a layer alone on cold weights; floor: the top-k and shared experts' and the router's bytes")
    say.table("variant", "tuning (changed from the decode's tiles)", "vs exact", "bits", "µs per layer", "floor µs",
              "x floor", "gemv / up / down µs")
    options = compile_options()
    for label, kind, changes in MOE_VARIANTS[:SMOKE_MOE] if smoke else MOE_VARIANTS:
        tuning = None if changes is None else dataclasses.replace(one_token_tiles(i, kind == "fp8"), **changes)
        changed = tuning_label({"moe_routed_experts": tuning}, cfg, tp) if tuning else ""
        weights = [(p[kind], x) for p, x in layers]
        try:
            row = decode(x0, p0[kind], tuning)
            check = "-" if kind == "bf16" else (f"{(err := rel(row, exact)):.1e}" + ("" if err < 1e-2 else " FAIL"))
            dots = (tuning or moe_experts.ExpertTuning()).fp8_dots
            bits = "equal" if bits_equal(row, verify_row(kind, dots)) else "DIFFER"
            fn = lambda x, p, tuning=tuning: call(x, p, tuning).astype(x.dtype)
            loop, args = loop_over_layers(fn, n_iter, options), ([p for p, _ in weights], [x for _, x in weights])
            t = median_seconds(loop, *args, reps=reps) / (n_iter * n_layers)
            # the kernels of one layer called alone (the loop's CUDA graph hides its kernels from the profiler), on
            # the last layer's weights, untouched since the loop: cold
            us = {kern.name: kern.dur_us for kern in profiling.traced_kernels(decode, x_last, p_last[kind], tuning)}
        except Exception as err:  # a variant that fails to compile: reported, the others still run
            say.row(label, changed, f"failed: {type(err).__name__}: {str(err).splitlines()[0][:80]}", "", "", "", "",
                    "")
            continue
        item = 2 if kind == "bf16" else FP8_MATRIX_BYTES
        floor = ((k + 1) * 3 * i * d * item + e * d * 2) / bw
        kernels = " / ".join(f"{us.get(name, float('nan')):.2f}" for name in ("moe_router_gemv", "moe_up_select",
                                                                              "moe_down_combine"))
        say.row(label, changed.strip() or "-", check, bits, f"{t * 1e6:.2f}", f"{floor * 1e6:.2f}", f"{t / floor:.2f}",
                kernels)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="per-device shapes of these TP sizes")
    ap.add_argument("--sections", nargs="+", default=["moe", "proj"], choices=["moe", "proj"],
                    help="moe: the MoE layer (1); proj: the projections (2)")
    ap.add_argument("--copies", type=int, default=8, help="weight copies per projection program")
    ap.add_argument("--layers", type=int, default=4, help="MoE layers of different weights in the timed loop")
    ap.add_argument("--reps", type=int, default=7)
    add_options(ap, "smoke", "out")
    args = ap.parse_args(argv)
    say = Report(args.out)
    cfg = preset("tiny" if args.smoke else "flash")
    if args.smoke:
        args.copies, args.reps, args.layers = 2, 1, 2
    interpret = args.smoke
    heading(say, f"fp8_bench: {'tiny (smoke)' if args.smoke else 'flash'} shapes, tp {args.tp}")
    bw = read_bandwidth(1 << 20, warm=1, reps=3) if args.smoke else read_bandwidth()
    say(f"read bandwidth {bw / 1e12:.2f} TB/s (floors divide by it)")
    for tp in args.tp:
        if "moe" in args.sections:
            bench_moe(say, cfg, tp, bw, args.layers, args.reps, args.smoke, interpret)
        if "proj" in args.sections:
            bench_projections(say, cfg, tp, bw, args.copies, args.reps, args.smoke, interpret)


if __name__ == "__main__":
    main()
