"""A prefill chunk's MLA attention: XLA's expanded form (lingjax.ops.mla.mla_expanded, what the prefill ran before
its kernel) against the Pallas kernel (lingjax.pallas.mla_prefill) at several tilings, for a chunk at several
positions of a long prompt's cache, on Flash's attention shape.

    python bench/mla_prefill_bench.py --out mla_prefill.md          # T = 2048; starts 0, 2048, 6144; 8192-token cache
    python bench/mla_prefill_bench.py --smoke                       # tiny sizes, interpret mode: a CPU check

Why: the engine sizes the cache for the whole request (an 8192-token prompt: 16,384 slots), and XLA's expanded form
expands every slot through kv_b_proj and scores every query row against every slot, [T, H, L] f32 in memory, in
every chunk whatever its position. The kernel reads only the key tiles its rows can see.

Each variant is one program over --layers distinct inputs (q, cache and kv_b_proj of their own), compiled with the
step programs' options, timed as the median of --reps calls; ms per layer. `TFLOP/s`: the attention's useful work,
2 · H · (n + r + v) multiply-adds for every (row, visible slot) pair, plus kv_b_proj's expansion of the visible
slots, over the time; `x XLA`: the time over XLA's in the same row group (below 1: faster). `vs XLA`: the max error
against XLA's output relative to its largest value (bf16 keys, values and weights in the kernel; f32 in XLA's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from common import BF16, F32, Report, add_options, config_of, heading, median_seconds, parser, progress, rel
from lingjax import target
from lingjax.execution import step_compiler_options
from lingjax.ops.mla import mla_expanded
from lingjax.pallas.mla_prefill import MLAPrefillTuning, mla_prefill_attention

VARIANTS = [  # (label, tuning); None: XLA's expanded form
    ("XLA (mla_expanded)", None),
    ("pallas default", MLAPrefillTuning()),
    ("pallas q 128, 8 warps", MLAPrefillTuning(block_q=128, num_warps=8)),
    ("pallas k 32", MLAPrefillTuning(block_k=32)),
    ("pallas stages 3", MLAPrefillTuning(num_stages=3)),
    ("pallas, every tile masked", MLAPrefillTuning(unmasked_head=False)),
]


def make_inputs(cfg, tokens: int, capacity: int, seed: int) -> tuple:
    """q_nope, q_pe [T, H, ·], the latent cache [L, R + r] and kv_b_proj [H·(n+v), R], bf16, random."""
    h, n, r, v, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (tokens, h, n), F32).astype(BF16),
            jax.random.normal(ks[1], (tokens, h, r), F32).astype(BF16),
            jax.random.normal(ks[2], (capacity, rank + r), F32).astype(BF16),
            (jax.random.normal(ks[3], (h * (n + v), rank), F32) * rank**-0.5).astype(BF16))


def useful_flops(cfg, tokens: int, start: int) -> float:
    """The chunk's attention over its visible slots (causal: row t sees start + t + 1) and the expansion of
    those slots through kv_b_proj."""
    h, n, r, v, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    pairs = tokens * start + tokens * (tokens + 1) / 2
    return 2 * pairs * h * (n + r + v) + 2 * (start + tokens) * rank * h * (n + v)


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "smoke", "out", model="flash")
    ap.add_argument("--tokens", type=int, default=2048, help="T: the chunk's tokens")
    ap.add_argument("--starts", type=int, nargs="+", default=[0, 2048, 6144], help="the chunk's first positions")
    ap.add_argument("--capacity", type=int, default=16384, help="the cache's slots (an 8192-token prompt's: 16384)")
    ap.add_argument("--layers", type=int, default=3, help="distinct inputs in the timed program")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.tokens, args.starts, args.capacity, args.layers, args.reps = "embedded", 32, [0, 40], 128, 1, 1
    cfg = config_of(args.model)
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    gpu = target.platform() == "gpu"
    say = Report(args.out)
    heading(say, f"mla_prefill_bench: {args.model}'s MLA attention, a {args.tokens}-token chunk, "
                 f"{args.capacity}-slot cache")
    layers = [make_inputs(cfg, args.tokens, args.capacity, 10 + l) for l in range(args.layers)]
    say.table("start", "variant", "ms per layer", "TFLOP/s", "x XLA", "vs XLA")
    for start in args.starts:
        positions = start + jnp.arange(args.tokens, dtype=jnp.int32)
        base_ms, base_out = None, None
        for label, tuning in VARIANTS[:2] if args.smoke else VARIANTS:
            def run(layers, positions, tuning=tuning):
                if tuning is None:
                    return [mla_expanded(*x, positions, scale) for x in layers]
                return [mla_prefill_attention(*x, positions, scale, tuning=tuning) for x in layers]

            fn = jax.jit(run, compiler_options=step_compiler_options() if gpu else None)
            progress(f"start {start}: {label}")
            try:
                out = np.asarray(fn(layers, positions)[0])
            except Exception as e:  # a tiling that does not compile or launch: reported, the others still run
                say.row(start, label, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}", "", "", "")
                continue
            ms = median_seconds(fn, layers, positions, reps=args.reps) / args.layers * 1e3
            if tuning is None:
                base_ms, base_out = ms, out
            flops = useful_flops(cfg, args.tokens, start) / (ms * 1e-3) / 1e12
            say.row(start, label, f"{ms:.3f}", f"{flops:.0f}", "" if base_ms is None else f"{ms / base_ms:.3f}",
                    "" if base_out is None else f"{rel(out, base_out):.1e}")


if __name__ == "__main__":
    main()
