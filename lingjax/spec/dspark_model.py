"""The DSpark block drafter's network (docs/dspark.md): DFlash's backbone with DSpark's two heads.

From the target it takes its embeddings, its lm_head and the residual streams after `target_layer_ids`:

    ctx_p   = hidden_norm(fc([r_{l1,p}; r_{l2,p}; ...]))             [D]   one row per committed position p
    block   = embed([b, MASK, ..., MASK]) at positions s..s+γ-1       [γ, D]
    layer:  q, k, v of the block; k, v of ctx (each layer's own k_proj/v_proj, k_norm, rope at ctx positions);
            the block attends to ctx rows p < s and to every block row (no causal mask inside the block)
    U_k     = lm_head(norm(h_{k-1}))                                  row k-1 (the anchor's is k = 1) predicts x_{s+k}
    Markov  logits_k = U_k + W1[x_{k-1}] · W2                         x_0 = b; left to right (vanilla head)
    conf    c_k = sigmoid(w · [h_{k-1}; W1[x_{k-1}]] + w0)            P(x_k survives | x_<k survived)

One implementation serves inference (one block against the context cache, lingjax.spec.dspark) and training
(many blocks of a sequence against that sequence's context, lingjax.train.dspark): `blocks` takes [nb, γ]
blocks and a context of C rows with a [nb, C] visibility mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lingjax.ops.linear import linear
from lingjax.ops.norms import rms_norm
from lingjax.ops.rope import rope_half
from lingjax.param_init import ParamInit

F32 = jnp.float32


class DSparkConfigError(ValueError):
    """A DSpark draft config that lingjax cannot interpret."""


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    block_size: int  # γ: drafts one block proposes (the verify takes up to γ + 1 rows)
    target_layer_ids: tuple[int, ...]  # the target's residual streams after these layers (0-based) feed ctx
    mask_token_id: int  # the token of the block's rows after the anchor
    markov_rank: int  # r of the Markov head (W1 [V, r], W2 [r, V])
    num_layers: int
    hidden_size: int  # the target's (embeddings and lm_head are shared)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    # > 0: the Markov bias is added to the markov_topk best base logits alone, the rest of the vocabulary left
    # out of the draft (W2 is read for those rows only: at a large vocabulary the full W2 per draft is most of
    # a round's bytes); 0: the whole vocabulary (exact). Drafts only: acceptance stays lossless either way.
    markov_topk: int = 0

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("block_size", "markov_rank", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "vocab_size"):
            if int(getattr(self, name)) < 1:
                raise DSparkConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.target_layer_ids:
            raise DSparkConfigError("target_layer_ids is empty")
        if self.num_heads % self.num_kv_heads:
            raise DSparkConfigError(f"{self.num_heads} heads do not share {self.num_kv_heads} KV heads evenly")
        if self.head_dim % 2:
            raise DSparkConfigError(f"head_dim {self.head_dim} is odd (rope rotates halves)")
        if not 0 <= self.markov_topk <= self.vocab_size:
            raise DSparkConfigError(f"markov_topk {self.markov_topk} outside [0, {self.vocab_size}]")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DSparkConfigError(f"mask_token_id {self.mask_token_id} outside the vocabulary of {self.vocab_size}")

    @property
    def feature_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def check_target(self, target_cfg) -> None:
        """Raise DSparkConfigError unless this draft fits the target (a lingjax.config.LingConfig)."""
        if (self.hidden_size, self.vocab_size) != (target_cfg.hidden_size, target_cfg.vocab_size):
            raise DSparkConfigError(
                f"the draft's hidden size {self.hidden_size} and vocabulary {self.vocab_size} are not the "
                f"target's ({target_cfg.hidden_size}, {target_cfg.vocab_size}): embeddings and lm_head are shared")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target_cfg.num_hidden_layers]
        if bad:
            raise DSparkConfigError(
                f"target_layer_ids {bad} outside the target's {target_cfg.num_hidden_layers} layers"
            )

    # ---- config.json --------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DSparkConfig:
        """A draft config.json in any of its spellings (docs/dspark.md): lingjax's own (to_hf); the native one, a
        Qwen3 config with the DSpark fields at the top level, under `dspark_config` / `dflash_config`, or as
        `dspark_*` root keys (read in that order of precedence, root keys first, as SGLang does); or the Speculators
        one (`speculators_model_type: "dspark"`: the backbone in `transformer_layer_config`, target layers as
        `aux_hidden_state_layer_ids` counting the embedding as 0, `block_size` counting the anchor's row unless
        `sample_from_anchor`, which defaults to true)."""
        if raw.get("speculators_model_type") == "dspark":
            base = dict(raw.get("transformer_layer_config") or {})
            aux = raw.get("aux_hidden_state_layer_ids")
            if not isinstance(aux, list) or not aux:
                raise DSparkConfigError("a Speculators DSpark config needs aux_hidden_state_layer_ids")
            block = int(raw.get("block_size", 0)) - (0 if raw.get("sample_from_anchor", True) else 1)
            flat = {**base, **{k: raw[k] for k in ("mask_token_id", "markov_rank", "markov_head_type",
                                                   "enable_confidence_head", "confidence_head_with_markov")
                               if k in raw},
                    "block_size": block, "target_layer_ids": [int(i) - 1 for i in aux],
                    "vocab_size": raw.get("draft_vocab_size", base.get("vocab_size"))}
            if raw.get("draft_vocab_size") not in (None, base.get("vocab_size")):
                raise DSparkConfigError(f"a draft vocabulary of {raw['draft_vocab_size']} tokens (a d2t/t2d "
                                        "mapping) is not supported; lingjax drafts over the target's vocabulary")
        else:
            flat = dict(raw)
            for nested in ("dflash_config", "dspark_config"):
                if isinstance(raw.get(nested), dict):
                    flat = {**raw[nested], **{k: v for k, v in flat.items() if k != nested}}
            for key in ("block_size", "target_layer_ids", "markov_rank", "markov_head_type"):
                if raw.get(f"dspark_{key}") is not None:
                    flat[key] = raw[f"dspark_{key}"]
            if raw.get("dspark_noise_token_id") is not None:
                flat["mask_token_id"] = raw["dspark_noise_token_id"]

        def pick(*names, default=None):
            for name in names:
                if flat.get(name) is not None:
                    return flat[name]
            if default is None:
                raise DSparkConfigError(f"the draft config has none of {names}")
            return default

        if pick("markov_head_type", default="vanilla") != "vanilla":
            raise DSparkConfigError(f"markov_head_type {flat['markov_head_type']!r}: lingjax runs the vanilla "
                                    "Markov head only")
        if not pick("enable_confidence_head", default=True) or not pick("confidence_head_with_markov", default=True):
            raise DSparkConfigError("lingjax needs the confidence head, fed with the Markov code "
                                    "(enable_confidence_head and confidence_head_with_markov)")
        hidden = int(pick("hidden_size"))
        heads = int(pick("num_attention_heads", "num_heads"))
        return cls(
            block_size=int(pick("block_size")),
            target_layer_ids=tuple(pick("target_layer_ids")),
            mask_token_id=int(pick("mask_token_id")),
            markov_rank=int(pick("markov_rank")),
            num_layers=int(pick("num_hidden_layers", "num_layers")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(pick("num_key_value_heads", "num_kv_heads", default=heads)),
            head_dim=int(pick("head_dim", default=hidden // heads)),
            intermediate_size=int(pick("intermediate_size")),
            vocab_size=int(pick("vocab_size")),
            rms_norm_eps=float(pick("rms_norm_eps", default=1e-6)),
            rope_theta=float(pick("rope_theta", default=1e6)),
            markov_topk=int(pick("markov_topk", "dspark_draft_topk", default=0)),
        )

    def to_hf(self) -> dict[str, Any]:
        """The native spelling (a Qwen3 config with the DSpark fields at the top level)."""
        return {
            "architectures": ["DSparkDraftModel"], "model_type": "qwen3",
            "block_size": self.block_size, "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id, "markov_rank": self.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": True, "confidence_head_with_markov": True,
            "num_hidden_layers": self.num_layers, "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            **({"markov_topk": self.markov_topk} if self.markov_topk else {}),
        }


# ---- the network ------------------------------------------------------------------------------------
def block_attention(q, k, v, k_ctx, v_ctx, ctx_mask) -> jax.Array:
    """Each block row attends to the visible context rows and to every row of its own block.

    q [nb, γ, H, d]; k, v [nb, γ, G, d] (the block's own); k_ctx, v_ctx [C, G, d]; ctx_mask bool [nb, C]
    -> [nb, γ, H, d] in q's dtype. One softmax over both parts, in f32; H = G·(heads per KV head)."""
    nb, g_len, h, d = q.shape
    groups = k.shape[2]
    qg = q.reshape(nb, g_len, groups, h // groups, d)
    scale = d**-0.5
    s_ctx = jnp.einsum("nqgjd,cgd->ngjqc", qg, k_ctx, preferred_element_type=F32) * scale
    s_blk = jnp.einsum("nqgjd,nbgd->ngjqb", qg, k, preferred_element_type=F32) * scale
    s_ctx = jnp.where(ctx_mask[:, None, None, None, :], s_ctx, -jnp.inf)
    p = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], -1), axis=-1)
    c = k_ctx.shape[0]
    o = (jnp.einsum("ngjqc,cgd->nqgjd", p[..., :c].astype(v_ctx.dtype), v_ctx, preferred_element_type=F32)
         + jnp.einsum("ngjqb,nbgd->nqgjd", p[..., c:].astype(v.dtype), v, preferred_element_type=F32))
    return o.reshape(nb, g_len, h, d).astype(q.dtype)


class DraftLayer(nnx.Module):
    """A pre-norm decoder layer whose attention also reads the context's keys and values."""

    def __init__(self, cfg: DSparkConfig, init: ParamInit):
        d, h, g, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.input_norm = init.norm(d)
        self.q_proj, self.k_proj, self.v_proj = init.matrix(h * hd, d), init.matrix(g * hd, d), init.matrix(g * hd, d)
        self.q_norm, self.k_norm = init.norm(hd), init.norm(hd)
        self.o_proj = init.matrix(d, h * hd)
        self.post_norm = init.norm(d)
        self.gate_proj, self.up_proj = init.matrix(cfg.intermediate_size, d), init.matrix(cfg.intermediate_size, d)
        self.down_proj = init.matrix(d, cfg.intermediate_size)

    def keys_values(self, cfg: DSparkConfig, x, positions):
        """x [..., D] (already normed) at positions [...] -> (k, v) [..., G, d]: k normed per head and roped."""
        g, hd = cfg.num_kv_heads, cfg.head_dim
        k = linear(x, self.k_proj[...]).reshape(x.shape[:-1] + (g, hd))
        k = rope_half(rms_norm(k, self.k_norm[...], cfg.rms_norm_eps), positions, cfg.rope_theta)
        return k, linear(x, self.v_proj[...]).reshape(x.shape[:-1] + (g, hd))

    def __call__(self, cfg: DSparkConfig, x, positions, k_ctx, v_ctx, ctx_mask):
        """x [nb, γ, D] at positions [nb, γ]; the context's k_ctx, v_ctx [C, G, d] and ctx_mask [nb, C]."""
        a = rms_norm(x, self.input_norm[...], cfg.rms_norm_eps)
        q = linear(a, self.q_proj[...]).reshape(x.shape[:-1] + (cfg.num_heads, cfg.head_dim))
        q = rope_half(rms_norm(q, self.q_norm[...], cfg.rms_norm_eps), positions, cfg.rope_theta)
        k, v = self.keys_values(cfg, a, positions)
        o = block_attention(q, k, v, k_ctx, v_ctx, ctx_mask)
        h = x + linear(o.reshape(x.shape[:-1] + (-1,)), self.o_proj[...])
        m = rms_norm(h, self.post_norm[...], cfg.rms_norm_eps)
        act = jax.nn.silu(linear(m, self.gate_proj[...], F32)) * linear(m, self.up_proj[...], F32)
        return h + linear(act.astype(x.dtype), self.down_proj[...])


class DSparkDraft(nnx.Module):
    """The drafter's own weights; embeddings and lm_head are the target's (passed in by the callers)."""

    def __init__(self, cfg: DSparkConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        init = ParamInit(rngs or nnx.Rngs(0), dtype)
        d, r, v = cfg.hidden_size, cfg.markov_rank, cfg.vocab_size
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.fc = init.matrix(d, cfg.feature_size)
        self.hidden_norm = init.norm(d)
        self.layers = nnx.List(DraftLayer(cfg, init) for _ in range(cfg.num_layers))
        self.norm = init.norm(d)
        self.markov_w1 = init.param((v, r), ("normal", 0.0, 1.0))  # W1 [V, r]: the previous token's code
        self.markov_w2 = init.param((v, r), ("normal", 0.0, r**-0.5 * 0.1))  # W2ᵀ [V, r]: the code's bias on the next
        self.confidence_w = init.matrix(1, d + r, dtype=F32)
        self.confidence_b = nnx.Param(jnp.zeros((1,), F32))

    # ---- the context ----------------------------------------------------------------------------
    def context(self, features) -> jax.Array:
        """features [..., F] (the target layers' residual streams, concatenated) -> ctx [..., D]."""
        return rms_norm(linear(features.astype(self.dtype), self.fc[...]), self.hidden_norm[...], self.cfg.rms_norm_eps)

    def context_kv(self, features, positions):
        """features [C, F] at positions [C] -> every layer's context keys and values, each [L, C, G, d]."""
        ctx = self.context(features)
        kv = [layer.keys_values(self.cfg, ctx, positions) for layer in self.layers]
        return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])

    # ---- blocks -----------------------------------------------------------------------------------
    def blocks(self, embedded, positions, k_ctx, v_ctx, ctx_mask) -> jax.Array:
        """embedded [nb, γ, D] (the target's embeddings of [anchor, MASK...]) at positions [nb, γ]; k_ctx,
        v_ctx [L, C, G, d] (context_kv); ctx_mask bool [nb, C] -> h [nb, γ, D] after the final norm: row k-1
        of a block gives U_k through the target's lm_head."""
        x = embedded.astype(self.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(self.cfg, x, positions, k_ctx[i], v_ctx[i], ctx_mask)
        return rms_norm(x, self.norm[...], self.cfg.rms_norm_eps)

    # ---- heads ------------------------------------------------------------------------------------
    def markov_code(self, prev_tokens) -> jax.Array:
        """W1[x_{k-1}]: prev_tokens [...] -> [..., r]."""
        return self.markov_w1[...][prev_tokens]

    def markov_bias(self, code, rows=None) -> jax.Array:
        """code [..., r] -> the Markov term of the logits, f32 [..., V]; with rows [..., K] (token ids; the leading
        dims broadcast against code's) the term of those tokens alone, [..., K], reading only their rows of W2."""
        if rows is None:
            return jnp.einsum("...r,vr->...v", code, self.markov_w2[...], preferred_element_type=F32)
        return jnp.einsum("...r,...kr->...k", code, self.markov_w2[...][rows], preferred_element_type=F32)

    def confidence_logit(self, h, code) -> jax.Array:
        """h [..., D] (row k-1's final hidden), code [..., r] (W1[x_{k-1}]) -> f32 [...]: logit of c_k."""
        z = jnp.concatenate([h.astype(F32), code.astype(F32)], -1)
        return z @ self.confidence_w[...][0] + self.confidence_b[...][0]


def abstract_draft(cfg: DSparkConfig, dtype=jnp.bfloat16) -> DSparkDraft:
    return nnx.eval_shape(lambda: DSparkDraft(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
