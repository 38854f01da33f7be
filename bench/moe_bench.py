"""One MoE layer of a preset (Flash's by default: D 2560, I 768, 512 experts, top-8) on one GPU: correctness,
router tunings, whole layers against their byte floor, expert tiles.

    python bench/moe_bench.py --out moe.md             # Flash's layer at TP1
    python bench/moe_bench.py --tp 2 --out moe_tp2.md  # one TP2 device's share (I = 384)
    python bench/moe_bench.py --smoke                  # tiny preset, interpret mode: a CPU check

In one process: (1) correctness of the Pallas router, align and experts against lingjax.ops.moe on this device;
(2) the bandwidth the byte floors use, the fastest of a read probe (twice) and two copies; (3) the router at each
of ROUTERS (RouterTuning values) alone, and with the align launch the expert kernels need at T > 1, at T in {1, 6,
16}, each checked against the reference; (4) whole MoE layers: plain XLA (ops.moe route + experts_gathered + mlp),
the two-launch Pallas layer (route + fused_experts, which makes its own align plan; shared expert fused), the
model's path (routed_experts as lingjax.model.MoE calls it: at T = 1 the up kernel routes the token, no select
launch; above T = 1 the two launches), the model path with its loop compiled as the step programs are
(lingjax.execution.step_compiler_options: command buffers around the loop, programmatic dependent launch) and with
those options but PDL off, and the model path's kernels one by one (profiled); (5) fused_experts' tiles
(TILES: ExpertTuning values) in the two-launch layer: the up and down kernels' profiled times at T in {1, 4, 6},
at the layer's width and at half of it (a device at twice the TP), and each tiling's rows checked bit-equal to
the default's (row invariance).

Timing is in-graph: a jitted fori_loop over 8 layers whose weights are distinct arrays (Flash's: 24 GB, so L2 never
holds them), medians over repeated calls. Each layer's input is a fixed random x plus 1e-30 × the previous layer's
output (bit-identical after rounding, but not loop-invariant), so routing is fixed per layer and the distinct-expert
count of the floor is exact: floor = the distinct and shared experts' weights and the router weight
(common.moe_layer_bytes), over the larger of the bandwidth probes and the fastest rate any timed layer read its own
bytes at (a probe can read slower than the layers stream; a floor must not be beaten).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from common import (
    MoEShape,
    Report,
    add_options,
    config_of,
    copy_bandwidth,
    heading,
    median_seconds,
    moe_layer_bytes,
    moe_shape,
    parser,
    read_bandwidth,
    rel,
)
from lingjax import profiling, target
from lingjax.execution import CompileOptions, step_compiler_options
from lingjax.ops import moe as moe_ops
from lingjax.pallas.moe_align import BLOCK_M, align_reference, moe_align
from lingjax.pallas.moe_experts import ExpertTuning, fused_experts, routed_experts
from lingjax.pallas.moe_router import RouterTuning, route

F32, BF16 = jnp.float32, jnp.bfloat16
ROUTERS = {  # label -> (RouterTuning fields, precision)
    "default": ({}, "f32"),
    "ks=2 bk=256": (dict(k_splits=2, bk=256), "f32"),
    "ks=5 bk=512": (dict(k_splits=5, bk=512), "f32"),
    "be=32": (dict(be=32), "f32"),
    "select 1 warp": (dict(select_warps=1), "f32"),
    "select 2 warps": (dict(select_warps=2), "f32"),
    "default, bf16 precision": ({}, "bf16"),
}
SMOKE_ROUTERS = ("default", "default, bf16 precision")  # --smoke: each precision's path once
# (up, down) ExpertTuning fields of the tile sweep, the first the defaults; the up tiles 32 x 256 and 64 x 256 at 3
# stages are also the decode's (moe_experts.one_token_tiles at half and at full Flash width): the sweep's bit check
# holds their T = 1 rows to the default tiles' T = 6 rows (row invariance)
TILES = [({}, {}), (dict(bn_up=32, bk_up=256, stages_up=3), dict(bn_down=64, bk_down=256, stages_down=3)),
         (dict(bn_up=64, bk_up=128, stages_up=4), dict(bn_down=64, bk_down=128, stages_down=4)),
         (dict(bn_up=64, bk_up=256, stages_up=3), dict(bn_down=128, bk_down=128, stages_down=3)),
         (dict(bn_up=16, bk_up=256, stages_up=4), dict(bn_down=32, bk_down=128, stages_down=4))]


def kernel_us(fn, *args) -> dict:
    """Median duration per kernel name (µs) in a profile of fn(*args), after one untimed call."""
    jax.block_until_ready(fn(*args))
    per = collections.defaultdict(list)
    for k in profiling.traced_kernels(fn, *args):
        per[k.name].append(k.dur_us)
    return {name: statistics.median(v) for name, v in per.items()}


def make_layer(key, shape: MoEShape):
    """One layer's random weights (router, bias, routed gate/up/down, shared gate/up/down) at `shape`."""
    d, i, e, s = shape.d, shape.i, shape.e, shape.shared
    ks = jax.random.split(key, 8)
    w = lambda k, size, fan_in: (jax.random.normal(k, size, BF16) * fan_in**-0.5).astype(BF16)
    return dict(router=w(ks[0], (e, d), d), bias=0.1 * jax.random.normal(ks[1], (e,), F32),
                wg=w(ks[2], (e, i, d), d), wu=w(ks[3], (e, i, d), d), wd=w(ks[4], (e, d, i), i),
                sg=w(ks[5], (s, d), d), su=w(ks[6], (s, d), d), sd=w(ks[7], (d, s), s))


def xla_layer(x, p, shape: MoEShape):
    weights, experts = moe_ops.route(x, p["router"], p["bias"], **shape.routing)
    y = moe_ops.experts_gathered(x, p["wg"], p["wu"], p["wd"], weights, experts, shape.limit)
    return (y + moe_ops.mlp(x, p["sg"], p["su"], p["sd"], shape.shared_limit)).astype(x.dtype)


def pallas_layer(x, p, shape: MoEShape, router: RouterTuning = RouterTuning(), experts: ExpertTuning = ExpertTuning(),
                 precision="f32", dtype=None):
    """The two-launch Pallas layer (route, then fused_experts with the shared expert fused, as the model runs it
    above T = 1); fused_experts makes its own align plan (an align launch at T > 1, none at T = 1). Rounded to
    `dtype` (default x's)."""
    weights, ids = route(x, p["router"], p["bias"], precision=precision, **shape.routing, tuning=router)
    y = fused_experts(x, p["wg"], p["wu"], p["wd"], weights, ids, shape.limit, shared=(p["sg"], p["su"], p["sd"]),
                      shared_limit=shape.shared_limit, tuning=experts)
    return y.astype(dtype or x.dtype)


def model_layer(x, p, shape: MoEShape, tuning: ExpertTuning | None = None, dtype=None):
    """The layer as lingjax.model.MoE runs it: routed_experts (at T = 1 the up kernel routes the token, no select
    launch; above, the default router then fused_experts), the shared expert fused; `tuning` the expert launches'
    (None: the kernel's choice by T)."""
    y = routed_experts(x, p["router"], p["bias"], p["wg"], p["wu"], p["wd"], shape.limit, **shape.routing,
                       shared=(p["sg"], p["su"], p["sd"]), shared_limit=shape.shared_limit, tuning=tuning)
    return y.astype(dtype or x.dtype)


def loop_over_layers(layer_fn, n_iter, compiler_options=None):
    """Jitted (layers, xs) -> n_iter rounds of layer_fn over all layers in one fori_loop (weights stay arguments)."""

    def run(layers, xs):
        def body(_, c):
            for p, x in zip(layers, xs):
                c = layer_fn((x.astype(F32) + 1e-30 * c.astype(F32)).astype(x.dtype), p)
            return c

        return jax.lax.fori_loop(0, n_iter, body, jnp.zeros_like(xs[0]))

    return jax.jit(run, compiler_options=compiler_options)


@dataclasses.dataclass
class Run:
    """The settings of one run and what it found."""

    shape: MoEShape
    smoke: bool
    say: Report
    n_layers: int
    ts: tuple
    n_iter: int
    reps: int
    fails: list = dataclasses.field(default_factory=list)

    def inputs(self, seed: int, t: int, shape: MoEShape | None = None):
        """One random bf16 x [t, D] per layer."""
        d = (shape or self.shape).d
        return [jax.random.normal(jax.random.key(seed + 10 * t + l), (t, d), F32).astype(BF16)
                for l in range(self.n_layers)]

    def check(self, ok: bool, name: str) -> str:
        self.fails += [] if ok else [name]
        return "PASS" if ok else "FAIL"


def correctness(run: Run) -> None:
    """(1): the router, experts and align against lingjax.ops.moe, in f32 at small sizes and in bf16 at the layer's."""
    say, shape = run.say, run.shape
    say("\n## correctness")
    small = dataclasses.replace(shape, d=64, i=32, e=16, shared=32) if run.smoke else \
        dataclasses.replace(shape, d=256, i=128, e=32, shared=128)
    routing_s = dict(shape.routing, n_group=4, topk_group=2)
    for t in run.ts:
        ks = jax.random.split(jax.random.key(100 + t), 4)
        p32 = jax.tree.map(lambda a: a.astype(F32), make_layer(ks[0], small))
        x = jax.random.normal(ks[1], (t, small.d), F32)
        with jax.default_matmul_precision("highest"):
            rw, re = moe_ops.route(x, p32["router"], p32["bias"], **routing_s)
            ref = moe_ops.experts_gathered(x, p32["wg"], p32["wu"], p32["wd"], rw, re, shape.limit)
        gw, ge = route(x, p32["router"], p32["bias"], **routing_s)
        got = fused_experts(x, p32["wg"], p32["wu"], p32["wd"], rw, re, shape.limit)
        ok = bool((ge == re).all()) and rel(gw, rw) < 1e-5 and rel(got, ref) < 1e-5
        say(f"f32 small T={t}: router ids equal {bool((ge == re).all())}, weights {rel(gw, rw):.1e}, "
            f"experts {rel(got, ref):.1e} {run.check(ok, f'f32 T={t}')}")
    layer = make_layer(jax.random.key(0), shape)
    for t in run.ts:
        x = jax.random.normal(jax.random.key(200 + t), (t, shape.d), F32).astype(BF16)
        with jax.default_matmul_precision("highest"):
            rw, re = moe_ops.route(x, layer["router"], layer["bias"], **shape.routing)
        ew = moe_ops.experts_gathered(x, layer["wg"], layer["wu"], layer["wd"], rw, re, shape.limit)
        sh = moe_ops.mlp(x, layer["sg"], layer["su"], layer["sd"], shape.shared_limit)
        gw, ge = route(x, layer["router"], layer["bias"], **shape.routing)
        be = route(x, layer["router"], layer["bias"], precision="bf16", **shape.routing)[1]
        got = fused_experts(x, layer["wg"], layer["wu"], layer["wd"], rw, re, shape.limit)
        fused = fused_experts(x, layer["wg"], layer["wu"], layer["wd"], rw, re, shape.limit,
                              shared=(layer["sg"], layer["su"], layer["sd"]), shared_limit=shape.shared_limit)
        routed = model_layer(x, layer, shape, dtype=F32)
        two = pallas_layer(x, layer, shape, dtype=F32)
        agree = float(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(np.asarray(be), np.asarray(re))]))
        same = bool((np.asarray(routed) == np.asarray(two)).all())
        ok = bool((ge == re).all()) and rel(got, ew) < 1e-2 and rel(fused, ew + sh) < 1e-2 and same
        say(f"bf16 layer T={t}: f32 router ids equal {bool((ge == re).all())} (weights {rel(gw, rw):.1e}), bf16 "
            f"router id-set agreement {agree:.3f}, experts {rel(got, ew):.1e}, +shared fused "
            f"{rel(fused, ew + sh):.1e}, routed_experts bit-equal to route + fused_experts {same} "
            f"{run.check(ok, f'layer T={t}')}")
    for name, ex in [("random", jax.random.randint(jax.random.key(7), (8, 8), 0, shape.e, jnp.int32)),
                     ("one expert", jnp.full((8, 8), 5, jnp.int32)), ("NP=1", jnp.array([[3]], jnp.int32))]:
        got = moe_align(ex, block_m=16)
        want = align_reference(ex, 16, got[1].shape[0])
        say(f"align {name}: {run.check(all(bool((a == b).all()) for a, b in zip(got, want)), f'align {name}')}")


def bandwidth(run: Run) -> float:
    """(2): the fastest of two copies (read + write) and a read probe measured twice, in B/s."""
    nbytes = 2**20 if run.smoke else 2**32
    rates = {f"{jnp.dtype(dt).name} copy": copy_bandwidth(nbytes, dt, reps=run.reps * 2) for dt in (BF16, F32)}
    for n in (1, 2):
        rates[f"bf16 read {n}"] = read_bandwidth(1 << 19) if run.smoke else read_bandwidth()
    bw = max(rates.values())
    run.say(f"\nbandwidth ({'tiny' if run.smoke else '4 GiB'} arrays; copy: x*1.5, read: an f32 sum of bf16): "
            + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in rates.items())
            + f"; floors use the largest, {bw / 1e12:.2f} TB/s")
    return bw


def routers(run: Run, layers, bw: float) -> dict:
    """(3): each of ROUTERS alone and with the align launch, per layer, in-graph -> the loop's glue per layer by T."""
    say, shape = run.say, run.shape
    router_b = shape.e * shape.d * jnp.dtype(BF16).itemsize
    say(f"\n## router tunings (per layer, in-graph over {run.n_layers} layers; floor: router weight "
        f"{router_b / 1e6:.2f} MB bf16 = {router_b / bw * 1e6:.2f} µs)")
    say("the router on bf16 x and weight (the model's path); + align launch: moe_align on the router's ids, as "
        "fused_experts runs it at T > 1; none at T = 1; ids vs ops.moe.route at the same precision")
    say.table("T", "tuning", "router µs", "router + align launch µs", "ids equal")
    glue = loop_over_layers(lambda x, p: x, run.n_iter * 4)
    glue_per_t, best = {}, {}
    for t in run.ts:
        xs = run.inputs(600, t)
        glue_s = glue_per_t[t] = median_seconds(glue, layers, xs, reps=run.reps) / (4 * run.n_iter * run.n_layers)
        for name, (fields, precision) in ROUTERS.items():
            if run.smoke and name not in SMOKE_ROUTERS:
                continue
            tuning = RouterTuning(**fields)
            with jax.default_matmul_precision("highest"):
                want = moe_ops.route(xs[0], layers[0]["router"], layers[0]["bias"], precision=precision,
                                     **shape.routing)[1]
            same = bool((route(xs[0], layers[0]["router"], layers[0]["bias"], precision=precision, **shape.routing,
                               tuning=tuning)[1] == want).all())
            alone = lambda x, p, r=tuning, pr=precision: (x.astype(F32) + 1e-30 * route(
                x, p["router"], p["bias"], precision=pr, **shape.routing, tuning=r)[0].sum()).astype(x.dtype)

            def aligned(x, p, r=tuning, pr=precision):
                weights, experts = route(x, p["router"], p["bias"], precision=pr, **shape.routing, tuning=r)
                blk = moe_align(experts, block_m=BLOCK_M)[1]
                return (x.astype(F32) + 1e-30 * (weights.sum() + blk[0])).astype(x.dtype)

            per_layer = lambda fn: median_seconds(loop_over_layers(fn, 4 * run.n_iter), layers, xs, reps=run.reps) / (
                4 * run.n_iter * run.n_layers) - glue_s
            sec_alone = per_layer(alone)
            sec_align = per_layer(aligned) if t > 1 else None
            say.row(t, name, f"{sec_alone * 1e6:.1f}", "-" if sec_align is None else f"{sec_align * 1e6:.1f}", same)
            run.check(same, f"router {name} T={t}")
            if same and precision == "f32" and (t not in best or sec_alone < best[t][0]):
                best[t] = (sec_alone, name)
        say.row(t, f"loop glue {glue_s * 1e6:.1f} µs per layer (subtracted); fastest correct f32 tuning: "
                   f"{best.get(t, (0, 'none'))[1]}", "", "", "")
    return glue_per_t


def whole_layers(run: Run, layers, bw: float, glue_per_t: dict) -> None:
    """(4): whole layers against their floor, each path; then the model path's kernels, profiled."""
    say, shape = run.say, run.shape
    say(f"\n## whole MoE layer (router + routed + shared), per layer, cold weights over {run.n_layers} layers")
    say("two launches: route (RouterTuning defaults) + fused_experts, shared fused; model path: routed_experts as the "
        "model calls it (at T = 1 the up kernel routes the token, no select launch; above T = 1 the same as two "
        "launches); the loop's glue: the 1e-30 input update of each layer (one small fusion, not in the model), the "
        "router rows' figure at the same T; step options: the model path's loop compiled with "
        "lingjax.execution.step_compiler_options (the step programs' command buffers and programmatic dependent "
        "launch); PDL off: the same with xla_gpu_enable_pdl=false")
    say.table("T", "distinct experts", "floor µs", "XLA gather µs (x floor)", "Pallas two launches µs (x floor)",
              "Pallas model path µs (x floor)", "model path less the loop's glue µs (x floor)", "speed-up vs XLA",
              "step options µs (x floor)", "step options, PDL off µs (x floor)")
    step_opts = [step_compiler_options(), step_compiler_options(CompileOptions(xla_options=(("xla_gpu_enable_pdl",
                                                                                            False),)))]
    if target.platform() != "gpu":  # the smoke run: no GPU options to apply
        step_opts = [None, None]
    model_path = lambda x, p: model_layer(x, p, shape)
    breakdown, rows = {}, []
    for t in run.ts:
        xs = run.inputs(400, t)
        dist = np.mean([len(np.unique(np.asarray(moe_ops.route(x, p["router"], p["bias"], **shape.routing)[1])))
                        for x, p in zip(xs, layers)])
        res = []
        for fn, opts in ((lambda x, p: xla_layer(x, p, shape), None), (lambda x, p: pallas_layer(x, p, shape), None),
                         (model_path, None), (model_path, step_opts[0]), (model_path, step_opts[1])):
            if len(res) > 2 and opts is None:  # no GPU options to apply: the model path's figure again
                res.append(res[2])
                continue
            res.append(median_seconds(loop_over_layers(fn, run.n_iter, opts), layers, xs, reps=run.reps)
                       / (run.n_iter * run.n_layers))
        rows.append((t, dist, moe_layer_bytes(shape, dist), glue_per_t[t], res))
        breakdown[t] = kernel_us(loop_over_layers(model_path, max(1, run.n_iter // 4)), layers, xs)
    layer_bw = max(nbytes / sec for _, _, nbytes, _, res in rows for sec in res)  # a floor the layers beat is none
    floor_bw = max(bw, layer_bw)
    for t, dist, nbytes, glue_s, res in rows:
        floor = nbytes / floor_bw
        cell = lambda sec: f"{sec * 1e6:.1f} ({sec / floor:.2f}x)"
        say.row(t, f"{dist:.1f}", f"{floor * 1e6:.1f}", cell(res[0]), cell(res[1]), cell(res[2]), cell(res[2] - glue_s),
                f"{res[0] / res[2]:.2f}x", cell(res[3]), cell(res[4]))
    say(f"floors at {floor_bw / 1e12:.2f} TB/s: the larger of the probes' {bw / 1e12:.2f} and the fastest any layer "
        f"above read its bytes, {layer_bw / 1e12:.2f}")
    say("\nmodel path, kernel by kernel (profiled medians, µs; one launch each per layer):")
    for t, us in breakdown.items():
        say(f"T={t}: " + ", ".join(f"{name} {v:.2f}" for name, v in sorted(us.items(), key=lambda kv: -kv[1])))


def tiles(run: Run, cfg, tp: int, layers) -> None:
    """(5): fused_experts' TILES in the two-launch layer, at the layer's width and at half of it."""
    say = run.say
    say("\n## fused_experts tiles: moe_up_swiglu / moe_down_combine kernel µs (profiled medians) in the two-launch "
        "layer; bits: every f32 output row bit-equal to the default tiles' at T = 6 (row invariance across tiles)")
    say.table("I", "T", "up tiles", "up µs", "down tiles", "down µs", "bits")
    for shape in (run.shape,) + (() if run.smoke else (moe_shape(cfg, 2 * tp),)):
        at = layers if shape == run.shape else [make_layer(jax.random.key(10 + l), shape) for l in range(run.n_layers)]
        x6 = jax.random.normal(jax.random.key(77), (6, shape.d), F32).astype(BF16)
        f32_out = jax.jit(lambda x, p, tuning: pallas_layer(x, p, shape, experts=tuning, dtype=F32), static_argnums=2)
        bits = lambda x, tuning: np.asarray(f32_out(x, at[0], tuning)).view(np.uint32)
        ref6 = bits(x6, ExpertTuning())
        for t in run.ts[:2] + (() if run.smoke else (4,)):
            xs = run.inputs(300, t, shape)
            for up, down in TILES[:2] if run.smoke else TILES:
                tuning = ExpertTuning(**up, **down)
                fn = lambda x, p, tuning=tuning: pallas_layer(x, p, shape, experts=tuning)
                try:
                    same = bool((bits(x6[:t], tuning) == ref6[:t]).all())
                    us = kernel_us(loop_over_layers(fn, max(1, run.n_iter // 4)), at, xs)
                except jax.errors.JaxRuntimeError as err:  # e.g. a tile that overflows shared memory
                    say.row(shape.i, t, up, f"failed: {str(err).splitlines()[0][:80]}", down, "", "")
                    continue
                say.row(shape.i, t, up or "default", f"{us.get('moe_up_swiglu', float('nan')):.2f}", down or "default",
                        f"{us.get('moe_down_combine', float('nan')):.2f}", "equal" if same else "DIFFER")
                run.check(same, f"tile bits I={shape.i} T={t} {up} {down}")


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "tp", "smoke", "out", model="flash")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model = "tiny"
    cfg = config_of(args.model)
    shape = moe_shape(cfg, args.tp)
    # --smoke: T = 1 (the one-token path) and T = 6 (the align's); the kernels at T = 16 are tests/test_pallas_moe.py's
    run = Run(shape, args.smoke, Report(args.out), n_layers=2 if args.smoke else 8,
              ts=(1, 6) if args.smoke else (1, 6, 16), n_iter=1 if args.smoke else 30, reps=1 if args.smoke else 7)
    routing = shape.routing
    heading(run.say, f"MoE layer: {args.model} at TP{args.tp} (D {shape.d}, I {shape.i}, {shape.e} experts, top "
                     f"{routing['top_k']}, {routing['n_group']} groups / top {routing['topk_group']}, shared "
                     f"{shape.shared})")
    correctness(run)
    bw = bandwidth(run)
    layers = [make_layer(jax.random.key(10 + l), shape) for l in range(run.n_layers)]
    glue_per_t = routers(run, layers, bw)
    whole_layers(run, layers, bw, glue_per_t)
    tiles(run, cfg, args.tp, layers)
    run.say(f"\ncorrectness failures: {run.fails or 'none'}")
    return 1 if run.fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
