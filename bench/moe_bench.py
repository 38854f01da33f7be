"""One Flash-size MoE layer (D=2560, I=768, E=512, top-8, 8 groups / top-4, shared 768) on one GPU.

In one process: (1) correctness of the Pallas router, align and experts against lingjax.ops.moe on the GPU; (2) the
bandwidth every byte floor below uses, the fastest of a read probe (twice) and two copies; (3) the router variants
(ROUTERS) alone and router + the align launch the expert kernels need at T > 1, at T in {1, 6, 16}, each checked
against the reference; (4) whole MoE layers: plain XLA (ops.moe route + experts_gathered + mlp), the previous
Pallas path (LEGACY bf16 router, shared expert fused into the expert kernels), the two-launch router (the f32 router
with default options) + fused_experts (which makes its own align plan, shared fused), the model's path (routed_experts
as lingjax.model.MoE calls it: at T = 1 the up kernel routes the token, above T = 1 the two-launch path), the
model path again with its loop compiled as the step programs are (lingjax.runtime.step_compiler_options: command
buffers around the loop, programmatic dependent launch), and with those options but PDL off, and the
model path's kernels one by one (profiled); (5) fused_experts' tiles in the two-launch layer: the up and down
kernels' profiled times per tile pair at T in {1, 4, 6}, at I = 768 and at a TP2 device's I = 384, and each pair's
rows checked bit-equal to the default's (row invariance).

Timing is in-graph: a jitted fori_loop over 8 layers whose weights are distinct arrays (24 GB, so L2 never
holds them), medians over repeated calls. Each layer's input is a fixed random x plus 1e-30 × the previous
layer's output (bit-identical after rounding, but not loop-invariant), so routing is fixed per layer and
the distinct-expert count of the floor is exact: floor = (distinct + shared) × 11.80 MB + router 2.62 MB, over
the larger of the bandwidth probes and the fastest rate any timed layer read its own bytes at (a probe can
read slower than the layers stream; a floor must not be beaten).

    python bench/moe_bench.py --out results.md          # GPU
    python bench/moe_bench.py --smoke                   # CPU, tiny dims, interpret mode (script check)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from lingjax import profiling, target
from lingjax.ops import moe as moe_ops
from lingjax.pallas.moe_align import BLOCK_M, align_reference, moe_align
from lingjax.pallas.moe_experts import fused_experts, routed_experts
from lingjax.pallas.moe_router import LEGACY, route
from lingjax.runtime import step_compiler_options
from measure import median_seconds, read_bandwidth, rel  # bench/measure.py, beside this script
from report import Report  # bench/report.py, beside this script

F32, BF16 = jnp.float32, jnp.bfloat16
LIMIT, SHARED_LIMIT = 4.0, 5.0  # the Flash clamps of the late layers (ling3_architecture.md §6.3)
FLASH_DIMS = dict(d=2560, i=768, e=512)  # hidden, expert intermediate, experts
ROUTING = dict(top_k=8, n_group=8, topk_group=4, scaling=2.5, renormalize=True)  # Flash's noaux_tc routing
ROUTERS = {  # name -> route() options; "legacy" is the first version, the rest the vector select kernel
    "legacy": dict(LEGACY),
    "default": {},  # K split 10 of 256, be 16, 4 select warps per token
    "ks=2 bk=256": dict(k_splits=2, bk=256),
    "ks=5 bk=512": dict(k_splits=5, bk=512),  # the default before 2026-12-01's run4
    "be=32": dict(be=32),
    "select 1 warp": dict(select_warps=1),
    "select 2 warps": dict(select_warps=2),
}

# (up, down) tile pairs of the sweep, the first the defaults; the rest each the best of a wider sweep at some
# T or width (bench/results/moe_h200_2026-12-01.md), or the previous defaults (32 x 256 / 64 x 256). The up
# tiles 32 x 256 and 64 x 256 at 3 stages are also the decode's (moe_experts.one_token_tiles at TP2's and TP1's
# width): the sweep's bit check holds their T = 1 rows to the default tiles' T = 6 rows (row invariance)
UP_TILES = [{}, dict(bn_up=32, bk_up=256, stages_up=3), dict(bn_up=64, bk_up=128, stages_up=4),
            dict(bn_up=64, bk_up=256, stages_up=3), dict(bn_up=16, bk_up=256, stages_up=4)]
DOWN_TILES = [{}, dict(bn_down=64, bk_down=256, stages_down=3), dict(bn_down=64, bk_down=128, stages_down=4),
              dict(bn_down=128, bk_down=128, stages_down=3), dict(bn_down=32, bk_down=128, stages_down=4)]


def kernel_us(fn, *args) -> dict:
    """Median duration per kernel name (µs) in a profile of fn(*args), after one untimed call."""
    jax.block_until_ready(fn(*args))
    per = collections.defaultdict(list)
    for k in profiling.traced_kernels(fn, *args):
        per[k.name].append(k.dur_us)
    return {name: statistics.median(v) for name, v in per.items()}


def layer_bytes(distinct, d, i, e):
    """A layer's byte floor: the distinct routed experts and the shared one (gate, up, down) and the router
    weight, in bf16."""
    return ((distinct + 1) * 3 * i * d + e * d) * jnp.dtype(BF16).itemsize


def make_layer(key, d, i, e):
    ks = jax.random.split(key, 8)
    w = lambda k, shape, fan_in: (jax.random.normal(k, shape, BF16) * fan_in**-0.5).astype(BF16)
    return dict(router=w(ks[0], (e, d), d), bias=0.1 * jax.random.normal(ks[1], (e,), F32),
                wg=w(ks[2], (e, i, d), d), wu=w(ks[3], (e, i, d), d), wd=w(ks[4], (e, d, i), i),
                sg=w(ks[5], (i, d), d), su=w(ks[6], (i, d), d), sd=w(ks[7], (d, i), i))


def xla_layer(x, p, cfg):
    weights, experts = moe_ops.route(x, p["router"], p["bias"], **cfg)
    y = moe_ops.experts_gathered(x, p["wg"], p["wu"], p["wd"], weights, experts, LIMIT)
    return (y + moe_ops.mlp(x, p["sg"], p["su"], p["sd"], SHARED_LIMIT)).astype(x.dtype)


def pallas_layer(x, p, cfg, router, precision="f32", tiles=None, interpret=None, dtype=None):
    """The Pallas layer with the shared expert fused into the expert kernels (as the model runs it); fused_experts
    makes its own align plan (an align launch at T > 1, none at T = 1). Rounded to `dtype` (default x's)."""
    weights, experts = route(x, p["router"], p["bias"], precision=precision, interpret=interpret, **cfg, **router)
    y = fused_experts(x, p["wg"], p["wu"], p["wd"], weights, experts, LIMIT, shared=(p["sg"], p["su"], p["sd"]),
                      shared_limit=SHARED_LIMIT, interpret=interpret, **(tiles or {}))
    return y.astype(dtype or x.dtype)


def model_layer(x, p, cfg, dtype=None):
    """The layer as lingjax.model.MoE runs it: routed_experts (at T = 1 the up kernel routes the token, no
    select launch; above, the default router then fused_experts), the shared expert fused."""
    y = routed_experts(x, p["router"], p["bias"], p["wg"], p["wu"], p["wd"], LIMIT, **cfg,
                       shared=(p["sg"], p["su"], p["sd"]), shared_limit=SHARED_LIMIT)
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny dims, interpret mode, for a CPU check")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    smoke = args.smoke
    d, i, e = (64, 32, 64) if smoke else (FLASH_DIMS["d"], FLASH_DIMS["i"], FLASH_DIMS["e"])
    n_layers = 2 if smoke else 8
    cfg = ROUTING
    ts = (1, 6) if smoke else (1, 6, 16)
    ts_all = (1, 6, 16)  # the router section is cheap: T = 16 (NP past the pair-axis align) in the smoke run too
    n_iter, reps = (1, 1) if smoke else (30, 7)
    fails = []
    say = Report(args.out)

    dev = jax.devices()[0]
    say(f"# MoE layer on {dev.device_kind} ({jax.default_backend()})")
    say(f"date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, jax {jax.__version__}")
    say(f"command: python bench/moe_bench.py{' --smoke' if smoke else ''}")

    # (1) correctness on this device
    say("\n## correctness")
    small = dict(d=256, i=128, e=32) if not smoke else dict(d=64, i=32, e=16)
    for t in sorted(set(ts + (16,))):
        ks = jax.random.split(jax.random.key(100 + t), 4)
        p32 = jax.tree.map(lambda a: a.astype(F32), make_layer(ks[0], small["d"], small["i"], small["e"]))
        x = jax.random.normal(ks[1], (t, small["d"]), F32)
        cfg_s = dict(cfg, n_group=4, topk_group=2)
        with jax.default_matmul_precision("highest"):
            rw, re = moe_ops.route(x, p32["router"], p32["bias"], **cfg_s)
            ref = moe_ops.experts_gathered(x, p32["wg"], p32["wu"], p32["wd"], rw, re, LIMIT)
        gw, ge = route(x, p32["router"], p32["bias"], **cfg_s)
        got = fused_experts(x, p32["wg"], p32["wu"], p32["wd"], rw, re, LIMIT)
        ok = bool((ge == re).all()) and rel(gw, rw) < 1e-5 and rel(got, ref) < 1e-5
        say(f"f32 small T={t}: router ids equal {bool((ge == re).all())}, weights {rel(gw, rw):.1e}, "
            f"experts {rel(got, ref):.1e} {'PASS' if ok else 'FAIL'}")
        fails += [] if ok else [f"f32 T={t}"]
    flash = make_layer(jax.random.key(0), d, i, e)
    for t in sorted(set(ts + (16,))):
        x = jax.random.normal(jax.random.key(200 + t), (t, d), F32).astype(BF16)
        with jax.default_matmul_precision("highest"):
            rw, re = moe_ops.route(x, flash["router"], flash["bias"], **cfg)
        ew = moe_ops.experts_gathered(x, flash["wg"], flash["wu"], flash["wd"], rw, re, LIMIT)
        sh = moe_ops.mlp(x, flash["sg"], flash["su"], flash["sd"], SHARED_LIMIT)
        gw, ge = route(x, flash["router"], flash["bias"], **cfg)
        bw_, be_ = route(x, flash["router"], flash["bias"], precision="bf16", **cfg)
        got = fused_experts(x, flash["wg"], flash["wu"], flash["wd"], rw, re, LIMIT)
        fused = fused_experts(x, flash["wg"], flash["wu"], flash["wd"], rw, re, LIMIT,
                              shared=(flash["sg"], flash["su"], flash["sd"]), shared_limit=SHARED_LIMIT)
        routed = model_layer(x, flash, cfg, dtype=F32)
        two = pallas_layer(x, flash, cfg, {}, dtype=F32)
        agree = float(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(np.asarray(be_), np.asarray(re))]))
        same = bool((np.asarray(routed) == np.asarray(two)).all())
        ok = bool((ge == re).all()) and rel(got, ew) < 1e-2 and rel(fused, ew + sh) < 1e-2 and same
        say(f"bf16 Flash T={t}: f32 router ids equal {bool((ge == re).all())} (weights {rel(gw, rw):.1e}), bf16 "
            f"router id-set agreement {agree:.3f}, experts {rel(got, ew):.1e}, +shared fused "
            f"{rel(fused, ew + sh):.1e}, routed_experts bit-equal to route + fused_experts {same} {'PASS' if ok else 'FAIL'}")
        fails += [] if ok else [f"flash T={t}"]
    for name, ex in [("random", jax.random.randint(jax.random.key(7), (8, 8), 0, e, jnp.int32)),
                     ("one expert", jnp.full((8, 8), 5, jnp.int32)), ("NP=1", jnp.array([[3]], jnp.int32))]:
        got = moe_align(ex, block_m=16)
        want = align_reference(ex, 16, got[1].shape[0])
        ok = all(bool((a == b).all()) for a, b in zip(got, want))
        say(f"align {name}: {'PASS' if ok else 'FAIL'}")
        fails += [] if ok else [f"align {name}"]

    # (2) bandwidth: a floor must not be beatable, so it takes the fastest of a read probe (measured twice,
    # bench/measure.py) and two copies (read + write); the layer mostly reads weights
    rates = {}
    copy = jax.jit(lambda a: a * 1.5)
    for dt in (BF16, F32):
        big = jnp.ones(((2**20 if smoke else 2**32) // jnp.dtype(dt).itemsize,), dt)
        rates[f"{jnp.dtype(dt).name} copy"] = 2 * big.nbytes / median_seconds(copy, big, reps=reps * 2)
        del big
    for n in (1, 2):
        rates[f"bf16 read {n}"] = read_bandwidth(1 << 19) if smoke else read_bandwidth()
    bw = max(rates.values())
    say(f"\nbandwidth ({'tiny' if smoke else '4 GiB'} arrays; copy: x*1.5, read: an f32 sum of bf16): " +
        ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in rates.items())
        + f"; floors use the largest, {bw / 1e12:.2f} TB/s")
    layers = [make_layer(jax.random.key(10 + l), d, i, e) for l in range(n_layers)]
    router_b = e * d * jnp.dtype(BF16).itemsize

    # (3) router variants, alone and with the align launch (what the expert kernels need at T > 1), in-graph
    say("\n## router variants (per layer, in-graph over %d layers; floor: router weight %.2f MB bf16 = %.2f µs)"
        % (n_layers, router_b / 1e6, router_b / bw * 1e6))
    say("f32 router on bf16 x and weight (the model's path); + align launch: moe_align on the router's ids, as "
        "fused_experts runs it at T > 1 (pair-axis kernel for T·k ≤ 64; T = 16 takes the sort fallback); none at "
        "T = 1; ids vs ops.moe.route")
    say("| T | variant | router µs | router + align launch µs | ids equal |")
    say("|---|---|---|---|---|")
    glue = loop_over_layers(lambda x, p: x, n_iter * 4)
    best_router, glue_per_t = {}, {}
    for t in ts_all:
        xs = [jax.random.normal(jax.random.key(600 + 10 * t + l), (t, d), F32).astype(BF16) for l in range(n_layers)]
        glue_s = glue_per_t[t] = median_seconds(glue, layers, xs, reps=reps) / (4 * n_iter * n_layers)
        with jax.default_matmul_precision("highest"):
            want = moe_ops.route(xs[0], layers[0]["router"], layers[0]["bias"], **cfg)[1]
        for name, router in [(n, r) for n, r in ROUTERS.items()] + [("legacy bf16", dict(ROUTERS["legacy"]))]:
            precision = "bf16" if name.endswith("bf16") else "f32"
            same = bool((route(xs[0], layers[0]["router"], layers[0]["bias"], precision=precision, **cfg,
                               **router)[1] == want).all())
            alone = lambda x, p, r=router, pr=precision: (x.astype(F32) + 1e-30 * route(
                x, p["router"], p["bias"], precision=pr, **cfg, **r)[0].sum()).astype(x.dtype)

            def aligned(x, p, r=router, pr=precision):
                weights, experts = route(x, p["router"], p["bias"], precision=pr, **cfg, **r)
                blk = moe_align(experts, block_m=BLOCK_M)[1]
                return (x.astype(F32) + 1e-30 * (weights.sum() + blk[0])).astype(x.dtype)

            per_layer = lambda fn: median_seconds(loop_over_layers(fn, 4 * n_iter), layers, xs, reps=reps) / (
                4 * n_iter * n_layers) - glue_s
            sec_alone = per_layer(alone)
            sec_align = per_layer(aligned) if t > 1 else None
            say(f"| {t} | {name} | {sec_alone * 1e6:.1f} | {'-' if sec_align is None else f'{sec_align * 1e6:.1f}'} | "
                f"{same} |")
            fails += [] if same else [f"router {name} T={t}"]
            if same and name not in ("legacy", "legacy bf16") and (t not in best_router or sec_alone < best_router[t][0]):
                best_router[t] = (sec_alone, name)
        say(f"T={t}: loop glue {glue_s * 1e6:.1f} µs per layer (subtracted); fastest correct new variant: "
            f"{best_router[t][1]}")

    # (4) whole layers
    say("\n## whole MoE layer (router + routed + shared), per layer, cold weights over %d layers" % n_layers)
    say("previous: LEGACY router in bf16 + shared fused; two launches: the f32 router (route, default options) + "
        "fused_experts, shared fused; model path: routed_experts as the model calls it (at T = 1 the up kernel routes "
        "the token, no select launch; above T = 1 the same as two launches); fused_experts makes its own align plan "
        "(a launch at T > 1)")
    say("the loop's glue: the 1e-30 input update of each layer (one small fusion, not in the model), the router "
        "rows' figure at the same T, subtracted")
    say("step options: the model path's loop compiled with lingjax.runtime.step_compiler_options (the step "
        "programs' command buffers and programmatic dependent launch); PDL off: the same with xla_gpu_enable_pdl=false")
    say("| T | distinct experts | floor µs | XLA gather µs (x floor) | Pallas previous µs (x floor) | "
        "Pallas two launches µs (x floor) | Pallas model path µs (x floor) | model path less the loop's glue µs "
        "(x floor) | speed-up vs previous | step options µs (x floor) | step options, PDL off µs (x floor) |")
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    step_opts = [step_compiler_options(), step_compiler_options(xla_options=(("xla_gpu_enable_pdl", False),))]
    if target.platform() != "gpu":  # the smoke run: no GPU options to apply
        step_opts = [None, None]
    model_path = lambda x, p: model_layer(x, p, cfg)
    breakdown, rows = {}, []
    for t in ts:
        xs = [jax.random.normal(jax.random.key(400 + 10 * t + l), (t, d), F32).astype(BF16) for l in range(n_layers)]
        dist = np.mean([len(np.unique(np.asarray(moe_ops.route(x, p["router"], p["bias"], **cfg)[1])))
                        for x, p in zip(xs, layers)])
        res = []
        for fn, opts in ((lambda x, p: xla_layer(x, p, cfg), None),
                         (lambda x, p: pallas_layer(x, p, cfg, ROUTERS["legacy"], precision="bf16"), None),
                         (lambda x, p: pallas_layer(x, p, cfg, ROUTERS["default"]), None),
                         (model_path, None), (model_path, step_opts[0]), (model_path, step_opts[1])):
            res.append(median_seconds(loop_over_layers(fn, n_iter, opts), layers, xs, reps=reps) / (n_iter * n_layers))
        rows.append((t, dist, layer_bytes(dist, d, i, e), glue_per_t[t], res))
        breakdown[t] = kernel_us(loop_over_layers(model_path, max(1, n_iter // 4)), layers, xs)
    # a floor the layers beat is no floor: the probes above have read slower than the T = 16 layer streams
    # (bench/results/moe_h200_2026-12-01_run3.md), so the layers' own best rate joins them
    layer_bw = max(nbytes / sec for _, _, nbytes, _, res in rows for sec in res)
    floor_bw = max(bw, layer_bw)
    for t, dist, nbytes, glue_s, res in rows:
        floor = nbytes / floor_bw
        cell = lambda sec: f"{sec * 1e6:.1f} ({sec / floor:.2f}x)"
        say(f"| {t} | {dist:.1f} | {floor * 1e6:.1f} | {cell(res[0])} | {cell(res[1])} | {cell(res[2])} | "
            f"{cell(res[3])} | {cell(res[3] - glue_s)} | {res[1] / res[3]:.2f}x | {cell(res[4])} | {cell(res[5])} |")
    say(f"floors at {floor_bw / 1e12:.2f} TB/s: the larger of the probes' {bw / 1e12:.2f} and the fastest any layer "
        f"above read its bytes, {layer_bw / 1e12:.2f}")
    say("\nmodel path, kernel by kernel (profiled medians, µs; one launch each per layer):")
    for t, us in breakdown.items():
        say(f"T={t}: " + ", ".join(f"{name} {v:.2f}" for name, v in sorted(us.items(), key=lambda kv: -kv[1])))

    # (5) tile sweep: kernel times from a profile, at the full width and at a TP2 device's half
    say("\n## fused_experts tiles: moe_up_swiglu / moe_down_combine kernel µs (profiled medians) in the two-launch "
        "layer; bits: every f32 output row bit-equal to the default tiles' at T = 6 (row invariance across tiles)")
    say("| I | T | up tiles | up µs | down tiles | down µs | bits |")
    say("|---|---|---|---|---|---|---|")
    for i_dim in (i, i // 2):
        half = layers if i_dim == i else [make_layer(jax.random.key(10 + l), d, i_dim, e) for l in range(n_layers)]
        x6 = jax.random.normal(jax.random.key(77), (6, d), F32).astype(BF16)
        f32_out = jax.jit(lambda x, p, tiles: pallas_layer(x, p, cfg, {}, tiles=dict(tiles), dtype=F32),
                          static_argnums=2)
        bits = lambda x, tiles: np.asarray(f32_out(x, half[0], tuple(tiles.items()))).view(np.uint32)
        ref6 = bits(x6, {})
        for t in ts[:2] + ((4,) if not smoke else ()):
            xs = [jax.random.normal(jax.random.key(300 + 10 * t + l), (t, d), F32).astype(BF16) for l in range(n_layers)]
            for up, down in zip(UP_TILES, DOWN_TILES):
                fn = lambda x, p, tiles={**up, **down}: pallas_layer(x, p, cfg, {}, tiles=tiles)
                try:
                    same = bool((bits(x6[:t], {**up, **down}) == ref6[:t]).all())
                    us = kernel_us(loop_over_layers(fn, max(1, n_iter // 4)), half, xs)
                except jax.errors.JaxRuntimeError as err:  # e.g. a tile that overflows shared memory
                    say(f"| {i_dim} | {t} | {up} | failed: {str(err).splitlines()[0][:80]} | {down} | | |")
                    continue
                say(f"| {i_dim} | {t} | {up} | {us.get('moe_up_swiglu', float('nan')):.2f} | {down} | "
                    f"{us.get('moe_down_combine', float('nan')):.2f} | {'equal' if same else 'DIFFER'} |")
                fails += [] if same else [f"tile bits I={i_dim} T={t} {up} {down}"]

    say(f"\ncorrectness failures: {fails or 'none'}")


if __name__ == "__main__":
    main()
