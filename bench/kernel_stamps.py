"""Where a T = 1 MoE layer's time goes, program by program: in-kernel timestamps on the GPU.

    python bench/kernel_stamps.py --out stamps.md     # Flash's layer at TP1 (I = 768)
    python bench/kernel_stamps.py --tp 2              # a TP2 device's expert width (I = 384)
    python bench/kernel_stamps.py --smoke             # tiny preset, interpret mode (every stamp reads 0): a CPU check

The profiler gives each launch's span; this gives its programs'. Through lingjax.pallas.instrument.instrumented, each
probed
launch (the router's GEMV, the decode's up kernel, the down kernel) gets one more output holding, per program, its
SM and (%globaltimer, %clock) at its start (before griddepcontrol.wait), after the wait, after the routed up
programs' expert selection (the up kernel's `selected` hook) and at its end (after a CTA barrier: every thread's
stores issued). bench/moe_bench.py's 8 cold layers run chained, as the model runs them (each input depends on the
previous layer's output; independent layers let XLA launch all the GEMVs first). It prints, per launch and program
group, the spread of starts, selections and ends in µs from the layer's first GEMV program, and each program's
phases from its SM clock: medians over layers 1-6 and --runs runs; then the layers' period (first GEMV program to
the next layer's) against the layer's byte floor at a read probe's bandwidth measured in the same run.

%globaltimer ticks every 32 ns on the H200. A probe adds a barrier and a few stores a program; the probed layer's
output is checked bit-equal to the unprobed one's (exit status 1 if not).
"""

from __future__ import annotations

import math
import sys

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
from moe_bench import make_layer

import lingjax.pallas
from common import Report, add_options, config_of, heading, moe_layer_bytes, moe_shape, parser, read_bandwidth
from lingjax import target
from lingjax.execution import step_compiler_options
from lingjax.pallas import moe_experts
from lingjax.pallas.grid_dependency import wait_p

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


class Probe(lingjax.pallas.instrument.Instrument):
    """The instrument of lingjax.pallas.instrument.instrumented: the launches named in PROBED carry a stamp table each,
    and the
    decode's selection a stamp after it; `tables` collects (name, table) as the kernels are traced. Every other launch
    is the default instrument's."""

    def __init__(self):
        self.tables, self._at = [], None

    def launch(self, kernel, *, out_shape, grid, name=None, **kw):
        if name not in PROBED:
            return super().launch(kernel, out_shape=out_shape, grid=grid, name=name, **kw)
        single = not isinstance(out_shape, (list, tuple))
        shapes = [out_shape] if single else list(out_shape)
        table = jax.ShapeDtypeStruct((math.prod(grid), len(COLUMNS)), jnp.int32)

        def body(*refs):
            ts_ref, pid = refs[-1], 0
            for axis, size in enumerate(grid):
                pid = pid * size + pl.program_id(axis)
            start_g, start_c, sm = stamp(pid)
            wait_p.bind()  # the wait the default launch puts first (after_producers), here between two stamps
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

    def selected(self, expert):
        """The up kernel's selected expert, stamped (stored here: the selection runs inside a pl.when branch it
        cannot leave)."""
        if self._at is not None:
            ts_ref, pid = self._at
            g, c, _ = stamp(expert)
            _store(ts_ref, pid, COL["select_g"], (g, c))
        return expert


def chained_layers(layers, xs, shape, interpret, probe=None):
    """Runs the T = 1 layers chained (each input + 1e-30 x the previous output): (outputs, stamp tables per layer)."""
    routed = moe_experts.routed_experts.__wrapped__  # unjitted: the probe's tables leave through this jit

    def run(layers, xs):
        outs, tables = [], []
        for x, p in zip(xs, layers):
            if outs:
                x = (x.astype(jnp.float32) + 1e-30 * outs[-1]).astype(x.dtype)
            if probe is not None:
                probe.tables.clear()
            outs.append(routed(x, p["router"], p["bias"], p["wg"], p["wu"], p["wd"], shape.limit, **shape.routing,
                               shared=(p["sg"], p["su"], p["sd"]), shared_limit=shape.shared_limit,
                               interpret=interpret))
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


def report(say, runs, shape, n_layers, bw) -> None:
    """The phase table by launch and program group, then the layer period against the byte floor."""
    ghz = clock_ghz(runs)
    tiles = shape.i // moe_experts.one_token_tiles(shape.i).bn_up
    table = phases(runs, shape.routing["top_k"] * tiles, ghz)
    say(f"SM clock {ghz:.2f} GHz (against globaltimer); µs from the layer's first GEMV program, medians over layers "
        f"1-{n_layers - 2} and {len(runs)} runs")
    keys = sorted(table, key=lambda k: (PROBED.index(k[0]), k[1] != "routed"))  # launch order
    say.table("", *(f"{name} ({group})" for name, group in keys))
    points = [f"{p} {s}" for p in ("start", "wait", "select", "end") for s in ("min", "median", "max")]
    spans = [f"{p} µs {s}" for p in ("wait", "select", "stream", "work") for s in ("median", "max")]
    for r in ["programs", "SMs"] + points + spans:
        fmt = (lambda v: f"{v:.0f}") if r in ("programs", "SMs") else (lambda v: f"{v:.2f}")
        say.row(r, *(fmt(np.median(table[k][r])) if r in table[k] else "" for k in keys))
    nbytes = moe_layer_bytes(shape, shape.routing["top_k"])  # T = 1 touches top_k distinct experts
    period = float(np.median(periods(runs)))
    say()
    say(f"layer period (first GEMV program to the next layer's): median {period:.2f} µs = "
        f"{period / (nbytes / bw * 1e6):.2f}x its byte floor ({nbytes / 1e6:.1f} MB at the read probe's "
        f"{bw / 1e12:.2f} TB/s, the larger of two)")


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "tp", "smoke", "out", model="flash")
    ap.add_argument("--runs", type=int, default=6)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.runs = "tiny", 1
    shape = moe_shape(config_of(args.model), args.tp)
    n_layers = 3 if args.smoke else 8
    interpret = args.smoke or target.platform() != "gpu"
    layers = [make_layer(jax.random.key(10 + l), shape) for l in range(n_layers)]
    xs = [jax.random.normal(jax.random.key(500 + l), (1, shape.d), jnp.float32).astype(jnp.bfloat16)
          for l in range(n_layers)]
    want, _ = chained_layers(layers, xs, shape, interpret)(layers, xs)
    probe = Probe()
    with lingjax.pallas.instrument.instrumented(probe):
        probed = chained_layers(layers, xs, shape, interpret, probe)
        got, _ = probed(layers, xs)
        runs = [jax.device_get(probed(layers, xs)[1]) for _ in range(args.runs)]
    same = all(bool((np.asarray(a) == np.asarray(b)).all()) for a, b in zip(got, want))
    say = Report(args.out)
    heading(say, f"T = 1 MoE layer stamps: {args.model} at TP{args.tp} (D {shape.d}, I {shape.i}, E {shape.e}), "
                 f"{n_layers} layers chained{', interpret mode' if interpret else ''}")
    say(f"probed output bit-equal to the unprobed: {same}")
    bw = max(read_bandwidth(1 << 19) if interpret else read_bandwidth() for _ in range(2))
    report(say, runs, shape, n_layers, bw)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
