"""noaux_tc routing and SwiGLU experts (docs/model.md §5, §6)."""

import jax
import jax.numpy as jnp

from lingjax.config import VERIFY_ROWS
from lingjax.ops.fp8 import dense
from lingjax.ops.linear import linear

F32 = jnp.float32


def route(x, router_w, bias, *, top_k, n_group, topk_group, scaling, renormalize, precision="f32"):
    """Group-limited sigmoid routing; the bias steers selection only.

    x: [T, D]; router_w: [E, D]; bias: [E] f32. Returns (weights [T, k] f32, experts [T, k] int32).
    precision "f32" (HF parity) runs the gate GEMV on f32 operands; "bf16" (the seed's declared rounding
    change, half the router bytes) on bf16 operands with f32 accumulation.
    """
    if precision not in ("f32", "bf16"):
        raise ValueError(f"router precision must be 'f32' or 'bf16', got {precision!r}")
    operand = F32 if precision == "f32" else jnp.bfloat16
    logits = jnp.einsum("td,ed->te", x.astype(operand), router_w.astype(operand), preferred_element_type=F32)
    scores = jax.nn.sigmoid(logits)
    sel = scores + bias.astype(F32)
    t, e = sel.shape
    grouped = sel.reshape(t, n_group, e // n_group)
    group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]: sum of the two largest
    _, keep = jax.lax.top_k(group_score, topk_group)
    group_mask = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)
    sel = jnp.where(jnp.repeat(group_mask, e // n_group, axis=1), sel, -jnp.inf)
    _, experts = jax.lax.top_k(sel, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=1)  # raw scores, not biased
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scaling, experts.astype(jnp.int32)


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """SiLU(g)·u in f32; with a limit L: min(SiLU(g), L)·clip(u, -L, L) (clamp after SiLU)."""
    act = jax.nn.silu(gate.astype(F32))
    up = up.astype(F32)
    if limit:
        act = jnp.minimum(act, limit)
        up = jnp.clip(up, -limit, limit)
    return act * up


def mlp(x, w_gate, w_up, w_down, limit: float = 0.0):
    """Dense SwiGLU MLP (also the shared expert). x: [T, D]; w_gate/w_up: [F, D]; w_down: [D, F] -> [T, D] f32."""
    g, u = linear(x, w_gate, F32), linear(x, w_up, F32)
    return linear(swiglu(g, u, limit).astype(x.dtype), w_down, F32)


def experts_gathered(x, w_gate, w_up, w_down, weights, experts, limit: float = 0.0):
    """Batch-1 path: gather the chosen experts per (token, slot) pair.

    x: [T, D]; w_gate/w_up: [E, I, D]; w_down: [E, D, I]; weights, experts: [T, k].
    Returns Σ_k w·E_k(x) as [T, D] f32. fp8 experts (lingjax.ops.fp8.Fp8Array) are gathered in fp8 and
    dequantized to x's dtype.
    """
    g = jnp.einsum("td,tkid->tki", x, dense(w_gate[experts], x.dtype), preferred_element_type=F32)
    u = jnp.einsum("td,tkid->tki", x, dense(w_up[experts], x.dtype), preferred_element_type=F32)
    h = swiglu(g, u, limit).astype(x.dtype)
    y = jnp.einsum("tki,tkdi->tkd", h, dense(w_down[experts], x.dtype), preferred_element_type=F32)
    return jnp.einsum("tkd,tk->td", y, weights)


def experts(x, w_gate, w_up, w_down, weights, experts, limit: float = 0.0, *, tokens=None, shared=None,
            shared_limit: float = 0.0):
    """The routed experts of x's first T = `tokens` rows (default all): Σ_k w·E_k(x) [T, D] f32, with
    `shared=(w_gate, w_up, w_down)` plus the shared expert (mlp, clamped at shared_limit).

    x: [R, D], weights/experts: [R, k], rows past T are padding. Gathered weights up to VERIFY_ROWS tokens,
    sorted grouped GEMMs above. The shared expert runs on all R rows, so its GEMMs have one shape whatever T
    (row invariance, lingjax.model)."""
    t = x.shape[0] if tokens is None else tokens
    routed = experts_gathered if t <= VERIFY_ROWS else experts_sorted
    y = routed(x[:t], w_gate, w_up, w_down, weights[:t], experts[:t], limit)
    return y if shared is None else y + mlp(x, *shared, shared_limit)[:t]


def experts_all_rows(x, w_gate, w_up, w_down, weights, chosen, limit: float = 0.0, *, tokens=None, shared=None,
                     shared_limit: float = 0.0):
    """`experts` on every row of a decode/verify-shaped x ([VERIFY_ROWS, D]), then its first T = `tokens` rows:
    one set of shapes whatever T, so row j rounds alike in a T=1 decode and in a verify (row invariance,
    lingjax.model), for R/T times the gathered weights. What a GPU runs where the Pallas expert kernels refuse
    a model's shapes: on the real rows alone XLA picks the gathered GEMVs' and the k-slot sum's reductions by T
    there. Larger x (prefill): `experts` itself."""
    if x.shape[0] > VERIFY_ROWS:
        return experts(x, w_gate, w_up, w_down, weights, chosen, limit, tokens=tokens, shared=shared,
                       shared_limit=shared_limit)
    t = x.shape[0] if tokens is None else tokens
    y = experts(x, w_gate, w_up, w_down, weights, chosen, limit, shared=shared, shared_limit=shared_limit)
    return y[:t]


def routed_experts_all_rows(x, router_w, bias, w_gate, w_up, w_down, limit: float = 0.0, *, top_k, n_group,
                            topk_group, scaling, renormalize, precision="f32", tokens=None, shared=None,
                            shared_limit: float = 0.0):
    """route, then experts_all_rows: routed_experts' row-invariant form (see experts_all_rows)."""
    weights, chosen = route(x, router_w, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                            scaling=scaling, renormalize=renormalize, precision=precision)
    return experts_all_rows(x, w_gate, w_up, w_down, weights, chosen, limit, tokens=tokens, shared=shared,
                            shared_limit=shared_limit)


def routed_experts(x, router_w, bias, w_gate, w_up, w_down, limit: float = 0.0, *, top_k, n_group, topk_group,
                   scaling, renormalize, precision="f32", tokens=None, shared=None, shared_limit: float = 0.0):
    """route (on all of x's rows), then `experts` of the first T = `tokens` rows (default all) -> [T, D] f32."""
    weights, chosen = route(x, router_w, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                            scaling=scaling, renormalize=renormalize, precision=precision)
    return experts(x, w_gate, w_up, w_down, weights, chosen, limit, tokens=tokens, shared=shared,
                   shared_limit=shared_limit)


def experts_sorted(x, w_gate, w_up, w_down, weights, experts, limit: float = 0.0):
    """Prefill path: sort (token, slot) pairs by expert and run grouped GEMMs (ragged_dot).

    Same arguments and result as experts_gathered; cost scales with tokens, not with T·k weight copies.
    """
    w_gate, w_up, w_down = (dense(w, x.dtype) for w in (w_gate, w_up, w_down))
    t, k = experts.shape
    e = w_gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    xs = x[token_of]  # [T*k, D]
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    # Contract x's D with the experts' last dim; the group dim is 0. No weight transposes.
    dn_in = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    g = jax.lax.ragged_dot_general(xs, w_gate, group_sizes, dn_in, preferred_element_type=F32)
    u = jax.lax.ragged_dot_general(xs, w_up, group_sizes, dn_in, preferred_element_type=F32)
    h = swiglu(g, u, limit).astype(x.dtype)
    y = jax.lax.ragged_dot_general(h, w_down, group_sizes, dn_in, preferred_element_type=F32)  # [T*k, D]
    y = y * weights.reshape(-1)[order][:, None]
    # back to (token, slot) order, then each token's k rows summed in slot order: a scatter-add would sum a token's
    # rows in whatever order the GPU's atomics land (run-to-run bits)
    return y[jnp.argsort(order)].reshape(t, k, -1).sum(axis=1)
