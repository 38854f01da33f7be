"""Where a T = 1 MoE layer's time goes, program by program: in-kernel timestamps on the GPU.

The profiler gives each launch's span; this gives its programs'. Each probed launch (the router's GEMV, the
decode's up kernel, the down kernel) gets one more output holding, per program, its SM and (%globaltimer,
%clock) at its start (before griddepcontrol.wait), after the wait, after the routed up programs' expert
selection (moe_router.token_expert) and at its end (after a CTA barrier: every thread's stores issued).
bench/moe_bench.py's 8 cold Flash-size layers run chained, as the model runs them (each input depends on the
previous layer's output; independent layers let XLA launch all the GEMVs first). It prints, per launch and
program group, the spread of starts, selections and ends in µs from the layer's first GEMV program, and each
program's phases from its SM clock: medians over layers 1-6 and 6 runs; then the layers' period (first GEMV
program to the next layer's) against the layer's byte floor at a read probe's bandwidth measured in the same run.

    python bench/kernel_stamps.py                 # Flash's experts at TP1 (I = 768)
    python bench/kernel_stamps.py --i-dim 384     # a TP2 device's expert width
    python bench/kernel_stamps.py --smoke         # tiny dims in interpret mode (every stamp reads 0): a CPU check

%globaltimer ticks every 32 ns on the H200. A probe adds a barrier and a few stores a program; the probed
layer's output is checked bit-equal to the unprobed one's. Results: bench/results/moe_h200_2026-12-01_run6.md,
run7 (the period).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import primitives as triton_primitives
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import lingjax.pallas.moe_experts as moe_experts  # noqa: E402
import lingjax.pallas.moe_router as moe_router  # noqa: E402
from lingjax import target  # noqa: E402
from lingjax.pallas.grid_dependency import wait_p  # noqa: E402
from lingjax.runtime import step_compiler_options  # noqa: E402
from measure import read_bandwidth  # noqa: E402
from moe_bench import FLASH_DIMS, LIMIT, ROUTING, SHARED_LIMIT, layer_bytes, make_layer  # noqa: E402

PROBED = ("moe_router_gemv", "moe_up_select", "moe_down_combine")
# a program's row of the extra output: (globaltimer, clock) pairs after its SM id
COLUMNS = ("sm", "start_g", "start_c", "wait_g", "wait_c", "end_g", "end_c", "unused", "select_g", "select_c")
COL = {c: j for j, c in enumerate(COLUMNS)}

stamp_p = jax_core.Primitive("kernel_stamp")
stamp_p.multiple_results = True


@stamp_p.def_effectful_abstract_eval
def _stamp_abstract(after):
    del after
    scalar = jax_core.ShapedArray((), jnp.int32)
    return (scalar, scalar, scalar), {triton_primitives.barrier_effect}  # kept, never moved or dropped


# interpret mode (the CPU check): every stamp reads 0
mlir.register_lowering(stamp_p, mlir.lower_fun(lambda after: (after * 0, after * 0, after * 0), multiple_results=True))


@triton_lowering.register_lowering(stamp_p)
def _stamp_lowering(ctx, after):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    asm = "{ .reg .u64 t; mov.u64 t, %globaltimer; cvt.u32.u64 $0, t; mov.u32 $1, %clock; mov.u32 $2, %smid; }"
    # `after` is an operand the asm does not read: it orders the stamp after the value it was computed from
    op = tt_dialect.elementwise_inline_asm([i32, i32, i32], asm, constraints="=r,=r,=r,r", pure=False,
                                           packed_element=1, args=[after])
    return list(op.owner.results) if hasattr(op, "owner") else list(op)


def stamp(after):
    """(globaltimer low 32 bits in ns, SM clock low 32 bits, SM id) once `after` (an int32 scalar) is computed."""
    return stamp_p.bind(jnp.asarray(after, jnp.int32).reshape(()))


def _store(ts_ref, pid, first, values):
    iota = jax.lax.broadcasted_iota(jnp.int32, (1, len(values)), 1)
    row = jnp.zeros((1, len(values)), jnp.int32)
    for j, v in enumerate(values):
        row = jnp.where(iota == j, v, row)
    ts_ref[pl.ds(pid, 1), pl.ds(first, len(values))] = row


class Probe:
    """Patches the modules' pallas_call so the launches named in PROBED carry a stamp table each, and the
    decode's selection a stamp after it; `tables` collects (name, table) as the kernels are traced."""

    def __init__(self):
        self.tables, self._at = [], None

    def pallas_call(self, original):
        def call(kernel, *, out_shape, grid, name=None, **kw):
            if name not in PROBED:
                return original(kernel, out_shape=out_shape, grid=grid, name=name, **kw)
            single = not isinstance(out_shape, (list, tuple))
            shapes = [out_shape] if single else list(out_shape)
            table = jax.ShapeDtypeStruct((math.prod(grid), len(COLUMNS)), jnp.int32)

            def body(*refs):
                ts_ref, pid = refs[-1], 0
                for axis, size in enumerate(grid):
                    pid = pid * size + pl.program_id(axis)
                start_g, start_c, sm = stamp(pid)
                wait_p.bind()  # the wait lingjax.pallas.pallas_call puts first, here between two stamps
                wait_g, wait_c, _ = stamp(pid)
                self._at = (ts_ref, pid)
                kernel(*refs[:-1])
                self._at = None
                if not kw.get("interpret"):
                    pltriton.debug_barrier()  # every thread's stores issued before the end stamp
                end_g, end_c, _ = stamp(pid)
                _store(ts_ref, pid, 0, (sm, start_g, start_c, wait_g, wait_c, end_g, end_c, 0))

            launch = pl.pallas_call(body, out_shape=shapes + [table], grid=grid, name=name, **kw)

            def run(*args):
                *outs, ts = launch(*args)
                self.tables.append((name, ts))
                return outs[0] if single else outs
            return run
        return call

    def token_expert(self, original):
        def select(*args, **kw):
            expert = original(*args, **kw)
            if self._at is not None:  # stored here: the selection runs inside a pl.when branch it cannot leave
                ts_ref, pid = self._at
                g, c, _ = stamp(expert)
                _store(ts_ref, pid, COL["select_g"], (g, c))
            return expert
        return select

    @contextlib.contextmanager
    def installed(self):
        saved = (moe_experts.pallas_call, moe_router.pallas_call, moe_experts.token_expert)
        moe_experts.pallas_call = self.pallas_call(saved[0])
        moe_router.pallas_call = self.pallas_call(saved[1])
        moe_experts.token_expert = self.token_expert(saved[2])
        try:
            yield self
        finally:
            moe_experts.pallas_call, moe_router.pallas_call, moe_experts.token_expert = saved


def chained_layers(layers, xs, interpret, probe=None):
    """Runs the T = 1 layers chained (each input + 1e-30 x the previous output): (outputs, stamp tables per layer)."""
    routed = moe_experts.routed_experts.__wrapped__  # unjitted: the probe's tables leave through this jit

    def run(layers, xs):
        outs, tables = [], []
        for x, p in zip(xs, layers):
            if outs:
                x = (x.astype(jnp.float32) + 1e-30 * outs[-1]).astype(x.dtype)
            if probe is not None:
                probe.tables.clear()
            outs.append(routed(x, p["router"], p["bias"], p["wg"], p["wu"], p["wd"], LIMIT, **ROUTING,
                               shared=(p["sg"], p["su"], p["sd"]), shared_limit=SHARED_LIMIT, interpret=interpret))
            tables.append(dict(probe.tables) if probe is not None else {})
        return outs, tables

    return jax.jit(run, compiler_options=None if interpret else step_compiler_options())


def _elapsed(later, earlier):
    """Ticks from `earlier` to `later` of a stamp's 32-bit counters (low 32 bits as stored), across a wrap."""
    return (np.asarray(later).astype(np.int64) - np.asarray(earlier).astype(np.int64)) % 2**32


def _first_gemv_start(layer) -> int:
    """A layer's reference time: its first GEMV program's start (globaltimer, low 32 bits as stored)."""
    return int(np.asarray(layer["moe_router_gemv"])[:, COL["start_g"]].astype(np.int64).min())


def phases(runs, routed_programs, clock_ghz):
    """{(launch, group): {phase: [value per layer and run]}} in µs: spreads from the layer's first GEMV start
    (globaltimer), per-program durations from the SM clock."""
    since = lambda v, ref: ((v.astype(np.int64) - ref + 2**31) % 2**32 - 2**31) / 1e3
    cycles = lambda t, a, b: _elapsed(t[:, COL[b]], t[:, COL[a]]) / (clock_ghz * 1e3)
    out = {}
    for tables in runs:
        for layer in tables[1:-1]:
            ref = _first_gemv_start(layer)
            for name, ts in layer.items():
                ts = np.asarray(ts)
                groups = {"all": ts}
                if name == "moe_up_select":
                    groups = {"routed": ts[:routed_programs], "shared": ts[routed_programs:]}
                for group, t in groups.items():
                    cell = out.setdefault((name, group), {})
                    add = lambda key, v: cell.setdefault(key, []).append(float(v))
                    add("programs", len(t))
                    add("SMs", len(np.unique(t[:, COL["sm"]])))
                    points = ("start", "wait") + (("select",) if group == "routed" else ()) + ("end",)
                    for point in points:
                        v = since(t[:, COL[point + "_g"]], ref)
                        for stat, f in (("min", np.min), ("median", np.median), ("max", np.max)):
                            add(f"{point} {stat}", f(v))
                    spans = [("wait", "start_c", "wait_c")] + (
                        [("select", "wait_c", "select_c"), ("stream", "select_c", "end_c")] if group == "routed"
                        else [("work", "wait_c", "end_c")])
                    for label, a, b in spans:
                        d = cycles(t, a, b)
                        for stat, f in (("median", np.median), ("max", np.max)):
                            add(f"{label} µs {stat}", f(d))
    return out


def periods(runs):
    """µs from the first GEMV program of each of layers 1..n-2 to the next layer's, in every run: a chained layer's
    time on the device, with the glue between layers and without a host loop's."""
    return [_elapsed(_first_gemv_start(b), _first_gemv_start(a)) / 1e3
            for tables in runs for a, b in zip(tables[1:-1], tables[2:])]


def clock_ghz(runs):
    """The SM clock's rate against globaltimer over programs that ran ≥ 3 µs (1.0 when none did: the CPU)."""
    rates = []
    for tables in runs:
        for layer in tables:
            for ts in layer.values():
                t = np.asarray(ts)
                ns = _elapsed(t[:, COL["end_g"]], t[:, COL["start_g"]])
                cyc = _elapsed(t[:, COL["end_c"]], t[:, COL["start_c"]])
                long = ns > 3000
                rates += list(cyc[long] / ns[long])
    return float(np.median(rates)) if rates else 1.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--i-dim", type=int, default=FLASH_DIMS["i"], help="expert width (768: TP1, 384: TP2)")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="tiny dims, interpret mode, for a CPU check")
    args = ap.parse_args(argv)
    d, i, e = (64, 32, 64) if args.smoke else (FLASH_DIMS["d"], args.i_dim, FLASH_DIMS["e"])
    n_layers = 3 if args.smoke else 8
    interpret = args.smoke or target.platform() != "gpu"
    layers = [make_layer(jax.random.key(10 + l), d, i, e) for l in range(n_layers)]
    xs = [jax.random.normal(jax.random.key(500 + l), (1, d), jnp.float32).astype(jnp.bfloat16) for l in range(n_layers)]
    want, _ = chained_layers(layers, xs, interpret)(layers, xs)
    probe = Probe()
    with probe.installed():
        probed = chained_layers(layers, xs, interpret, probe)
        got, _ = probed(layers, xs)
        runs = [jax.device_get(probed(layers, xs)[1]) for _ in range(1 if args.smoke else args.runs)]
    same = all(bool((np.asarray(a) == np.asarray(b)).all()) for a, b in zip(got, want))
    print(f"# T = 1 MoE layer stamps: D {d}, I {i}, E {e}, {n_layers} layers chained, "
          f"{'interpret mode' if interpret else jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"probed output bit-equal to the unprobed: {same}")
    ghz = clock_ghz(runs)
    tiles = i // moe_experts.one_token_tiles(i)["bn_up"]
    table = phases(runs, ROUTING["top_k"] * tiles, ghz)
    print(f"SM clock {ghz:.2f} GHz (against globaltimer); µs from the layer's first GEMV program, medians over "
          f"layers 1-{n_layers - 2} and {len(runs)} runs\n")
    keys = sorted(table, key=lambda k: (PROBED.index(k[0]), k[1] != "routed"))  # launch order
    print("| | " + " | ".join(f"{name} ({group})" for name, group in keys) + " |")
    print("|---|" + "---|" * len(keys))
    points = [f"{p} {s}" for p in ("start", "wait", "select", "end") for s in ("min", "median", "max")]
    spans = [f"{p} µs {s}" for p in ("wait", "select", "stream", "work") for s in ("median", "max")]
    for r in ["programs", "SMs"] + points + spans:
        fmt = (lambda v: f"{v:.0f}") if r in ("programs", "SMs") else (lambda v: f"{v:.2f}")
        print(f"| {r} | " + " | ".join(fmt(np.median(table[k][r])) if r in table[k] else "" for k in keys) + " |")
    nbytes = layer_bytes(ROUTING["top_k"], d, i, e)  # T = 1 touches top_k distinct experts
    bw = max(read_bandwidth(1 << 19) if interpret else read_bandwidth() for _ in range(2))
    period = float(np.median(periods(runs)))
    print(f"\nlayer period (first GEMV program to the next layer's): median {period:.2f} µs = "
          f"{period / (nbytes / bw * 1e6):.2f}x its byte floor ({nbytes / 1e6:.1f} MB at the read probe's "
          f"{bw / 1e12:.2f} TB/s, the larger of two)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
