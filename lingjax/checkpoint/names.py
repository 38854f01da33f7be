"""The one name table from an official checkpoint's tensor names to lingjax's parameter paths.

`tensor_table(cfg, with_mtp)` lists every tensor an official (HF) checkpoint holds for a config, in load order:
its accepted spellings (exactly one must be present), the parameter path it fills, its shape in the checkpoint
and, for a parameter stacked from several tensors (experts, a KDA layer's input projections and conv taps), its
index. The loader, the writers and lingjax.train.export all read this table, so the layout (docs/model.md §8) is
spelled in one place. `CheckpointError` is the one error every checkpoint reader raises, naming tensor and file.
"""

from __future__ import annotations

import dataclasses

from lingjax.config import KDA, MOE, LingConfig

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or is damaged; the message names tensor and file."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    names: tuple[str, ...]  # accepted spellings; exactly one must be present
    path: tuple  # parameter path in the model's state
    shape: tuple[int, ...]  # shape in the checkpoint
    index: int | None = None  # index into a stacked [N, ...] parameter (experts, KDA in_proj)


def tensor_table(cfg: LingConfig, with_mtp: bool) -> list[TensorSpec]:
    """Every tensor an official checkpoint holds for `cfg`, in load order."""
    d, v, p, h = cfg.hidden_size, cfg.vocab_size, cfg.kda_dim, cfg.kda_num_heads
    specs = [TensorSpec(("model.word_embeddings.weight",), ("embed",), (v, d))]

    def attn_out(prefix):  # the output projection is spelled both ways in the wild
        return (f"{prefix}attention.dense.weight", f"{prefix}attention.o_proj.weight")

    def mla(prefix, path):
        n, r, nh = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.num_heads
        a = f"{prefix}attention."
        return [
            TensorSpec((a + "q_proj.weight",), path + ("q_proj",), (nh * (n + r), d)),
            TensorSpec((a + "kv_a_proj_with_mqa.weight",), path + ("kv_a_proj",), (cfg.mla_cache_dim, d)),
            TensorSpec((a + "kv_a_layernorm.weight",), path + ("kv_a_norm",), (cfg.kv_lora_rank,)),
            TensorSpec((a + "kv_b_proj.weight",), path + ("kv_b_proj",), (nh * (n + cfg.v_head_dim), cfg.kv_lora_rank)),
            TensorSpec((a + "g_proj.weight",), path + ("g_proj",), (nh, d)),
            TensorSpec(attn_out(prefix), path + ("o_proj",), (d, nh * cfg.v_head_dim)),
        ]

    def kda(prefix, path):
        a = f"{prefix}attention."
        out = [TensorSpec((a + f"{x}_proj.weight",), path + ("in_proj",), (p, d), i) for i, x in enumerate("qkvfg")]
        out += [TensorSpec((a + "b_proj.weight",), path + ("b_proj",), (h, d))]
        out += [TensorSpec((a + f"{x}_conv1d.weight",), path + ("conv",), (p, 1, cfg.conv_size), i)
                for i, x in enumerate("qkv")]
        out += [
            TensorSpec((a + "A_log",), path + ("a_log",), (h,)),
            TensorSpec((a + "dt_bias",), path + ("dt_bias",), (p,)),
            TensorSpec((a + "o_norm.weight",), path + ("o_norm",), (cfg.kda_head_dim,)),
            TensorSpec(attn_out(prefix), path + ("o_proj",), (d, p)),
        ]
        return out

    def dense_mlp(prefix, path, width):
        return [
            TensorSpec((f"{prefix}gate_proj.weight",), path + ("gate_proj",), (width, d)),
            TensorSpec((f"{prefix}up_proj.weight",), path + ("up_proj",), (width, d)),
            TensorSpec((f"{prefix}down_proj.weight",), path + ("down_proj",), (d, width)),
        ]

    def moe(prefix, path):
        m, i = f"{prefix}mlp.", cfg.moe_intermediate_size
        out = [
            TensorSpec((m + "gate.weight",), path + ("router",), (cfg.num_experts, d)),
            TensorSpec((m + "gate.expert_bias", m + "gate.e_score_correction_bias"), path + ("router_bias",),
                       (cfg.num_experts,)),
        ]
        for e in range(cfg.num_experts):
            x = f"{m}experts.{e}."
            out += [
                TensorSpec((x + "gate_proj.weight",), path + ("w_gate",), (i, d), e),
                TensorSpec((x + "up_proj.weight",), path + ("w_up",), (i, d), e),
                TensorSpec((x + "down_proj.weight",), path + ("w_down",), (d, i), e),
            ]
        if cfg.shared_intermediate_size:
            out += dense_mlp(m + "shared_experts.", path + ("shared",), cfg.shared_intermediate_size)
        return out

    def block(prefix, path, attn_kind, mlp_kind):
        out = [
            TensorSpec((prefix + "input_layernorm.weight",), path + ("input_norm",), (d,)),
            TensorSpec((prefix + "post_attention_layernorm.weight",), path + ("post_norm",), (d,)),
        ]
        out += kda(prefix, path + ("attn",)) if attn_kind == KDA else mla(prefix, path + ("attn",))
        out += moe(prefix, path + ("mlp",)) if mlp_kind == MOE else dense_mlp(prefix + "mlp.", path + ("mlp",),
                                                                               cfg.intermediate_size)
        return out

    for n, (attn_kind, mlp_kind) in enumerate(zip(cfg.layer_types, cfg.mlp_types)):
        specs += block(f"model.layers.{n}.", ("layers", n), attn_kind, mlp_kind)
    specs.append(TensorSpec(("model.norm.weight",), ("final_norm",), (d,)))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec(("lm_head.weight",), ("lm_head",), (v, d)))
    if with_mtp:
        x = f"model.layers.{cfg.mtp_layer_id}."
        specs += [
            TensorSpec((x + "enorm.weight",), ("mtp", "enorm"), (d,)),
            TensorSpec((x + "hnorm.weight",), ("mtp", "hnorm"), (d,)),
            TensorSpec((x + "eh_proj.weight",), ("mtp", "eh_proj"), (d, 2 * d)),
            *block(x, ("mtp", "block"), "mla", MOE),
            TensorSpec((x + "final_layernorm.weight",), ("mtp", "final_norm"), (d,)),
        ]
    return specs
