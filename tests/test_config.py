"""LingConfig: both config.json spellings, the layer pattern, limits, and the real Flash size."""

import dataclasses
import json

import pytest

from conftest import FIXTURES
from lingjax.config import KDA, MLA, ConfigError, LingConfig, official_layer_pattern, preset
from lingjax.model import abstract_model, param_count


def test_flash_preset_shape_and_parameter_count():
    cfg = preset("flash")
    assert [i for i, t in enumerate(cfg.layer_types) if t == MLA] == [5, 11, 17, 23, 29, 35, 41]
    assert cfg.mlp_types[:2] == ("dense", "dense") and set(cfg.mlp_types[2:]) == {"moe"}
    assert cfg.kda_head_dim == 128 and cfg.qk_head_dim == 192 and cfg.mla_cache_dim == 576
    without = param_count(abstract_model(cfg, with_mtp=False))
    with_mtp = param_count(abstract_model(cfg, with_mtp=True))
    assert round(without / 1e9, 1) == 124.4  # docs/model.md §9: 124.41 B
    assert round(with_mtp / 1e9, 1) == 127.5  # 127.49 B
    # §9: MLA 31,965,696 + MoE 3,027,108,352 + eh_proj 2560·5120 + five norms of 2560
    assert with_mtp - without == 31_965_696 + 3_027_108_352 + 2560 * 5120 + 5 * 2560


def test_trailing_incomplete_group_is_all_mla():
    assert official_layer_pattern(8, 3) == (KDA, KDA, MLA, KDA, KDA, MLA, MLA, MLA)
    assert official_layer_pattern(6, 3) == (KDA, KDA, MLA, KDA, KDA, MLA)


def test_both_spellings_parse():
    official = json.loads((FIXTURES / "tiny_official" / "config.json").read_text())
    hf = json.loads((FIXTURES / "tiny_a" / "config.json").read_text())
    assert "n_group" in official and "num_expert_group" in hf
    a, b = LingConfig.from_hf(official), LingConfig.from_hf(hf)
    assert a.kda_head_dim == 16 and b.kda_head_dim == 16  # head_dim vs linear_head_dim
    assert b.qk_rope_head_dim == hf["head_dim"] == 8  # HF's head_dim holds the rope dim
    assert a.n_group == official["n_group"] and b.n_group == hf["num_expert_group"]
    assert a.num_experts_per_tok == official["num_experts_per_tok"]
    assert b.num_experts_per_tok == hf["num_experts_per_token"]
    assert b.norm_topk_prob == hf["moe_renormalize"]
    assert b.max_position_embeddings == hf["model_max_length"]
    for cfg in (a, b, preset("flash"), preset("tiny")):
        assert LingConfig.from_hf(cfg.to_hf()) == cfg


def test_swiglu_limits_by_layer_id():
    cfg = preset("flash")
    assert cfg.swiglu_limit(34, shared=False) == 0.0 and cfg.swiglu_limit(35, shared=False) == 4.0
    assert cfg.swiglu_limit(34, shared=True) == 5.0 and cfg.swiglu_limit(41, shared=True) == 7.0
    assert cfg.swiglu_limit(cfg.mtp_layer_id, shared=False) == 0.0  # past the list's end: no clamp
    raw = {**cfg.to_hf(), "expert_swiglu_limit_list": [None, 0, 3.5], "share_expert_swiglu_limit_list": None}
    cfg2 = LingConfig.from_hf(raw)
    assert [cfg2.swiglu_limit(i, False) for i in range(4)] == [0.0, 0.0, 3.5, 0.0]
    assert cfg2.swiglu_limit(2, shared=True) == 0.0


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "bailing_hybrid"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope scaling"),
    ({"q_lora_rank": 1536}, "q_lora_rank"),
    ({"num_experts": 15}, "divisible"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_bad_configs_fail_clearly(change, message):
    raw = {**preset("tiny").to_hf(), **change}
    with pytest.raises(ConfigError, match=message):
        LingConfig.from_hf(raw)


def test_config_is_frozen():
    cfg = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1
    assert dataclasses.replace(cfg, num_nextn_predict_layers=0).num_nextn_predict_layers == 0
