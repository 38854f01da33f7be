"""KDA kernels on one GPU: correctness against the references, then timings against byte floors and fla's.

    python bench/kda_bench.py --fla-child --ts 1 6 16 > fla.jsonl        # fla (PyTorch + Triton), its own process
    python bench/kda_bench.py --fla-json fla.jsonl --out kda.md
    python bench/kda_bench.py --parts prefill --budget 90 --out kda_prefill.md
    python bench/kda_bench.py --smoke                                     # tiny preset, one of each kind: a CPU check

Shapes: one device's KDA layer of --model at --tp (Flash at TP1: 32 heads, K = V = 128, hidden 2560, 4 conv
taps), bf16 activations, f32 state. Method (docs/measuring.md): --rotations distinct input sets per graph (64 by
default: 128 MiB+ of state, past the H200's L2), in-graph timing (one jitted fori_loop whose body calls the kernel
on every set), medians of many runs; byte floors at the bandwidth of a bf16 copy measured in the same run. fla runs
first in a child process (--fla-child), CUDA-graph-captured over the same rotation so that JAX does not hold its
memory; its stdout, one JSON line of every figure so far per line, is this run's --fla-json.

Order, within --budget seconds for the JAX part: the chain-verify tunings (CHAIN_TUNINGS: ChainTuning values, the
default first, each checked against lingjax.ops.kda.kda_chain and timed at every --ts) until 60% of the budget; the
prefill at --prefill-len tokens (the default at bf16 inputs, its f32 path at f32 inputs, then PrefillTuning
alternatives); then, while the budget lasts, the XLA references, the rest of the chain tunings and more prefill
tunings. Ends with the chain tunings by T and the comparison with fla.

The chain rows are µs per call in XLA's loop, fla's per call in a PyTorch CUDA graph: ours also carry the gaps
between the loop's launches. Kernel against kernel: bench/ncu_kernels.py, or bench/kda_chain_ab.py --profile for
our kernel's own time inside this loop.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
import types
from pathlib import Path

from common import KDAShape, Report, add_options, config_of, heading, kda_shape, parser

VERIFY_ROWS = 16  # lingjax.config.VERIFY_ROWS (this module is also imported by the fla child, without jax)
START = 17  # the first row's position: T > 2 wraps the conv ring
# a chain-verify result further than this from the reference (max rel. error of o and the states) is a failure: f32
# math in another order stays near 1e-7, one bf16 ulp of a beta logit moves the states ~2e-4, a bug far more
CHAIN_TOL = 1e-3

# chain-verify tunings (label, ChainTuning fields): the default first, then the alternatives by promise
CHAIN_TUNINGS = [
    ("default", {}),
    ("BV16 w4", dict(block_v=16)),
    ("BV16 w2", dict(block_v=16, num_warps=2)),
    ("BV64 w4", dict(block_v=64)),
    ("BV8 w2", dict(block_v=8, num_warps=2)),
    ("BV32 w8", dict(num_warps=8)),
    ("BV8 w4", dict(block_v=8)),
    ("BV16 w4 x2 tiles", dict(block_v=16, tiles_per_program=2)),
    ("BV32 w4 x4 tiles (1 program per head at K = 128)", dict(tiles_per_program=4)),
]
# prefill tunings (PrefillTuning fields): the core set, timed first, then the rest while the budget lasts
PREFILL_CORE = [dict(block_k=32, blocks_warps=2), dict(blocks_warps=2), dict(block_k=32), dict(block_v=64)]
PREFILL_MORE = [dict(blocks_warps=4), dict(prepare_block_k=32), dict(chunk=32, block_v=16),
                dict(block_v=16, num_stages=1), dict(num_warps=8), dict(num_stages=1), dict(state_block_k=128),
                dict(block_k=64, blocks_warps=4), dict(chunk=32)]


def label_of(fields: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items()) or "default"


# ---------------------------------------------------------------- fla (PyTorch) child process
def fla_inputs(torch, shape: KDAShape, t: int, n: int, in_kernel: bool = False, dev: str = "cuda"):
    """fused_recurrent_kda's inputs for n rotating sets (each tensor with a leading axis n): the positional (q, k,
    v, g, beta), the keywords besides the state, and the states s. The plain form takes l2-normalised q, k, a gate
    g < 0 and beta in (0, 1); the in-kernel form (`in_kernel`: our kernel's fusions less the conv, as a serving
    stack calls it) takes raw q, k, f and beta's logits, with A_log and dt_bias, and does the l2norm, the safe gate
    and the sigmoid in its kernel."""
    h, d, bf = shape.heads, shape.dim, torch.bfloat16
    size = (n, 1, t, h, d)
    v, s = torch.randn(size, device=dev).to(bf), torch.randn(n, 1, h, d, d, device=dev)
    if in_kernel:
        q, k = (torch.randn(size, device=dev).to(bf) for _ in range(2))
        f, b = torch.randn(size, device=dev), torch.randn(n, 1, t, h, device=dev).to(bf)
        kw = dict(A_log=torch.log(torch.empty(h, device=dev).uniform_(1, 16)), dt_bias=torch.randn(h * d, device=dev),
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  lower_bound=shape.lower_bound)
        return (q, k, v, f, b), kw, s
    q, k = (torch.nn.functional.normalize(torch.randn(size, device=dev), dim=-1).to(bf) for _ in range(2))
    g = shape.lower_bound * torch.sigmoid(2 * torch.randn(size, device=dev))
    beta = torch.sigmoid(torch.randn(n, 1, t, h, device=dev)).to(bf)
    return (q, k, v, g, beta), {}, s


def _graph_time(torch, fn, calls: int, reps: int = 30) -> float:
    """µs per call of fn (which makes `calls` calls) captured in a CUDA graph: median of reps replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def _event_time(torch, fn, calls: int, reps: int = 15) -> float:
    """µs per call of fn (which makes `calls` calls) between CUDA events: median of reps runs after one."""
    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def fla_main(args, shape: KDAShape) -> None:
    """fla's fused_recurrent_kda (both forms) at every --ts and chunk_kda at --prefill-len: after each figure, one
    JSON line of every figure so far on stdout; "complete" in the last."""
    import torch
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    res, r = {}, args.rotations
    torch.manual_seed(0)
    for t in args.ts:
        for key, in_kernel in ((f"fused_recurrent_T{t}", False), (f"fused_recurrent_in_kernel_T{t}", True)):
            fargs, kw, s = fla_inputs(torch, shape, t, r, in_kernel)

            def run(fargs=fargs, kw=kw, s=s):
                for i in range(r):
                    fused_recurrent_kda(*(a[i] for a in fargs), initial_state=s[i], output_final_state=True, **kw)

            try:
                res[key] = _graph_time(torch, run, r)
            except Exception as e:  # report and go on
                res[key] = f"failed: {type(e).__name__}: {e}"[:300]
        print(json.dumps(res), flush=True)
    (q, k, v, g, beta), _, s = fla_inputs(torch, shape, args.prefill_len, 2)
    for safe in (False, True):
        kw = dict(safe_gate=True, lower_bound=shape.lower_bound) if safe else {}
        key = f"chunk_kda{'_safe' if safe else ''}_T{args.prefill_len}"

        def run_chunk(kw=kw):
            for i in range(2):
                chunk_kda(q[i], k[i], v[i], g[i], beta[i], initial_state=s[i], output_final_state=True, **kw)

        try:
            res[key] = _event_time(torch, run_chunk, 2)
        except Exception as e:
            res[key] = f"failed: {type(e).__name__}: {e}"[:300]
        res["complete"] = safe  # the last line says the child reached its end (a cut-off run is flagged)
        print(json.dumps(res), flush=True)


def load_fla(path) -> dict:
    """The fla child's figures: its output's last JSON line (each line holds every figure so far). "error" says when
    there is none, or when the child stopped before its last figure (its timeout cut it off)."""
    fla = None
    for line in Path(path).read_text().splitlines():
        try:
            fla = json.loads(line) if line.startswith("{") else fla
        except json.JSONDecodeError:  # a line torn by the kill
            pass
    if fla is None:
        return {"error": "no fla output"}
    if not fla.pop("complete", False):
        fla["error"] = ("the fla child stopped before its last figure (cut off by its timeout?): the figures it did "
                        "not reach show as None")
    return fla


# ---------------------------------------------------------------- the chain-verify harness (also kda_chain_ab, ncu)
def chain_harness(shape: KDAShape, rotations: int):
    """The chain-verify inputs and in-graph timing loop: the layer's fixed weights (conv_w, a_log, dt_bias), the gate
    config, `rotations` input sets per T, the kernel's positional arguments, and the timing loop."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    f32, bf16 = jnp.float32, jnp.bfloat16
    h, d, dm, w = shape.heads, shape.dim, shape.hidden, shape.conv
    p, ring_slots = h * d, VERIFY_ROWS + w - 1  # the conv ring (lingjax.cache)
    kw = jax.random.split(jax.random.key(1), 3)
    conv_w = 0.5 * jax.random.normal(kw[0], (3 * p, w), f32)
    a_log = jnp.log(jax.random.uniform(kw[1], (h,), minval=1, maxval=16))
    dt_bias = jax.random.normal(kw[2], (p,), f32)

    def inputs(t):
        """`rotations` sets of (proj [t, 5P] (the in_proj output: q|k|v|f read, g not), x [t, hidden], b_proj [H,
        hidden] (a layer's weight: rotated too), conv ring, state), each a list of distinct buffers: a slice of one
        stacked array would be copied."""
        ks = jax.random.split(jax.random.key(100 + t), 5)
        # x in {-2..2}/8 and b_proj in {-4..4}/32: every product and partial sum of beta's dot is exact in f32, so
        # the kernel's summation order cannot flip b's rounding to bf16 against the reference's
        xs = (jax.random.normal(ks[0], (rotations, t, 5 * p), bf16),
              (jax.random.randint(ks[1], (rotations, t, dm), -2, 3) / 8).astype(bf16),
              (jax.random.randint(ks[4], (rotations, h, dm), -4, 5) / 32).astype(bf16),
              jax.random.normal(ks[2], (rotations, ring_slots, 3 * p), bf16),
              jax.random.normal(ks[3], (rotations, h, d, d), f32))
        return tuple([a[r] for r in range(rotations)] for a in xs)

    def args(xs, r, al=None, ring=None):  # kda_chain_verify's positional arguments from rotation set r
        return (xs[0][r], xs[1][r], xs[2][r], xs[3][r] if ring is None else ring, START, conv_w,
                a_log if al is None else al, dt_bias, xs[4][r])

    def loop(fn, iters, compiler_options=None):
        """In-graph: per iteration, fn on each rotating input set (distinct buffers). The conv rings are carried
        (fn's third result), as the model's decode carries them: the kernel writes its ring in place, and a
        loop-invariant one XLA would copy before every call. compiler_options: the jit's (e.g. the step
        programs', lingjax.execution.step_compiler_options)."""
        @functools.partial(jax.jit, compiler_options=compiler_options)
        def run(xs):
            def body(i, carry):
                al = a_log + i.astype(f32) * 0.0  # keeps the calls inside the loop
                return tuple(fn(*args(xs, r, al, carry[r][2])) for r in range(rotations))
            shapes = jax.eval_shape(lambda: fn(*args(xs, 0)))
            init = tuple(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)[:2] + (xs[3][r],)
                         for r in range(rotations))
            return lax.fori_loop(0, iters, body, init)
        return run

    def floor_bytes(t):  # what one call must read and write
        return (h * d * d * 4 * (1 + t) + t * h * d * 4 + t * 5 * p * 2 + (t + h) * dm * 2 + (w - 1 + t) * 3 * p * 2
                + 3 * p * w * 4 + p * 4 + h * 4)

    cfg = dict(num_heads=h, safe_gate=shape.safe_gate, lower_bound=shape.lower_bound)

    def reference(xs, t):
        """lingjax.ops.kda.kda_chain on rotation set 0, op by op (not one jitted graph: compiled whole on the H200,
        XLA's b = x·b_projᵀ came out inexact where each op alone is exact on these inputs), at f32 precision."""
        from lingjax.ops import kda

        with jax.default_matmul_precision("highest"):
            return jax.device_get(kda.kda_chain(*args(xs, 0), tokens=t, **cfg)[:2])

    return types.SimpleNamespace(conv_w=conv_w, a_log=a_log, dt_bias=dt_bias, inputs=inputs, args=args, loop=loop,
                                 floor_bytes=floor_bytes, rotations=rotations, cfg=cfg, reference=reference)


# ---------------------------------------------------------------- the JAX side
class Budget:
    """--budget seconds for the JAX part: optional tasks stop once one more would not fit."""

    def __init__(self, seconds: float):
        self.start, self.seconds, self.longest = time.perf_counter(), seconds, 0.0

    def spent(self, share: float = 1.0) -> bool:  # this share is spent, or would be by one more task
        return time.perf_counter() - self.start + self.longest > share * self.seconds

    def run(self, task, *args):
        t0 = time.perf_counter()
        task(*args)
        self.longest = max(self.longest, time.perf_counter() - t0)


class Bench:
    """The JAX part's state: the shape, the measured bandwidth, the report, the rows timed so far."""

    def __init__(self, args, shape, say):
        import jax
        import jax.numpy as jnp
        from jax import lax

        from common import median_seconds

        self.args, self.shape, self.say, self.median_seconds = args, shape, say, median_seconds
        self.iters = 1 if args.smoke else 8  # loop iterations of a timed chain graph
        self.chain, self.prefill, self.fails = {}, [], []  # (label, T) -> row; [row]; [name]
        x = jnp.ones((1 << (20 if args.smoke else 30),), jnp.bfloat16) * 1.5  # 2 GiB (smoke: 2 MiB)

        @jax.jit
        def copy_loop(x, scale):  # scale is a runtime 1.0: XLA cannot fold the passes away
            return lax.fori_loop(0, 10, lambda i, y: y * scale, x)

        self.bw = 2 * x.nbytes * 10 / (self.us(copy_loop, (x, jnp.ones((), jnp.bfloat16)), 1, reps=7) * 1e-6)
        say(f"bf16 copy bandwidth (the floors'): {self.bw / 1e12:.2f} TB/s")

    def us(self, fn, args, calls, reps=15) -> float:  # µs per call of a graph that makes `calls` calls
        return self.median_seconds(fn, *args, reps=reps) * 1e6 / calls

    def row(self, part, t, label, us, floor_bytes, err=None, build_s=None) -> dict:
        floor = floor_bytes / self.bw * 1e6
        self.say.row(part, t, label, f"{us:.2f}", f"{floor:.2f}", f"{us / floor:.2f}",
                     "—" if err is None else f"{err:.1e}", "—" if build_s is None else f"{build_s:.1f}")
        return dict(us=us, floor_us=floor, ratio=us / floor, err=err, label=label, t=t)

    def failed(self, part, t, label, e) -> None:
        self.say.row(part, t, label, f"failed: {type(e).__name__}: {str(e)[:120]}", "", "", "", "")
        self.fails.append(f"{part} T={t} {label}")


def chain_part(bench: Bench, harness):
    """-> (time_chain(label, fields, t), xla_chain(t)): one chain tuning checked and timed at one T; the reference."""
    from common import rel
    from lingjax.ops import kda
    from lingjax.pallas.kda_chain import ChainTuning, kda_chain_verify

    cfg, r = harness.cfg, harness.rotations
    xs_t = {t: harness.inputs(t) for t in bench.args.ts}
    refs = {t: harness.reference(xs_t[t], t) for t in bench.args.ts}

    def time_chain(label, fields, t):
        try:
            tuning = ChainTuning(**fields)
            fn = functools.partial(kda_chain_verify, tokens=t, **cfg, tuning=tuning, in_place=False)
            t0 = time.perf_counter()
            o, st, _ = fn(*harness.args(xs_t[t], 0))
            err = max(rel(o, refs[t][0]), rel(st, refs[t][1]))
            us = bench.us(harness.loop(fn, bench.iters), (xs_t[t],), bench.iters * r)
            bench.chain[label, t] = bench.row("chain", t, label, us, harness.floor_bytes(t), err,
                                              time.perf_counter() - t0)
            if err > CHAIN_TOL:
                bench.fails.append(f"chain T={t} {label}: rel. err {err:.1e}")
        except Exception as e:
            bench.failed("chain", t, label, e)

    def xla_chain(t):
        fn = functools.partial(kda.kda_chain, tokens=t, **cfg)
        us = bench.us(harness.loop(fn, 1), (xs_t[t],), r, reps=5)
        bench.chain["xla kda_chain", t] = bench.row("chain", t, "xla kda_chain", us, harness.floor_bytes(t))

    return time_chain, xla_chain


def prefill_part(bench: Bench):
    """-> (time_prefill(fields, f32_inputs=False), xla_prefill()) at --prefill-len tokens, checked against the
    recurrence."""
    import jax
    import jax.numpy as jnp

    from common import rel
    from lingjax.ops import kda
    from lingjax.ops.norms import l2norm
    from lingjax.pallas.kda_prefill import PrefillTuning, kda_chunked_prefill

    h, d, t = bench.shape.heads, bench.shape.dim, bench.args.prefill_len
    p = h * d
    ks = jax.random.split(jax.random.key(7), 6)
    q = (l2norm(jax.random.normal(ks[0], (t, h, d))) * d**-0.5).astype(jnp.bfloat16)
    k = l2norm(jax.random.normal(ks[1], (t, h, d))).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (t, h, d), jnp.bfloat16)
    g = bench.shape.lower_bound * jax.nn.sigmoid(2 * jax.random.normal(ks[3], (t, h, d)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (t, h)))
    s0 = jax.random.normal(ks[5], (h, d, d), jnp.float32)
    pargs = (q, k, v, g, beta, s0)
    with jax.default_matmul_precision("highest"):
        o_ref, s_ref = jax.jit(kda.kda_recurrent)(*pargs)
    floor_bytes = 3 * t * p * 2 + t * p * 4 + t * h * 4 + 2 * h * d * d * 4 + t * p * 4

    def time_prefill(fields, f32_inputs=False):
        """The Pallas prefill at PrefillTuning(**fields); f32_inputs: q, k, v in f32 (its f32 path, tf32x3 dots)."""
        label = label_of(fields) + (", f32 inputs" if f32_inputs else "")
        inputs = tuple(a.astype(jnp.float32) for a in pargs[:3]) + pargs[3:] if f32_inputs else pargs
        try:
            fn = jax.jit(functools.partial(kda_chunked_prefill, tuning=PrefillTuning(**fields)))
            t0 = time.perf_counter()
            o, s = fn(*inputs)
            err = max(rel(o, o_ref), rel(s, s_ref))
            us = bench.us(fn, inputs, 1, reps=9)
            bench.prefill.append(bench.row("prefill", t, label, us, floor_bytes, err, time.perf_counter() - t0)
                                 | dict(f32=f32_inputs))
        except Exception as e:
            bench.failed("prefill", t, label, e)

    def xla_prefill():
        bench.row("prefill", t, "xla kda_chunked", bench.us(jax.jit(kda.kda_chunked), pargs, 1, reps=3), floor_bytes)

    return time_prefill, xla_prefill


def jax_main(args, shape: KDAShape, say) -> Bench:
    """Every JAX-side row (module docstring's order) -> the bench with its rows."""
    budget = Budget(args.budget)
    bench = Bench(args, shape, say)
    harness = chain_harness(shape, args.rotations)
    say()
    say.table("part", "T", "tuning", "µs", "floor µs", "x floor", "max rel. err", "build s")
    optional = []
    # --smoke: one configuration of each kind (the default chain tuning, one prefill tuning of each list)
    chains, core, more = ((CHAIN_TUNINGS[:1], PREFILL_CORE[:1], PREFILL_MORE[:1]) if args.smoke
                          else (CHAIN_TUNINGS, PREFILL_CORE, PREFILL_MORE))
    if "chain" in args.parts:
        time_chain, xla_chain = chain_part(bench, harness)
        sweep = [(label, fields, t) for label, fields in chains for t in args.ts]
        while sweep and not budget.spent(0.6):  # then the prefill gets its turn; the rest of the sweep follows
            budget.run(time_chain, *sweep.pop(0))
        optional += [functools.partial(xla_chain, args.ts[len(args.ts) // 2])]
        optional += [functools.partial(time_chain, *c) for c in sweep]
    if "prefill" in args.parts:
        time_prefill, xla_prefill = prefill_part(bench)
        time_prefill({})
        budget.run(time_prefill, {}, True)
        for fields in core:
            time_prefill(fields)
        optional += [functools.partial(time_prefill, fields) for fields in more] + [xla_prefill]
    if "chain" in args.parts:
        optional += [functools.partial(xla_chain, t) for t in args.ts if t != args.ts[len(args.ts) // 2]]
    for i, task in enumerate(optional):
        if budget.spent():
            say()
            say(f"budget of {args.budget:.0f} s spent: {len(optional) - i} optional configurations skipped")
            break
        budget.run(task)
    return bench


def chain_table(bench: Bench, say) -> None:
    """One line per chain tuning, µs (x floor) at each T; the fastest per T in bold."""
    ts = bench.args.ts
    best = {t: min((row["us"] for (_, tt), row in bench.chain.items() if tt == t), default=None) for t in ts}
    say.table("tuning", *(f"T={t} µs (x floor)" for t in ts), "max rel. err")
    for label in [label for label, _ in CHAIN_TUNINGS] + ["xla kda_chain"]:
        rows = [bench.chain.get((label, t)) for t in ts]
        if not any(rows):
            continue
        cells = []
        for t, row in zip(ts, rows):
            cell = "—" if row is None else f"{row['us']:.2f} (x{row['ratio']:.1f})"
            cells.append(f"**{cell}**" if row is not None and row["us"] == best[t] else cell)
        errs = [row["err"] for row in rows if row is not None and row["err"] is not None]
        say.row(label, *cells, f"{max(errs):.1e}" if errs else "—")


def comparison(bench: Bench, fla: dict, say) -> None:
    """Our best chain tuning and prefill, against fla's figures where --fla-json gave them."""
    shape, bw, n = bench.shape, bench.bw, bench.args.prefill_len
    h, d, p = shape.heads, shape.dim, shape.heads * shape.dim
    if "error" in fla:
        say(f"- fla: {fla['error']}")
    for t in bench.args.ts:
        rows = [row for (label, tt), row in bench.chain.items() if tt == t and label != "xla kda_chain"]
        if not rows:
            continue
        b = min(rows, key=lambda r: r["us"])
        line = f"- T={t}: pallas chain best {b['us']:.2f} µs ({b['label']})"
        if fla:
            ref, fused = fla.get(f"fused_recurrent_T{t}"), fla.get(f"fused_recurrent_in_kernel_T{t}")
            floor = (h * d * d * 4 * 2 + t * 3 * p * 2 + t * p * 4 + t * h * 2 + t * p * 2) / bw * 1e6
            line += ("; fla fused_recurrent " + (f"{ref:.2f} µs (its floor {floor:.2f}, x{ref / floor:.2f})"
                                                 if isinstance(ref, float) else str(ref))
                     + "; fla with l2norm, gate and beta's sigmoid in its kernel "
                     + (f"{fused:.2f} µs" if isinstance(fused, float) else str(fused)))
        say(line)
    ref = fla.get(f"chunk_kda_T{n}")
    if fla:
        for key in (f"chunk_kda_T{n}", f"chunk_kda_safe_T{n}"):
            say(f"- fla {key}: {fla.get(key)}")
    # the best prefill row within each input dtype's tolerance: the f32 path's (the chunked form itself deviates
    # from the recurrence by ~1e-5 at C = 64) and bf16's 1e-2 (the bf16 path, ~3e-3)
    for f32, tol in ((True, 5e-5), (False, 1e-2)):
        ok = [r for r in bench.prefill if r["f32"] == f32 and r["err"] is not None and r["err"] <= tol]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            vs = f", x{b['us'] / ref:.2f} fla chunk_kda" if isinstance(ref, float) else ""
            say(f"- pallas prefill best at {'f32' if f32 else 'bf16'} inputs (rel. err <= {tol:.0e}): "
                f"{b['us']:.1f} µs ({b['label']}, err {b['err']:.1e}){vs}")


def parse_args(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "tp", "smoke", "out", model="flash")
    ap.add_argument("--fla-child", action="store_true", help="time fla (PyTorch) only, print JSON lines on stdout")
    ap.add_argument("--fla-json", default=None, help="the fla child's output, for the comparison")
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 6, 16], help="chain-verify widths (new tokens)")
    ap.add_argument("--parts", nargs="+", default=["chain", "prefill"], choices=["chain", "prefill"])
    ap.add_argument("--budget", type=float, default=200, help="seconds for the JAX part: optional configurations stop")
    ap.add_argument("--rotations", type=int, default=64, help="distinct input sets per timed graph")
    ap.add_argument("--prefill-len", type=int, default=8192, help="prefill tokens")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.rotations, args.prefill_len, args.ts, args.budget = "tiny", 4, 96, [1, 6], 40
    return args


def main(argv=None):
    args = parse_args(argv)
    shape = kda_shape(config_of(args.model), args.tp)
    if args.fla_child:
        return fla_main(args, shape)
    say = Report(args.out)
    heading(say, f"KDA kernels: {args.model} at TP{args.tp} ({shape.heads} heads, K = V = {shape.dim}, hidden "
                 f"{shape.hidden}), {args.rotations} rotating input sets")
    fla = load_fla(args.fla_json) if args.fla_json else {}
    bench = jax_main(args, shape, say)
    say()
    say("## chain-verify tunings by T (µs per call in the timed loop; x its byte floor)")
    say()
    chain_table(bench, say)
    say()
    comparison(bench, fla, say)
    say()
    say(f"correctness failures: {bench.fails or 'none'}")
    return 1 if bench.fails else 0


if __name__ == "__main__":
    sys.exit(main())
