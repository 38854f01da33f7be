"""The absorbed MLA products' read of kv_b_proj: the tree's form (lingjax.ops.mla.absorb_query and absorb_output:
the weight whole, converted inside each GEMM, the query padded with v zeros, the output's last v columns kept)
against the form it replaced (W_uk and W_uv sliced out and converted to f32 in every step, a copy XLA writes out)
and against two separate weight arrays (the bytes' floor), at Flash's shapes: time per layer over --copies distinct
weights, and whether q_lat and o equal the replaced form's bit for bit.

    python bench/mla_kvb_ab.py --out mla_kvb.md
    python bench/mla_kvb_ab.py --smoke        # a CPU check of the script

The rounding of the tree's form on the trained model: bench/results/shipped/tree_rounding_kvb_2026-12-07.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from common import BF16, F32, Report, add_options, config_of, heading, parser, pipelined_seconds, rel
from lingjax import target
from lingjax.execution import step_compiler_options
from lingjax.ops.mla import absorb_output, absorb_query

ROWS = 16  # a decode's or verify's padded rows


def replaced(q, ctx, w, n):
    """The form the tree replaced: both halves sliced and converted to f32."""
    w3 = w.reshape(q.shape[1], -1, w.shape[-1])
    w_uk, w_uv = w3[:, :n].astype(F32), w3[:, n:].astype(F32)
    return jnp.einsum("thn,hnr->thr", q.astype(F32), w_uk), jnp.einsum("thr,hvr->thv", ctx, w_uv)


def tree(q, ctx, w, n):
    """This tree's form (lingjax.ops.mla): kv_b_proj whole, [H, n+v, R], converted inside each GEMM."""
    return absorb_query(q, w), absorb_output(ctx, w, n)


def two_arrays(q, ctx, w, n):
    """The floor of the bytes: W_uk and W_uv held as separate arrays (w given as the pair)."""
    w_uk, w_uv = w
    return (jnp.einsum("thn,hnr->thr", q.astype(F32), w_uk.astype(F32)),
            jnp.einsum("thr,hvr->thv", ctx, w_uv.astype(F32)))


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "smoke", "out", model="flash")
    ap.add_argument("--copies", type=int, default=16, help="distinct weights in one program (cold)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.copies = "tiny", 2
    cfg = config_of(args.model)
    h, n, v, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    say = Report(args.out)
    heading(say, f"mla_kvb_ab: {args.model}'s absorbed MLA products ({h} heads, {n} + {v}, rank {r})")
    key = jax.random.key(1)
    q = jax.random.normal(key, (ROWS, h, n), F32).astype(BF16)
    ctx = jax.random.normal(jax.random.fold_in(key, 1), (ROWS, h, r), F32)
    ws = [(jax.random.normal(jax.random.fold_in(key, 10 + c), (h * (n + v), r), F32) * r**-0.5).astype(BF16)
          for c in range(args.copies)]
    pairs = [(jnp.array(w.reshape(h, -1, r)[:, :n]), jnp.array(w.reshape(h, -1, r)[:, n:])) for w in ws]
    options = step_compiler_options() if target.platform() == "gpu" else None
    say.table("form", "µs per layer", "q_lat bits", "o bits", "q_lat vs the replaced form's", "o vs the replaced's")
    base = None
    for label, form, weights in (("replaced (halves to f32 each step)", replaced, ws),
                                 ("this tree (whole weight, query padded)", tree, ws),
                                 ("two arrays (the bytes' floor)", two_arrays, pairs)):
        def run(q, ctx, weights, form=form):
            outs = [form(q, ctx, w, n) for w in weights]
            return sum(jnp.sum(a[:1, :1]) + jnp.sum(b[:1, :1]) for a, b in outs), outs[0]

        fn = jax.jit(run, compiler_options=options)
        got = [np.asarray(a) for a in fn(q, ctx, weights)[1]]
        base = got if base is None else base
        bits = ["equal" if np.isfinite(a).all() and np.array_equal(a.view(np.uint32), b.view(np.uint32)) else "DIFFER"
                for a, b in zip(got, base)]
        t = pipelined_seconds(fn, q, ctx, weights, reps=1 if args.smoke else 7) / args.copies
        say.row(label, f"{t * 1e6:.2f}", *bits, f"{rel(got[0], base[0]):.1e}", f"{rel(got[1], base[1]):.1e}")


if __name__ == "__main__":
    main()
