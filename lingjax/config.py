"""LingConfig: the one place that knows HF config.json field names.

config.json comes in two spellings (see docs/model.md §1):
- the official checkpoint's (architectures BailingMoeV3ForCausalLM; n_group, num_experts_per_tok,
  norm_topk_prob, max_position_embeddings; head_dim is the KDA head dim; no layer_types list), and
- the one HF's save_pretrained writes (num_expert_group, num_experts_per_token, moe_renormalize,
  model_max_length; linear_head_dim is the KDA head dim while head_dim holds the rope dim; explicit
  layer_types and mlp_layer_types).
Every other module reads LingConfig only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from lingjax.presets import PRESETS

KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"

# The most new tokens of one decode or verify forward. Such a forward runs its row-wise ops on exactly this many
# rows (the real ones first, zero-padded), so a row rounds the same in a T = 1 decode and in a verify
# (lingjax.model); the KDA conv ring holds this many slots past the window (lingjax.cache).
VERIFY_ROWS = 16
# NEXTN's drafts per round when a request names none: the shortest round time per accepted token on the shipped
# pair and at Flash's width alike (docs/speculation.md, choosing the depth).
DEFAULT_STEPS = 3


class ConfigError(ValueError):
    """A config.json that lingjax cannot interpret."""


@dataclasses.dataclass(frozen=True)
class LingConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense FFN (first_k_dense_replace layers)
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # KDA or MLA per layer
    mlp_types: tuple[str, ...]  # DENSE or MOE per layer
    # MLA
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_size: int
    kda_safe_gate: bool
    kda_lower_bound: float
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_intermediate_size: int  # 0 = no shared expert
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    # SwiGLU limits indexed by layer id (the MTP layer is id num_hidden_layers); 0 = no clamp.
    expert_swiglu_limits: tuple[float, ...] = ()
    shared_swiglu_limits: tuple[float, ...] = ()
    # misc
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_heads", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim", "conv_size",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
                 "max_position_embeddings")
        bad = [f"{name} = {getattr(self, name)}" for name in sizes if getattr(self, name) < 1]
        bad += [f"{name} = {getattr(self, name)}" for name in ("shared_intermediate_size", "num_nextn_predict_layers")
                if getattr(self, name) < 0]
        if bad:
            raise ConfigError(f"sizes must be positive: {', '.join(bad)}")
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_types) != n:
            raise ConfigError(f"layer_types/mlp_types must have {n} entries")
        if set(self.layer_types) - {KDA, MLA} or set(self.mlp_types) - {DENSE, MOE}:
            raise ConfigError(f"unknown layer types in {self.layer_types} / {self.mlp_types}")
        if MOE in self.mlp_types or self.num_nextn_predict_layers:
            if self.num_experts % self.n_group:
                raise ConfigError(f"num_experts {self.num_experts} not divisible by n_group {self.n_group}")
            if self.num_experts // self.n_group < 2:
                raise ConfigError("group-limited routing needs at least 2 experts per group")
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group {self.topk_group} outside 1..n_group={self.n_group}")
            if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                raise ConfigError("num_experts_per_tok exceeds the experts in the kept groups")
        if self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim must be even (interleaved rope pairs)")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:  # P = H * d
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_cache_dim(self) -> int:  # latent c + roped k_pe per token
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mtp_layer_id(self) -> int:
        return self.num_hidden_layers

    def swiglu_limit(self, layer_id: int, shared: bool) -> float:
        """Clamp for layer `layer_id`; 0.0 means none (missing list, index past its end, null or 0)."""
        limits = self.shared_swiglu_limits if shared else self.expert_swiglu_limits
        if layer_id < len(limits) and limits[layer_id]:
            return float(limits[layer_id])
        return 0.0

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> LingConfig:
        """Build from a config.json dict in either spelling."""
        if raw.get("model_type") not in (None, "bailing_hybrid", "bailing_moe_v3"):
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not bailing_hybrid")

        def get(*names, default=..., kind=None):
            """The first of `names` set in raw (else default), as `kind` (int, float or bool): a value of another
            type is an error naming the key."""
            for name in names:
                if name in raw and raw[name] is not None:
                    return _typed(raw[name], name, kind)
            if default is ...:
                raise ConfigError(f"config.json lacks {' / '.join(names)}")
            return default

        rope = raw.get("rope_parameters") or {}
        if raw.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ConfigError("rope scaling is not supported (Ling-3.0-flash uses plain rope)")
        if get("q_lora_rank", default=None):
            raise ConfigError("q_lora_rank is set; lingjax implements the direct q_proj form only")
        if not get("rope_interleave", default=True):
            raise ConfigError("rope_interleave=false is not supported")
        if get("use_kda_lora", default=False) or not get("no_kda_lora", default=True):
            raise ConfigError("KDA LoRA gates are not supported (Ling-3.0-flash has full-rank f/g proj)")
        if get("gated_attention_proj_granularity_type", default="head_wise") != "head_wise":
            raise ConfigError("only head-wise MLA gates are supported")

        n_layers = get("num_hidden_layers", kind=int)
        heads = get("num_attention_heads", kind=int)
        # KDA head dim: linear_head_dim in HF spelling, head_dim in the official one.
        kda_head_dim = get("linear_head_dim", "head_dim", kind=int)
        group = get("layer_group_size", default=6, kind=int)
        if raw.get("layer_types"):
            names = {"full_attention": MLA, "linear_attention": KDA}
            try:
                layer_types = tuple(names[t] for t in raw["layer_types"])
            except KeyError as e:
                raise ConfigError(f"unknown layer type {e} in layer_types") from None
        else:
            layer_types = official_layer_pattern(n_layers, group)
        first_dense = get("first_k_dense_replace", default=0, kind=int)
        if raw.get("mlp_layer_types"):
            mlp_types = tuple(MOE if t == "sparse" else DENSE for t in raw["mlp_layer_types"])
        else:
            mlp_types = tuple(DENSE if i < first_dense else MOE for i in range(n_layers))

        moe_inter = get("moe_intermediate_size", kind=int)
        n_shared = get("num_shared_experts", "n_shared_experts", default=1, kind=int)
        shared_inter = (
            get("moe_shared_expert_intermediate_size", default=moe_inter * n_shared, kind=int) if n_shared else 0
        )
        eos = raw.get("eos_token_id")
        eos = tuple(_typed(e, "eos_token_id", int) for e in (eos if isinstance(eos, (list, tuple)) else
                                                             () if eos is None else (eos,)))
        return cls(
            vocab_size=get("vocab_size", kind=int),
            hidden_size=get("hidden_size", kind=int),
            intermediate_size=get("intermediate_size", kind=int),
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            mlp_types=mlp_types,
            num_heads=heads,
            kv_lora_rank=get("kv_lora_rank", kind=int),
            qk_nope_head_dim=get("qk_nope_head_dim", kind=int),
            qk_rope_head_dim=get("qk_rope_head_dim", kind=int),
            v_head_dim=get("v_head_dim", kind=int),
            rope_theta=_typed(rope["rope_theta"], "rope_parameters.rope_theta", float) if rope.get("rope_theta")
            else get("rope_theta", default=6e6, kind=float),
            kda_num_heads=get("linear_num_heads", default=heads, kind=int),
            kda_head_dim=kda_head_dim,
            conv_size=get("linear_conv_kernel_dim", "short_conv_kernel_size", default=4, kind=int),
            kda_safe_gate=get("kda_safe_gate", default=True, kind=bool),
            kda_lower_bound=get("kda_lower_bound", default=-5.0, kind=float),
            num_experts=get("num_experts", "num_local_experts", kind=int),
            num_experts_per_tok=get("num_experts_per_tok", "num_experts_per_token", kind=int),
            moe_intermediate_size=moe_inter,
            shared_intermediate_size=shared_inter,
            n_group=get("n_group", "num_expert_group", default=1, kind=int),
            topk_group=get("topk_group", default=1, kind=int),
            routed_scaling_factor=get("routed_scaling_factor", default=1.0, kind=float),
            norm_topk_prob=get("norm_topk_prob", "moe_renormalize", default=True, kind=bool),
            expert_swiglu_limits=_limits(raw, "expert_swiglu_limit_list"),
            shared_swiglu_limits=_limits(raw, "share_expert_swiglu_limit_list"),
            rms_norm_eps=get("rms_norm_eps", default=1e-6, kind=float),
            num_nextn_predict_layers=get("num_nextn_predict_layers", "num_mtp_layers", default=0, kind=int),
            eos_token_ids=eos,
            max_position_embeddings=get("max_position_embeddings", "model_max_length", default=262144, kind=int),
            tie_word_embeddings=get("tie_word_embeddings", default=False, kind=bool),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> LingConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
        try:
            return cls.from_hf(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The official spelling; from_hf(to_hf()) round-trips."""
        return {
            "architectures": ["BailingMoeV3ForCausalLM"],
            "model_type": "bailing_hybrid",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": ["full_attention" if t == MLA else "linear_attention" for t in self.layer_types],
            "mlp_layer_types": ["sparse" if t == MOE else "dense" for t in self.mlp_types],
            "num_attention_heads": self.num_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_theta": self.rope_theta,
            "linear_num_heads": self.kda_num_heads,
            "head_dim": self.kda_head_dim,
            "short_conv_kernel_size": self.conv_size,
            "kda_safe_gate": self.kda_safe_gate,
            "kda_lower_bound": self.kda_lower_bound,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": 1 if self.shared_intermediate_size else 0,
            "moe_shared_expert_intermediate_size": self.shared_intermediate_size,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "expert_swiglu_limit_list": list(self.expert_swiglu_limits),
            "share_expert_swiglu_limit_list": list(self.shared_swiglu_limits),
            "rms_norm_eps": self.rms_norm_eps,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "eos_token_id": list(self.eos_token_ids),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


def official_layer_pattern(num_layers: int, group: int) -> tuple[str, ...]:
    """MLA closes each group; a trailing incomplete group is all MLA (the official engines' rule)."""
    full = (num_layers // group) * group
    return tuple(MLA if (i + 1) % group == 0 or i >= full else KDA for i in range(num_layers))


_KINDS = {int: "an integer", float: "a number", bool: "true or false"}


def _typed(value, name: str, kind):
    """A config.json value as `kind` (None: as it is); a string, a fraction for an int or a non-boolean for a flag
    is an error that names the key."""
    if kind is None:
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {int: number and float(value).is_integer(), float: number,
          bool: isinstance(value, bool) or value in (0, 1)}[kind]
    if not ok:
        raise ConfigError(f"{name} must be {_KINDS[kind]}, got {value!r}")
    return kind(value)


def _limits(raw: dict, name: str) -> tuple[float, ...]:
    values = raw.get(name) or ()
    if not isinstance(values, (list, tuple)):
        raise ConfigError(f"{name} must be a list of numbers, got {values!r}")
    return tuple(_typed(v or 0.0, name, float) for v in values)




def preset(name: str) -> LingConfig:
    """The LingConfig of a named config of lingjax.presets."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return LingConfig.from_hf(PRESETS[name])
