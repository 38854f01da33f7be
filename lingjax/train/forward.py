"""The differentiable training forward: a batched [B, T] pass over the same parameters as
`lingjax.model.LingModel`, computing the inference model's math (docs/model.md) at positions 0..T-1 with no
cache, written for training speed: chunked KDA (`lingjax.ops.kda`, vmapped over the batch), MLA as causal
attention in the expanded form, and every MoE layer computed densely over all experts (each expert on every
token, weighted by the router's sparse top-k weights: one GEMM shape per layer, no sort or scatter).

Parameter trees (`nnx.to_pure_dict` of the LingModel's Params, f32 masters):
- `params`: what the optimizer trains: every Param except the router biases, and without `lm_head` when
  the embeddings are tied (the head is then `embed`).
- `biases`: f32 [M, E], the selection bias of each MoE layer (the L main ones in order, then the MTP's):
  balancing state, updated outside the gradient (lingjax.train.loss).
`to_model` merges both back into a LingModel, so a trained state is saved and served by the existing code.

Precision: `cast_params` rounds the masters to the compute dtype inside the loss (bf16 for training), except
the leaves the inference model keeps in f32 by design (conv taps, A_log, dt_bias); norms, softmax, routing
scores and the loss run in f32, as in the inference ops this module calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.config import KDA, MLA, MOE, LingConfig
from lingjax.model import LingModel, abstract_model
from lingjax.ops import kda as kda_ops
from lingjax.ops import mla as mla_ops
from lingjax.ops import moe as moe_ops
from lingjax.ops.linear import linear
from lingjax.ops.norms import gated_rms_norm, rms_norm
from lingjax.ops.rope import rope_interleaved

F32 = jnp.float32
BIAS = "router_bias"
HEAD = "lm_head"


# ---- parameter trees ----------------------------------------------------------------------------------
def moe_paths(cfg: LingConfig) -> list[tuple]:
    """Paths of the MoE sub-trees, in the order of the rows of `biases`: main layers, then the MTP's."""
    paths = [("layers", i, "mlp") for i, kind in enumerate(cfg.mlp_types) if kind == MOE]
    return paths + ([("mtp", "block", "mlp")] if cfg.num_nextn_predict_layers else [])


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _map_with_names(fn, tree, path=()):
    """fn(path, leaf) over a nested dict of arrays (the pure-dict layout), the same nesting back."""
    if isinstance(tree, dict):
        return {k: _map_with_names(fn, v, path + (k,)) for k, v in tree.items()}
    return fn(path, tree)


def split_tree(tree: dict, cfg: LingConfig, tied: bool) -> tuple[dict, jax.Array]:
    """A LingModel pure dict -> (params, biases [M, E] f32). With `tied`, lm_head is dropped."""
    biases = jnp.stack([jnp.asarray(_get(tree, p)[BIAS], F32) for p in moe_paths(cfg)])

    def strip(node):
        return {k: strip(v) for k, v in node.items() if k != BIAS} if isinstance(node, dict) else node

    params = strip(tree)
    if tied:
        params.pop(HEAD)
    return params, biases


def join_tree(params: dict, biases: jax.Array, cfg: LingConfig) -> dict:
    """(params, biases) -> the full LingModel pure dict (lm_head = embed when params has none)."""
    tree = jax.tree.map(lambda a: a, params)  # a fresh nesting to write into
    if HEAD not in tree:
        tree[HEAD] = tree["embed"]
    for row, path in enumerate(moe_paths(cfg)):
        _get(tree, path)[BIAS] = biases[row]
    return tree


def abstract_tree(cfg: LingConfig, dtype=F32) -> dict:
    """The LingModel (with MTP) pure dict of ShapeDtypeStructs at `dtype` (f32-by-design leaves stay f32)."""
    _, state = nnx.split(abstract_model(cfg, dtype, with_mtp=bool(cfg.num_nextn_predict_layers)))
    return nnx.to_pure_dict(state)


@functools.lru_cache(maxsize=16)
def f32_leaf_names(cfg: LingConfig) -> frozenset[str]:
    """Names of the leaves LingModel keeps in f32 whatever its dtype (conv, a_log, dt_bias, router_bias)."""
    names = set()
    _map_with_names(lambda path, leaf: names.add(path[-1]) if leaf.dtype == F32 else None,
                    abstract_tree(cfg, jnp.bfloat16))
    return frozenset(names)


def cast_params(params: dict, cfg: LingConfig, dtype) -> dict:
    """The masters rounded to `dtype`, as LingModel(dtype=dtype) holds them."""
    keep = f32_leaf_names(cfg)
    return _map_with_names(lambda path, a: a.astype(F32 if path[-1] in keep else dtype), params)


def to_model(params: dict, biases: jax.Array, cfg: LingConfig, dtype=F32) -> LingModel:
    """A LingModel (with MTP) holding these weights, rounded as LingModel(dtype=dtype) holds them."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype, with_mtp=bool(cfg.num_nextn_predict_layers)))
    target = nnx.to_pure_dict(state)
    tree = join_tree(params, biases, cfg)
    tree = jax.tree.map(lambda a, t: jnp.asarray(a).astype(t.dtype), tree, target)
    nnx.replace_by_pure_dict(state, tree)
    return nnx.merge(graphdef, state)


def from_model(model: LingModel, tied: bool) -> tuple[dict, jax.Array]:
    """(params as f32 masters, biases) of a LingModel."""
    tree = jax.tree.map(lambda a: jnp.asarray(a, F32), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return split_tree(tree, model.cfg, tied)


# ---- initialisation ------------------------------------------------------------------------------------
_OUTPUT_PROJECTIONS = {"o_proj", "down_proj", "w_down"}  # write into the residual stream


def init_params(cfg: LingConfig, seed: int, tied: bool) -> tuple[dict, jax.Array]:
    """Fresh f32 masters for training from scratch, and zero biases, drawn on the host (numpy, leaf i from
    default_rng([seed, i])): no device program per leaf shape to compile, and the same values on any machine.

    Matrices N(0, 1/fan_in), the residual-branch outputs scaled by 1/sqrt(2·(L+1)) (GPT-2's depth scaling);
    the embedding N(0, 1/D), so tied logits start at unit scale; norms 1; KDA's A_log = log U(1, 16) and
    dt_bias = softplus⁻¹(dt), log dt ~ U(log 1e-3, log 1e-1) (HF's initialisation: slow decay at first); conv
    taps U(-1/sqrt(W), 1/sqrt(W)) (torch's Conv1d default)."""
    abstract = abstract_tree(cfg, F32)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    depth_scale = (2.0 * (cfg.num_hidden_layers + 1)) ** -0.5

    def draw(i, path, leaf) -> np.ndarray:
        name = path[-1].key
        rng = np.random.default_rng([seed, i])
        shape = leaf.shape
        if name == "embed":
            return rng.standard_normal(shape, np.float32) * cfg.hidden_size**-0.5
        if name == "a_log":
            return np.log(rng.uniform(1.0, 16.0, shape))
        if name == "dt_bias":
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
            return dt + np.log(-np.expm1(-dt))
        if name == "conv":
            bound = shape[-1] ** -0.5
            return rng.uniform(-bound, bound, shape)
        if name == BIAS or len(shape) == 1:  # router biases 0, every norm weight 1
            return np.full(shape, 0.0 if name == BIAS else 1.0)
        std = shape[-1] ** -0.5 * (depth_scale if name in _OUTPUT_PROJECTIONS else 1.0)
        return rng.standard_normal(shape, np.float32) * std

    host = [np.asarray(draw(i, path, leaf), np.float32) for i, (path, leaf) in enumerate(leaves)]
    return split_tree(treedef.unflatten(jax.device_put(host)), cfg, tied)


def abstract_params(cfg: LingConfig, tied: bool) -> tuple[dict, jax.ShapeDtypeStruct]:
    """init_params' (params, biases) as ShapeDtypeStructs, nothing drawn or allocated."""
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_tree(cfg, F32))  # noqa: E731
    return jax.eval_shape(lambda: split_tree(zeros(), cfg, tied))


# ---- the forward ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """Per MoE layer of one forward: loads [M, E] f32 (tokens that picked each expert) and balance [M] f32
    (DeepSeek-V3's sequence-wise balance term Σ_e f_e·P_e, batch mean; 1 when perfectly balanced)."""

    loads: jax.Array
    balance: jax.Array


jax.tree_util.register_dataclass(RouterStats, data_fields=["loads", "balance"], meta_fields=[])


def head_weight(params: dict) -> jax.Array:
    """The output head [V, D]: lm_head, or the embedding when tied."""
    return params[HEAD] if HEAD in params else params["embed"]


def _kda(cfg: LingConfig, p: dict, x: jax.Array) -> jax.Array:
    """KDA layer (docs/model.md §3) on x [B, T, D] (normed) -> [B, T, D] in x's dtype."""
    b, t, _ = x.shape
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    w = p["in_proj"]  # [5, P, D]
    pw = w.shape[1]
    proj = linear(x, w.reshape(-1, w.shape[-1]))  # [B, T, 5P] = q | k | v | f | g
    beta_logits = linear(x, p["b_proj"])  # [B, T, H]
    conv_w = p["conv"].reshape(-1, p["conv"].shape[-1])  # [3P, W]
    window = jnp.zeros((conv_w.shape[1] - 1, 3 * pw), x.dtype)  # positions before 0 hold zeros
    state = jnp.zeros((h, dk, dk), F32)

    def one(qkv, f, bl):
        q, k, v, g, beta, _ = kda_ops.kda_prepare(qkv, f, bl, window, conv_w, p["a_log"], p["dt_bias"], t,
                                                  num_heads=h, safe_gate=cfg.kda_safe_gate,
                                                  lower_bound=cfg.kda_lower_bound)
        q, k, v = (a.astype(x.dtype) for a in (q, k, v))  # as the inference prefill feeds its chunked op
        return kda_ops.kda_chunked(q, k, v, g, beta, state, checkpoint_chunks=True)[0]  # activation memory

    o = jax.vmap(one)(proj[..., : 3 * pw], proj[..., 3 * pw : 4 * pw], beta_logits)  # [B, T, H, d] f32
    gate = proj[..., 4 * pw :].reshape(b, t, h, dk)
    y = gated_rms_norm(o, p["o_norm"], gate, cfg.rms_norm_eps).astype(x.dtype)
    return linear(y.reshape(b, t, h * dk), p["o_proj"])


def _mla(cfg: LingConfig, p: dict, x: jax.Array, positions: jax.Array) -> jax.Array:
    """MLA layer (docs/model.md §4), causal attention over the sequence itself, expanded form."""
    b, t, _ = x.shape
    h, n, r, lat = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    rope = jax.vmap(lambda a: rope_interleaved(a, positions, cfg.rope_theta))
    q = linear(x, p["q_proj"]).reshape(b, t, h, n + r)
    q_nope, q_pe = q[..., :n], rope(q[..., n:])
    kva = linear(x, p["kv_a_proj"])
    c = rms_norm(kva[..., :lat], p["kv_a_norm"], cfg.rms_norm_eps)
    k_pe = rope(kva[..., lat:])
    latent = jnp.concatenate([c, k_pe], -1)  # [B, T, R + r]: what the inference cache holds
    o = jax.vmap(lambda qn, qp, lt: mla_ops.mla_expanded(qn, qp, lt, p["kv_b_proj"], positions,
                                                          cfg.qk_head_dim**-0.5))(q_nope, q_pe, latent)
    gate = jax.nn.sigmoid(linear(x, p["g_proj"]).astype(F32))  # [B, T, H]
    o = (o * gate[..., None]).astype(x.dtype).reshape(b, t, h * cfg.v_head_dim)
    return linear(o, p["o_proj"])


def _moe(cfg: LingConfig, p: dict, bias: jax.Array, x: jax.Array, layer_id: int):
    """MoE layer (docs/model.md §6) on x [B, T, D], every expert on every token, weighted by the sparse
    routing weights. -> (y [B, T, D] in x's dtype, loads [E], balance [])."""
    b, t, d = x.shape
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    flat = x.reshape(b * t, d)
    weights, experts = moe_ops.route(flat, p["router"], jax.lax.stop_gradient(bias), top_k=k, n_group=cfg.n_group,
                                     topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
                                     renormalize=cfg.norm_topk_prob)
    picked = jax.nn.one_hot(experts, e, dtype=F32)  # [N, k, E]
    gates = jnp.einsum("nk,nke->ne", weights, picked)  # [N, E], zero off the top k
    g = jnp.einsum("nd,eid->nei", flat, p["w_gate"], preferred_element_type=F32)
    u = jnp.einsum("nd,eid->nei", flat, p["w_up"], preferred_element_type=F32)
    act = moe_ops.swiglu(g, u, cfg.swiglu_limit(layer_id, shared=False)) * gates[..., None]
    y = jnp.einsum("nei,edi->nd", act.astype(x.dtype), p["w_down"], preferred_element_type=F32)
    if "shared" in p:
        s = p["shared"]
        y = y + moe_ops.mlp(flat, s["gate_proj"], s["up_proj"], s["down_proj"], cfg.swiglu_limit(layer_id, shared=True))
    # loads and DeepSeek-V3's sequence-wise balance term: f_e = E/(k·T)·(picks of e), P_e = mean_t s_e / Σ s
    counts = picked.sum(1).reshape(b, t, e)  # [B, T, E] 0/1
    scores = jax.nn.sigmoid(jnp.einsum("nd,ed->ne", flat.astype(F32), p["router"].astype(F32))).reshape(b, t, e)
    share = jnp.mean(scores / scores.sum(-1, keepdims=True), axis=1)  # [B, E]
    freq = jax.lax.stop_gradient(counts.sum(1)) * (e / (k * t))  # [B, E]
    balance = jnp.mean(jnp.sum(freq * share, -1))
    return y.astype(x.dtype).reshape(b, t, d), counts.sum((0, 1)), balance


def _block(cfg: LingConfig, layer_id: int, attn_kind: str, mlp_kind: str, p: dict, bias, x: jax.Array):
    """Pre-norm decoder layer -> (y, loads [E] or None, balance or None)."""
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)
    a_in = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
    a = _kda(cfg, p["attn"], a_in) if attn_kind == KDA else _mla(cfg, p["attn"], a_in, positions)
    h = x + a
    m_in = rms_norm(h, p["post_norm"], cfg.rms_norm_eps)
    if mlp_kind == MOE:
        y, loads, balance = _moe(cfg, p["mlp"], bias, m_in, layer_id)
        return h + y, loads, balance
    m = p["mlp"]
    return h + moe_ops.mlp(m_in, m["gate_proj"], m["up_proj"], m["down_proj"]).astype(x.dtype), None, None


def _run_block(cfg, layer_id, attn_kind, mlp_kind, p, bias, x, remat: bool):
    fn = functools.partial(_block, cfg, layer_id, attn_kind, mlp_kind)
    return (jax.checkpoint(fn) if remat else fn)(p, bias, x)


def _stats(loads: list, balance: list) -> RouterStats:
    return RouterStats(loads=jnp.stack(loads), balance=jnp.stack(balance))


def forward(params: dict, biases: jax.Array, tokens: jax.Array, cfg: LingConfig, *, remat: bool = False):
    """The main model over tokens [B, T] at positions 0..T-1, with params already cast (cast_params).

    Returns (hidden [B, T, D] after the final norm, in the compute dtype: what LingModel.forward returns and
    what the MTP layer reads; RouterStats of the L main MoE layers)."""
    hidden, stats, _ = forward_features(params, biases, tokens, cfg, remat=remat)
    return hidden, stats


def forward_features(params: dict, biases: jax.Array, tokens: jax.Array, cfg: LingConfig, *, remat: bool = False,
                     capture: tuple[int, ...] = ()):
    """forward, also returning the residual streams after the layers `capture` names, concatenated in that order
    ([B, T, len(capture)·D]; LingModel.forward_features'): what a DSpark drafter reads of the target."""
    x = params["embed"][tokens]
    loads, balance, captured = [], [], {}
    row = 0
    for i, (attn_kind, mlp_kind) in enumerate(zip(cfg.layer_types, cfg.mlp_types)):
        bias = biases[row] if mlp_kind == MOE else None
        x, layer_loads, layer_balance = _run_block(cfg, i, attn_kind, mlp_kind, params["layers"][i], bias, x, remat)
        if mlp_kind == MOE:
            loads.append(layer_loads)
            balance.append(layer_balance)
            row += 1
        if i in capture:
            captured[i] = x
    features = jnp.concatenate([captured[i] for i in capture], -1) if capture else x[..., :0]
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), _stats(loads, balance), features


def mtp_forward(params: dict, bias: jax.Array, hidden: jax.Array, next_tokens: jax.Array, cfg: LingConfig, *,
                remat: bool = False):
    """The MTP (NEXTN) layer, DeepSeek-V3 style (docs/model.md §7): row t reads h_t (the main model's hidden
    after its final norm, hidden [B, T, D]) and the embedding of token t+1 (next_tokens [B, T]), attends
    causally over the rows at positions 0..T-1, and its z_t predicts token t+2. This is the drafter's input
    exactly: lingjax.spec.drafters.NextnDrafter runs row p on (x_{p+1}, h_p) at position p.

    bias: [E], this layer's selection bias. Returns (z [B, T, D] after the MTP's final norm, RouterStats of
    its MoE)."""
    m = params["mtp"]
    eps = cfg.rms_norm_eps
    u = jnp.concatenate([rms_norm(params["embed"][next_tokens], m["enorm"], eps), rms_norm(hidden, m["hnorm"], eps)],
                        -1)
    u = linear(u, m["eh_proj"])
    u, loads, balance = _run_block(cfg, cfg.mtp_layer_id, MLA, MOE, m["block"], bias, u, remat)
    return rms_norm(u, m["final_norm"], eps), _stats([loads], [balance])


def logits(params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> f32 logits [..., V] (LingModel.lm_logits' GEMM: f32 accumulation, f32 out)."""
    return linear(hidden, head_weight(params), F32)
