"""Ling-3.0-flash (HF `bailing_hybrid`) in Flax NNX.

How it departs from a vanilla decoder-only transformer:
- Hybrid attention: in each group of `layer_group_size` layers the last is MLA (DeepSeek-V3-style
  latent attention with a direct q_proj, interleaved rope on 64 dims and a head-wise sigmoid output
  gate); the others are KDA, a linear attention whose state is a gated delta rule with a per-channel
  safe gate, fed by a causal short conv.
- Fine-grained MoE: 512 sigmoid-scored experts, group-limited (noaux_tc) top-8 selection with a bias
  that steers selection only, one unweighted shared expert, and per-layer SwiGLU clamps.
- One MTP (NEXTN) layer after the stack that drafts the next-next token for speculation.
Weights keep the torch [out, in] layout (y = x·Wᵀ) so checkpoints load without transposes.

Every forward is an "extend": T new tokens at absolute positions start..start+T-1 against explicit
caches. Prefill, decode (T=1), speculative verify (T=S+1) and the cache-free full forward are all
this one function; the math path (recurrent or chunked KDA, absorbed or expanded MLA) is chosen in one
place, `paths_for`, by T.

Row invariance (what makes bf16 speculation lossless): a decode/verify-shaped forward (T <= VERIFY_ROWS)
runs every row-wise op (norms, projections, MLP, router, MLA attention, lm_head) on VERIFY_ROWS rows, the
real T padded with zeros, so each GEMM has one shape whatever T is and row j rounds the same in a
T=1 decode and in a verify. Only the ops that carry state between rows or read per-row weights take
the real rows alone: the KDA recurrence and conv, the MLA cache write, the routed experts (whose k-slot
sum is a fixed-order chain of adds: a reduce over [T, k, D] summed in a T-dependent order on the H200).
The Pallas kernels for those read the real rows of the padded arrays in place (no slice or pad launches
around them); where a GPU refuses the expert kernels for a model's shapes, their XLA fallback runs on every
padded row instead (lingjax.ops.moe.experts_all_rows), and a decode then routes as a verify does. The MTP
drafter's forwards are not padded (paths_for's pad_small).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from lingjax.cache import KDACache, KDAStaged, MLACache, ModelCache
from lingjax.config import KDA, MOE, VERIFY_ROWS, LingConfig
from lingjax.execution import Exec
from lingjax.ops import kda as kda_ops
from lingjax.ops import linear as linear_ops
from lingjax.ops import mla as mla_ops
from lingjax.ops import moe as moe_ops
from lingjax.ops.fp8 import Fp8Array, dense, device_block, quantize_on_device, refine_scales_on_device
from lingjax.ops.norms import gated_rms_norm, rms_norm
from lingjax.ops.rope import rope_interleaved
from lingjax.param_init import ParamInit
from lingjax.quantization import Fp8Layout, quantized_paths
from lingjax.sharding import path_keys
from lingjax.stacked import materialize

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Paths:
    small: bool  # decode/verify-shaped (T <= VERIFY_ROWS): row-wise ops on padded rows, Pallas linear, reductions
    decode: bool  # T = 1: a Pallas MoE routes inside its expert launches
    kda_chunked: bool  # chunked KDA form (prefill) instead of the recurrence
    mla_absorbed: bool  # absorbed MLA (reads the latent cache directly)
    tokens: int  # T, the forward's new tokens
    rows: int  # rows the row-wise ops run on: VERIFY_ROWS for small T (see the module docstring), else T
    ex: Exec = Exec()  # kernel set and tensor-parallel axis

    def op(self, name: str):
        return self.ex.op(name)

    def pad(self, x: jax.Array) -> jax.Array:
        """[T, ...] -> [rows, ...], zero rows after the real ones."""
        return pad_rows(x, self.rows)


def paths_for(num_tokens: int, ex: Exec = Exec(), pad_small: bool = True) -> Paths:
    """pad_small=False: no row padding (the MTP drafter's forwards: a draft only decides acceptance,
    never an emitted token, so it needs no row invariance and skips the padded rows' work)."""
    small = num_tokens <= VERIFY_ROWS
    return Paths(small=small, decode=num_tokens == 1, kda_chunked=not small, mla_absorbed=small,
                 tokens=num_tokens, rows=VERIFY_ROWS if small and pad_small else num_tokens, ex=ex)


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


linear = linear_ops.linear  # XLA's GEMM: at these widths it reads the weight at full bandwidth


def narrow_linear(x: jax.Array, w: jax.Array, paths: Paths) -> jax.Array:
    """linear for a weight of a few dozen outputs (KDA's beta, MLA's head gate: [H, D]). At decode and
    verify sizes (T <= VERIFY_ROWS) it is a multiply-reduce, which XLA emits as one reduction fusion, a
    fraction of the time its GEMM fusion takes at that shape (docs/engine.md)."""
    return linear_ops.dot_rows(x, w) if paths.small else linear(x, w)


def project(x: jax.Array, w, paths: Paths, out_dtype=None) -> jax.Array:
    """linear(x, w) for a plain or an fp8 weight (lingjax.ops.fp8.Fp8Array). On decode/verify rows it runs op
    "linear": the Pallas kernel's launch follows from the shape alone, so every program and process rounds a row
    alike, and an fp8 weight is read as fp8 (docs/engine.md). On prefill rows op "gemm": a Pallas GEMM whose tiles
    follow from the shape alone (the step programs compile with XLA's GEMM autotuning off, which leaves XLA's GEMMs
    far from the tensor cores' speed), an fp8 weight read as fp8. Under TP both take this device's shard of w."""
    if paths.small:
        return paths.op("linear")(x, w, out_dtype, tokens=paths.tokens)
    return paths.op("gemm")(x, w, out_dtype)


def row_linear(x: jax.Array, w, paths: Paths) -> jax.Array:
    """Row-parallel projection: under TP w holds this device's slice of the inputs, so the f32
    partial sums are all-reduced (the sub-layer's one all-reduce) before the single rounding."""
    return paths.ex.psum(project(x, w, paths, F32)).astype(x.dtype)


class Fp8Weight(nnx.Module):
    """A matrix parameter kept in fp8 on the device: `q` (float8_e4m3fn [..., N, K]) and its `scale` (float32, one
    per device block), two Params. w[...] is their lingjax.ops.fp8.Fp8Array, which the ops take in place of an
    array; `q` keeps the distribution of the weight it quantizes (`random`), for lingjax.random_weights.random_model."""

    def __init__(self, q, scale, random=None, block: tuple[int, int] | None = None):
        self.q = nnx.Param(q, random=random, fp8_block=block)
        self.scale = nnx.Param(scale, random=("fp8_scale",))

    def __getitem__(self, index) -> Fp8Array:
        if index is not Ellipsis:
            raise IndexError("an fp8 weight is read whole (w[...]); index its Fp8Array")
        return Fp8Array(self.q[...], self.scale[...])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)


def quantizer_block(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The blocks a weight of `shape` is quantized in by lingjax (random fp8 weights, a bf16 checkpoint quantized
    as it loads): the layout's, cut to divide the weight (lingjax.ops.fp8.device_block at TP 1), so the values are
    the same at every TP size; a TP size then only splits their scales (refine_scales)."""

    return device_block(shape, block)


def quantize_matrices(model: nnx.Module, layout: Fp8Layout) -> None:
    """Replace each matrix parameter at layout.paths by its Fp8Weight, quantized in quantizer_block blocks with
    scales cut to the layout's device blocks. Works on concrete weights and under nnx.eval_shape alike."""
    for path in sorted(layout.paths, key=str):
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        param = getattr(parent, path[-1])
        w = param[...]
        block = quantizer_block(w.shape, layout.block)
        device = layout.device_block(path, w.shape)
        fp8 = quantize_on_device(w, block, layout.scale_fmt)
        scale = refine_scales_on_device(fp8.scale, w.shape, block, device)
        setattr(parent, path[-1], Fp8Weight(fp8.q, scale, random=getattr(param, "random", None), block=block))


class KDAAttention(nnx.Module):
    def __init__(self, cfg: LingConfig, init: ParamInit):
        d, p, h = cfg.hidden_size, cfg.kda_dim, cfg.kda_num_heads
        # q, k, v, f (gate input) and g (output gate) projections of x, stacked: one GEMM reads them all
        # (checkpoint q_proj/k_proj/v_proj/f_proj/g_proj; under TP each is split by channel)
        self.in_proj = init.matrix(5, p, d)
        self.b_proj = init.matrix(h, d)
        self.conv = init.param((3, p, cfg.conv_size), ("normal", 0.0, 0.5), F32)  # q|k|v short-conv taps
        self.a_log = init.param((h,), ("log_uniform", 1.0, 16.0), F32)
        self.dt_bias = init.param((p,), ("normal", 0.0, 1.0), F32)
        self.o_norm = init.norm(cfg.kda_head_dim)
        self.o_proj = init.matrix(d, p)

    def __call__(self, cfg: LingConfig, x, cache: KDACache, positions, n_valid, paths: Paths):
        """x: [rows, D] at `positions` (consecutive), the first paths.tokens real. Returns (y, the cache after
        the n_valid real rows, staging): on the chain path (decode, verify) staging is the KDAStaged of every
        row, for a verify's `lingjax.cache.commit`; on the chunked path (prefill) None."""
        t, start = paths.tokens, positions[0]
        h, dk = self.b_proj.shape[0], cfg.kda_head_dim  # heads on this device (all of them without TP)
        with jax.named_scope("kda_proj"):
            w = self.in_proj[...]  # [5, P, D]: the reshape is free, the five slices are contiguous
            stacked = w.flatten_rows() if isinstance(w, Fp8Array) else w.reshape(-1, w.shape[-1])
            proj = project(x, stacked, paths)  # [rows, 5P] = q | k | v | f | g
            p = w.shape[1]  # channels on this device
            # the recurrence and the conv carry state from row to row: they read the real rows only
            qkv, g_out = proj[:t, : 3 * p], proj[:, 4 * p :]
        conv_w = self.conv[...].reshape(-1, self.conv.shape[-1])  # [3P, W], q|k|v blocks, no copy
        ring = cache.conv.reshape(cache.conv.shape[0], -1)  # [N, 3, P] -> [N, 3P], q|k|v blocks
        params = (conv_w, self.a_log[...], self.dt_bias[...])
        gate_cfg = dict(num_heads=h, safe_gate=cfg.kda_safe_gate, lower_bound=cfg.kda_lower_bound)
        with jax.named_scope("kda_recurrence"):
            if paths.kda_chunked:  # rows == T: no padding rows to skip
                with jax.named_scope("kda_gate"):
                    b = narrow_linear(x, materialize(self.b_proj[...]), paths)  # [T, H]
                f, width = proj[:t, 3 * p : 4 * p], conv_w.shape[1]
                window = kda_ops.ring_window(ring, start, width)
                q, k, v, g, beta, window = kda_ops.kda_prepare(qkv, f, b, window, *map(materialize, params), n_valid,
                                                               **gate_cfg)
                # q, k, v at the activations' precision, as the checkpoint's own model feeds fla's chunk_kda
                # (the Pallas prefill then takes its bf16 path; the state stays f32)
                q, k, v = (a.astype(x.dtype) for a in (q, k, v))
                ring = kda_ops.ring_write(ring, window, start + n_valid - (width - 1))  # the window's own slots
                o, state = paths.op("kda_chunked")(q, k, v, g, beta, cache.state)
                staged = None
            else:  # all T tokens are real here (prefill pads only to chunked sizes)
                # proj and x whole: the op reads the real rows in place (b = x·b_projᵀ inside) and returns
                # o on all rows, zero past T, so no slice, pad or b kernel sits on either side of it; it
                # writes the rows' conv inputs into the ring in place
                o, staged, ring = paths.op("kda_chain")(proj, x, dense(self.b_proj[...], x.dtype), ring, start,
                                                        *params, cache.state,
                                                        tokens=t, **gate_cfg)
                state = staged[-1]
            conv = ring.reshape(cache.conv.shape)
        with jax.named_scope("kda_out"):
            gate = g_out.reshape(paths.rows, h, dk)
            y = gated_rms_norm(o, self.o_norm[...], gate, cfg.rms_norm_eps).astype(x.dtype)  # o: [rows, H, V]
            y = row_linear(y.reshape(paths.rows, h * dk), self.o_proj[...], paths)
        return y, KDACache(state=state, conv=conv), None if staged is None else KDAStaged(states=staged, conv=conv)


class MLAAttention(nnx.Module):
    def __init__(self, cfg: LingConfig, init: ParamInit):
        d, h = cfg.hidden_size, cfg.num_heads
        self.q_proj = init.matrix(h * cfg.qk_head_dim, d)
        self.kv_a_proj = init.matrix(cfg.mla_cache_dim, d)
        self.kv_a_norm = init.norm(cfg.kv_lora_rank)
        self.kv_b_proj = init.matrix(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        self.g_proj = init.matrix(h, d)
        self.o_proj = init.matrix(d, h * cfg.v_head_dim)

    def __call__(self, cfg: LingConfig, x, cache: MLACache, positions, n_valid, paths: Paths):
        """x: [rows, D] at `positions`, the first paths.tokens real; padded rows attend too (at the positions
        after the real ones) but write nothing. Returns (y, cache, None): nothing to stage (the latent cache's
        slots past the committed length are masked by position)."""
        t = x.shape[0]
        h = self.g_proj.shape[0]  # heads on this device
        n, r, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        with jax.named_scope("mla_proj"):
            q = project(x, self.q_proj[...], paths).reshape(t, h, n + r)
            q_nope, q_pe = q[..., :n], rope_interleaved(q[..., n:], positions, cfg.rope_theta)
            kva = project(x, self.kv_a_proj[...], paths)
            c = rms_norm(kva[:, :lat], self.kv_a_norm[...], cfg.rms_norm_eps)
            k_pe = rope_interleaved(kva[:, lat:], positions, cfg.rope_theta)
        with jax.named_scope("mla_cache_write"):
            entry = jnp.concatenate([c, k_pe], -1)[: paths.tokens].astype(cache.latent.dtype)
            latent = jax.lax.dynamic_update_slice_in_dim(cache.latent, entry, positions[0], axis=0)
        with jax.named_scope("mla_attention"):
            core = paths.op("mla_absorbed" if paths.mla_absorbed else "mla_expanded")
            w_kvb, scale = dense(self.kv_b_proj[...], x.dtype), cfg.qk_head_dim**-0.5
            o = core(q_nope, q_pe, latent, w_kvb, positions, scale, tokens=paths.tokens)
            if paths.ex.tap is not None:  # the real rows' weights over the cache [T, H, L], for lingjax.inspection
                p = mla_ops.attention_weights(q_nope, q_pe, latent, w_kvb, positions, scale)
                paths.ex.observe("mla_attention", p[: paths.tokens])
        with jax.named_scope("mla_out"):
            gate = jax.nn.sigmoid(narrow_linear(x, self.g_proj[...], paths).astype(F32))  # [T, H]
            o = (o * gate[..., None]).astype(x.dtype).reshape(t, h * cfg.v_head_dim)
            y = row_linear(o, self.o_proj[...], paths)
        return y, MLACache(latent=latent), None


class DenseMLP(nnx.Module):
    def __init__(self, cfg: LingConfig, init: ParamInit, width: int, limit: float = 0.0):
        d = cfg.hidden_size
        self.gate_proj, self.up_proj, self.down_proj = (
            init.matrix(width, d),
            init.matrix(width, d),
            init.matrix(d, width),
        )
        self.limit = limit

    def partial(self, x, paths: Paths):  # -> f32 [rows, D] (under TP: this device's partial sum, for the caller's psum)
        with jax.named_scope("dense_mlp"):
            g, u = project(x, self.gate_proj[...], paths, F32), project(x, self.up_proj[...], paths, F32)
            return project(moe_ops.swiglu(g, u, self.limit).astype(x.dtype), self.down_proj[...], paths, F32)

    def __call__(self, cfg: LingConfig, x, paths: Paths):  # -> [rows, D] in x's dtype, all-reduced once
        return paths.ex.psum(self.partial(x, paths)).astype(x.dtype)


class MoE(nnx.Module):
    def __init__(self, cfg: LingConfig, init: ParamInit, layer_id: int):
        d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.router = init.matrix(e, d)
        self.router_bias = init.param((e,), ("normal", 0.0, 0.1), F32)
        self.w_gate, self.w_up, self.w_down = init.matrix(e, i, d), init.matrix(e, i, d), init.matrix(e, d, i)
        self.limit = cfg.swiglu_limit(layer_id, shared=False)
        self.shared = (
            DenseMLP(cfg, init, cfg.shared_intermediate_size, cfg.swiglu_limit(layer_id, shared=True))
            if cfg.shared_intermediate_size else None
        )

    def fuses_shared(self) -> bool:
        """Whether the shared expert runs inside the experts op (in the Pallas kernels: as extra blocks of the
        same launches): it has the routed experts' width and storage (both fp8 or both plain)."""
        shared = self.shared
        return (shared is not None and shared.gate_proj.shape == self.w_gate.shape[1:]
                and isinstance(shared.gate_proj, Fp8Weight) == isinstance(self.w_gate, Fp8Weight))

    def routing(self, cfg: LingConfig, paths: Paths) -> dict:
        return dict(top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                    scaling=cfg.routed_scaling_factor, renormalize=cfg.norm_topk_prob,
                    precision=paths.ex.router_precision)

    def route(self, cfg: LingConfig, x, paths: Paths):
        """-> (weights [rows, k] f32, experts [rows, k] int32), the real rows' experts shown to Exec.tap as
        "moe_route". A Pallas decode (T = 1) routes inside its expert launches instead and never calls it."""
        with jax.named_scope("moe_router"):
            weights, experts = paths.op("moe_route")(x, dense(self.router[...], F32), self.router_bias[...],
                                                     **self.routing(cfg, paths))
        paths.ex.observe("moe_route", experts[: paths.tokens])
        return weights, experts

    def __call__(self, cfg: LingConfig, x, paths: Paths):
        """x: [rows, D]: all rows are routed (one router GEMM shape), the real ones alone reach the
        experts (padded rows would read experts of their own). -> [rows, D] in x's dtype, all-reduced once."""
        w = (self.w_gate[...], self.w_up[...], self.w_down[...])
        shared = self.shared
        fuse = self.fuses_shared()
        extra = dict(shared=(shared.gate_proj[...], shared.up_proj[...], shared.down_proj[...]),
                     shared_limit=shared.limit) if fuse else {}
        routed_args = (x, dense(self.router[...], F32), self.router_bias[...], *w, self.limit)
        routed_kwargs = dict(tokens=1, **self.routing(cfg, paths), **extra)
        # decode: the up kernel routes the token itself, no select launch. Where a GPU refuses that kernel the
        # decode routes and runs the experts as a verify does (one form for both: row invariance)
        if (paths.decode and paths.ex.runs_pallas("moe_experts") and paths.ex.runs_pallas("moe_route")
                and paths.ex.runs_kernel("moe_routed_experts", *routed_args, **routed_kwargs)):
            with jax.named_scope("moe_experts"):
                y = paths.op("moe_routed_experts")(*routed_args, **routed_kwargs)
        else:
            weights, experts = self.route(cfg, x, paths)
            with jax.named_scope("moe_experts"):
                y = paths.op("moe_experts")(x, *w, weights, experts, self.limit, tokens=paths.tokens, **extra)
        with jax.named_scope("moe_experts"):
            y = paths.pad(y)
        if shared is not None and not fuse:
            with jax.named_scope("moe_shared"):
                y = y + shared.partial(x, paths)
        return paths.ex.psum(y).astype(x.dtype)  # one all-reduce, one rounding of routed + shared


class DecoderLayer(nnx.Module):
    """Pre-norm block: h = x + Attn(norm(x)); y = h + FFN(norm(h))."""

    def __init__(self, cfg: LingConfig, init: ParamInit, layer_id: int, attn_kind: str, mlp_kind: str):
        self.input_norm = init.norm(cfg.hidden_size)
        self.post_norm = init.norm(cfg.hidden_size)
        self.attn = KDAAttention(cfg, init) if attn_kind == KDA else MLAAttention(cfg, init)
        self.mlp = MoE(cfg, init, layer_id) if mlp_kind == MOE else DenseMLP(cfg, init, cfg.intermediate_size)

    def __call__(self, cfg: LingConfig, x, cache, positions, n_valid, paths: Paths):
        """-> (y, cache, staging): the attention's cache and staging (see KDAAttention, MLAAttention)."""
        a, cache, staging = self.attn(cfg, rms_norm(x, self.input_norm[...], cfg.rms_norm_eps), cache, positions,
                                      n_valid, paths)
        h = x + a
        return h + self.mlp(cfg, rms_norm(h, self.post_norm[...], cfg.rms_norm_eps), paths), cache, staging


class MTPLayer(nnx.Module):
    """NEXTN draft layer (docs/model.md §7): [embed(x_{p+1}); h_p] -> MLA + MoE block -> z_p."""

    def __init__(self, cfg: LingConfig, init: ParamInit):
        self.enorm, self.hnorm = init.norm(cfg.hidden_size), init.norm(cfg.hidden_size)
        self.eh_proj = init.matrix(cfg.hidden_size, 2 * cfg.hidden_size)
        self.block = DecoderLayer(cfg, init, cfg.mtp_layer_id, "mla", MOE)
        self.final_norm = init.norm(cfg.hidden_size)

    def __call__(self, cfg: LingConfig, embedded, hidden, cache: MLACache, positions, n_valid, paths: Paths):
        """embedded: [T, D] embeddings of x_{p+1}; hidden: [T, D] target hidden h_p (post final norm).
        Returns (z [T, D] post final_layernorm, cache)."""
        eps = cfg.rms_norm_eps
        embedded, hidden = paths.pad(embedded), paths.pad(hidden)
        u = jnp.concatenate([rms_norm(embedded, self.enorm[...], eps), rms_norm(hidden, self.hnorm[...], eps)], -1)
        with jax.named_scope("eh_proj"):
            u = project(u, self.eh_proj[...], paths)
        u, cache, _ = self.block(cfg, u, cache, positions, n_valid, paths)
        return rms_norm(u, self.final_norm[...], eps)[: paths.tokens], cache


class LingModel(nnx.Module):
    def __init__(self, cfg: LingConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None,
                 with_mtp: bool | None = None, fp8: Fp8Layout | None = None):
        """fp8: the matrices kept in fp8 on the device (random weights quantized; None: none)."""
        init = ParamInit(rngs or nnx.Rngs(0), dtype)
        d = cfg.hidden_size
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed = init.matrix(cfg.vocab_size, d)
        self.layers = nnx.List(
            DecoderLayer(cfg, init, i, a, m) for i, (a, m) in enumerate(zip(cfg.layer_types, cfg.mlp_types))
        )
        self.final_norm = init.norm(d)
        self.lm_head = init.matrix(cfg.vocab_size, d)
        with_mtp = cfg.num_nextn_predict_layers > 0 if with_mtp is None else with_mtp
        self.mtp = MTPLayer(cfg, init) if with_mtp else None
        if fp8 is not None:
            quantize_matrices(self, fp8)

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    def embed_tokens(self, tokens):
        w = self.embed[...]
        if isinstance(w, Fp8Array):  # a checkpoint's fp8 embeddings: the rows' values and their scales' rows
            gn, gk = w.block
            scale = jnp.repeat(w.scale[tokens // gn], gk, axis=-1)
            return (w.q[tokens].astype(F32) * scale).astype(self.dtype)
        return w[tokens]

    def forward(self, tokens, cache: ModelCache, start, n_valid, ex: Exec = Exec()):
        """tokens: [T] int32 at positions start..start+T-1, of which the first n_valid are real
        (n_valid < T only on the chunked path, T > VERIFY_ROWS). Returns (hidden [T, D] after the final
        norm, updated cache)."""
        x, layers, _, _ = self._layers(tokens, cache, start, n_valid, ex)
        return x, ModelCache(layers=layers)

    def forward_features(self, tokens, cache: ModelCache, start, n_valid, ex: Exec = Exec(), capture=()):
        """forward, also returning the residual streams after the layers `capture` names (0-based), concatenated in
        that order: (hidden [T, D], cache, features [T, len(capture)·D]). What a block drafter reads."""
        x, layers, _, features = self._layers(tokens, cache, start, n_valid, ex, capture)
        return x, ModelCache(layers=layers), features

    def verify(self, tokens, cache: ModelCache, start, ex: Exec = Exec(), capture=()):
        """Speculative verify over T <= VERIFY_ROWS tokens: MLA caches and KDA conv rings are written at
        start..start+T-1, KDA caches are otherwise left as they are (the returned cache holds them). Returns
        (hidden [T, D], cache, staging: per layer KDAStaged or None, features [T, len(capture)·D] as
        forward_features') for `lingjax.cache.commit`, which takes each KDA layer's state and ring from its
        staging."""
        if tokens.shape[0] > VERIFY_ROWS:
            raise ValueError(f"a verify takes at most {VERIFY_ROWS} tokens, got {tokens.shape[0]}")
        x, layers, staging, features = self._layers(tokens, cache, start, tokens.shape[0], ex, capture)
        # a KDA layer keeps its committed cache until commit; every other layer's cache is the forward's
        layers = tuple(old if st is not None else new for old, new, st in zip(cache.layers, layers, staging))
        return x, ModelCache(layers=layers), staging, features

    def _layers(self, tokens, cache, start, n_valid, ex, capture=()):
        """-> (hidden [T, D] after the final norm, each layer's cache after the forward, each layer's staging,
        the residual streams after the `capture` layers [T, len(capture)·D])."""
        cfg = self.cfg
        paths = paths_for(tokens.shape[0], ex)
        positions = start + jnp.arange(paths.rows, dtype=jnp.int32)
        x = paths.pad(self.embed_tokens(tokens))
        layers, staging, captured = [], [], {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers)):
            with jax.named_scope(f"layer{i}_{cfg.layer_types[i]}"):
                x, layer_cache, staged = layer(cfg, x, layer_cache, positions, n_valid, paths)
            # every layer's output is materialized behind a barrier, in every program: the layers around it then
            # fuse, and so round, alike whether or not a program reads it (a block drafter's feature layers), so a
            # plain program's tokens do not depend on whether a drafter is loaded (docs/engine.md, row invariance)
            x = jax.lax.optimization_barrier(x)
            layers.append(layer_cache)
            staging.append(staged)
            if i in capture:
                captured[i] = x[: paths.tokens]
        features = jnp.concatenate([captured[i] for i in capture], -1) if capture else x[: paths.tokens, :0]
        return (rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)[: paths.tokens], tuple(layers), tuple(staging),
                features)

    def lm_logits(self, hidden, pad_small: bool = True, ex: Exec = Exec()):
        """hidden: [..., D] -> f32 logits [..., V] (under TP: this device's vocabulary shard; see
        Exec.argmax_vocab / gather_vocab). Up to VERIFY_ROWS rows run as VERIFY_ROWS (row invariance: a
        decode's one row and a verify's rows get the same GEMM), unless pad_small=False (drafts)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        n = flat.shape[0]
        paths = paths_for(n, ex, pad_small)
        with jax.named_scope("lm_head"):
            logits = project(paths.pad(flat), self.lm_head[...], paths, F32)
        return logits[:n].reshape(hidden.shape[:-1] + logits.shape[-1:])

    def mtp_forward(self, tokens, hidden, cache: MLACache, start, n_valid, ex: Exec = Exec()):
        """MTP rows at positions start..start+T-1 with (x_{p+1} = tokens, h_p = hidden), the first
        n_valid real. Returns (z [T, D] post final_layernorm, the MTP layer's updated latent cache).
        Unpadded rows (paths_for's pad_small=False): drafts need no row invariance."""
        if self.mtp is None:
            raise ValueError("this model has no MTP layer")
        paths = paths_for(tokens.shape[0], ex, pad_small=False)
        positions = start + jnp.arange(paths.rows, dtype=jnp.int32)
        with jax.named_scope("mtp"):
            return self.mtp(self.cfg, self.embed_tokens(tokens), hidden, cache, positions, n_valid, paths)


def abstract_model(cfg: LingConfig, dtype=jnp.bfloat16, with_mtp: bool | None = None,
                   fp8: Fp8Layout | None = None) -> LingModel:
    """The model's structure with ShapeDtypeStructs for leaves: no memory is touched."""
    return nnx.eval_shape(lambda: LingModel(cfg, dtype=dtype, rngs=nnx.Rngs(0), with_mtp=with_mtp, fp8=fp8))


def fp8_layout(cfg: LingConfig, tp: int = 1, with_mtp: bool | None = None, scale_fmt: str = "float32") -> Fp8Layout:
    """The layout of a model quantized by lingjax (random fp8 weights, a bf16 checkpoint quantized as it loads):
    every matrix lingjax.quantization.QUANTIZED_NAMES names but those held dense (DENSE_ON_DEVICE), in the official
    128 x 128 blocks, cut for tp."""

    state = nnx.state(abstract_model(cfg, with_mtp=with_mtp), nnx.Param)
    paths = [path_keys(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    return Fp8Layout(quantized_paths(paths), tp=tp, scale_fmt=scale_fmt)


def param_count(model: LingModel) -> int:
    """The model's weights (an fp8 matrix counts its elements, not its scales)."""

    state = nnx.state(model, nnx.Param)
    return sum(int(x.size) for path, x in jax.tree_util.tree_leaves_with_path(state) if path_keys(path)[-1] != "scale")
