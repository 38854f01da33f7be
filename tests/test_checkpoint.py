"""Loading official-layout checkpoints, the orbax fast path, and one clear error per bad case."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import lingjax
from conftest import FIXTURES, rel_err
from lingjax.checkpoint import CheckpointError, convert, save_safetensors
from lingjax.model import LingModel

SINGLE = FIXTURES / "tiny_a"  # one model.safetensors, HF-saved config
SHARDED = FIXTURES / "tiny_c"  # shards + index + MTP tensors


def _copy(src, tmp_path):
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, edit):
    """Apply edit(dict of tensors) to one safetensors file."""
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _file_holding(directory, name):
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return directory / json.loads(index.read_text())["weight_map"][name]
    return directory / "model.safetensors"


def _load_error(directory) -> str:
    with pytest.raises(CheckpointError) as info:
        lingjax.load(directory, dtype="float32")
    return str(info.value)


def test_sharded_with_mtp_and_single_without():
    assert lingjax.load(SHARDED, dtype="float32").has_mtp
    assert not lingjax.load(SINGLE, dtype="float32").has_mtp


def test_missing_tensor(tmp_path):
    d = _copy(SINGLE, tmp_path)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(d / "model.safetensors", lambda t: t.pop(name))
    msg = _load_error(d)
    assert "missing" in msg and name in msg


def test_unexpected_tensor(tmp_path):
    d = _copy(SINGLE, tmp_path)
    _rewrite(
        d / "model.safetensors", lambda t: t.update({"model.layers.0.attention.extra.weight": np.ones(3, np.float32)})
    )
    msg = _load_error(d)
    assert "unexpected" in msg and "model.layers.0.attention.extra.weight" in msg and "model.safetensors" in msg


def test_wrong_shape(tmp_path):
    d = _copy(SHARDED, tmp_path)
    name = "model.layers.2.attention.kv_b_proj.weight"
    f = _file_holding(d, name)
    _rewrite(f, lambda t: t.update({name: t[name][:-1]}))
    msg = _load_error(d)
    assert name in msg and f.name in msg and "shape" in msg


def test_wrong_dtype(tmp_path):
    d = _copy(SINGLE, tmp_path)
    name = "model.norm.weight"
    _rewrite(d / "model.safetensors", lambda t: t.update({name: t[name].astype(np.int32)}))
    msg = _load_error(d)
    assert name in msg and "dtype" in msg and "I32" in msg


def test_truncated_file(tmp_path):
    d = _copy(SHARDED, tmp_path)
    f = sorted(d.glob("model-*.safetensors"))[0]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    msg = _load_error(d)
    assert f.name in msg and "truncated" in msg


@pytest.mark.parametrize("name,bad", [("model.norm.weight", np.nan),
                                      ("model.layers.1.mlp.experts.3.up_proj.weight", np.inf)])
def test_nonfinite_weights_are_refused_naming_the_tensor(tmp_path, name, bad):
    """A NaN or an infinity anywhere in a tensor is refused at load, naming it (a stacked expert by its own name)."""
    d = _copy(SINGLE, tmp_path)

    def poison(tensors):
        value = tensors[name].copy()
        value.flat[np.random.default_rng().integers(value.size)] = bad
        tensors[name] = value

    _rewrite(d / "model.safetensors", poison)
    msg = _load_error(d)
    assert "NaN or infinite" in msg and name in msg and "experts.2." not in msg


def test_config_that_does_not_match_tensors(tmp_path):
    d = _copy(SINGLE, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(d)
    assert "config.json implies" in msg and "experts.0.gate_proj.weight" in msg


def test_index_pointing_at_wrong_file(tmp_path):
    d = _copy(SHARDED, tmp_path)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    others = sorted(set(index["weight_map"].values()) - {index["weight_map"][name]})
    index["weight_map"][name] = others[0]
    index_path.write_text(json.dumps(index))
    msg = _load_error(d)
    assert name in msg and others[0] in msg


def test_output_projection_both_spellings_rejected(tmp_path):
    d = _copy(SINGLE, tmp_path)
    dense = "model.layers.0.attention.dense.weight"
    _rewrite(d / "model.safetensors", lambda t: t.update({dense.replace("dense", "o_proj"): t[dense]}))
    msg = _load_error(d)
    assert "both" in msg and dense in msg


def test_output_projection_neither_spelling_rejected(tmp_path):
    d = _copy(SINGLE, tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.0.attention.dense.weight"))
    msg = _load_error(d)
    assert "missing" in msg and "o_proj" in msg and "dense" in msg


def test_partial_mtp_layer_rejected(tmp_path):
    d = _copy(SHARDED, tmp_path)
    name = "model.layers.6.eh_proj.weight"
    _rewrite(_file_holding(d, name), lambda t: t.pop(name))
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    assert name in _load_error(d)


def test_alternate_layouts_load_identically(tmp_path):
    """A_log as [1, 1, H, 1], conv weights as [C, W], router bias as e_score_correction_bias, bf16 data."""
    d = _copy(SINGLE, tmp_path)
    want = lingjax.load(SINGLE, dtype="float32").logits([3, 1, 4, 1, 5])

    def edit(t):
        t["model.layers.0.attention.A_log"] = t["model.layers.0.attention.A_log"].reshape(1, 1, -1, 1)
        t["model.layers.0.attention.q_conv1d.weight"] = t["model.layers.0.attention.q_conv1d.weight"][:, 0]
        t["model.layers.1.mlp.gate.e_score_correction_bias"] = t.pop("model.layers.1.mlp.gate.expert_bias")

    _rewrite(d / "model.safetensors", edit)
    assert rel_err(lingjax.load(d, dtype="float32").logits([3, 1, 4, 1, 5]), want) < 1e-6


def test_save_load_round_trip_and_orbax(tmp_path):
    """The tiny preset (SwiGLU limits, MTP) written in the official layout, sharded, in bf16;
    loaded back, then converted to orbax and loaded in both dtypes."""
    model = lingjax.load("tiny", dtype="bfloat16", seed=7)
    save_safetensors(model.module, tmp_path / "hf", max_tensors_per_file=60)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    back = lingjax.load(tmp_path / "hf", dtype="bfloat16")
    assert back.has_mtp and back.cfg == model.cfg
    for a, b in zip(
        jax.tree.leaves(nnx.state(model.module, nnx.Param)), jax.tree.leaves(nnx.state(back.module, nnx.Param))
    ):
        assert a.dtype == b.dtype and bool(jnp.array_equal(a, b))
    tokens = [5, 9, 2, 6, 5, 3]
    convert(tmp_path / "hf", tmp_path / "orbax", dtype=jnp.bfloat16)
    fast = lingjax.load(tmp_path / "orbax", dtype="bfloat16")
    assert fast.has_mtp and rel_err(fast.logits(tokens), model.logits(tokens)) == 0.0
    f32 = lingjax.load(tmp_path / "orbax", dtype="float32")
    assert f32.dtype == jnp.float32 and f32.module.layers[0].attn.a_log.dtype == jnp.float32
    for a, b in zip(
        jax.tree.leaves(nnx.state(model.module, nnx.Param)), jax.tree.leaves(nnx.state(f32.module, nnx.Param))
    ):
        assert bool(jnp.array_equal(a.astype(jnp.float32), b))  # bf16 -> f32 is exact
    # an orbax checkpoint of an older parameter layout says so, instead of failing inside orbax
    meta = tmp_path / "orbax" / "lingjax.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "layout": 1}))
    with pytest.raises(CheckpointError, match="parameter layout 1.*lingjax convert"):
        lingjax.load(tmp_path / "orbax")


def test_official_spelling_equals_hf_spelling():
    """tiny_official's config.json is in the official spelling; re-spelled through LingConfig it loads
    the same model."""
    model = lingjax.load(FIXTURES / "tiny_official", dtype="float32")
    raw = json.loads((FIXTURES / "tiny_official" / "config.json").read_text())
    assert "num_experts_per_tok" in raw and "linear_head_dim" not in raw
    assert model.cfg == lingjax.LingConfig.from_hf(model.cfg.to_hf())


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="preset"):
        lingjax.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        lingjax.load(tmp_path / "empty")


def test_random_init_module_is_nnx():
    assert isinstance(lingjax.load("tiny").module, LingModel)
