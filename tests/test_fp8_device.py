"""fp8 weights kept on the device (lingjax.model.Fp8Weight): loading them from the official layout, quantizing a bf16
checkpoint or a preset's random weights as they are made, the model's results against the dequantized model, any
TP size, and lossless speculation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lingjax
from conftest import FIXTURES, layer_shards, rel_err
from lingjax import checkpoint, engine
from lingjax.checkpoint import CheckpointError
from lingjax.checkpoint.safetensors import Files as _Files
from lingjax.config import LingConfig
from lingjax.model import Fp8Weight
from lingjax.ops import fp8
from lingjax.sharding import path_keys

SOURCE = FIXTURES / "tiny_c"


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_device") / "tiny_c_fp8"
    checkpoint.convert_fp8(SOURCE, out)
    return out


def _fp8_weights(model):
    return {path: m for path, m in nnx.iter_modules(model.module) if isinstance(m, Fp8Weight)}


def test_fp8_checkpoint_stays_fp8_and_equals_the_dequantized_model(fp8_dir):
    """weights="auto" keeps every fp8 matrix in fp8 (the stored values, bit for bit), its scales the stored ones;
    the model's logits equal those of the same checkpoint loaded dequantized (weights="dense"), exactly: the XLA
    path dequantizes in the graph to the same values."""
    dense = lingjax.load(fp8_dir, dtype="float32", kernels="xla", weights="dense")
    kept = lingjax.load(fp8_dir, dtype="float32", kernels="xla")
    assert kept.fp8 and not dense.fp8
    stored = _Files(fp8_dir)
    quantized = [k for k in stored.where if stored.header(k)[1] == checkpoint.FP8_DTYPE]
    on_device = _fp8_weights(kept)
    assert len(on_device) > 0
    kv_a = next(k for k in quantized if k.endswith("attention.kv_a_proj_with_mqa.weight"))  # an MLA layer's
    weight = on_device[("layers", int(kv_a.split(".")[2]), "attn", "kv_a_proj")]
    np.testing.assert_array_equal(np.asarray(weight.q[...]).view(np.uint8), stored.read(kv_a).view(np.uint8))
    np.testing.assert_array_equal(  # its scales refined to the device blocks: the same values
        np.asarray(weight[...].dequantize(jnp.float32)),
        np.asarray(fp8.dequantize(stored.read(kv_a), stored.read(kv_a + checkpoint.SCALE_SUFFIX), jnp.float32)))
    # the matrices read dense are stored in fp8 but held dense, at the stored values dequantized
    kv_b = next(k for k in quantized if k.endswith("attention.kv_b_proj.weight"))
    layer = int(kv_b.split(".")[2])
    assert ("layers", layer, "attn", "kv_b_proj") not in on_device
    want = fp8.dequantize(stored.read(kv_b), stored.read(kv_b + checkpoint.SCALE_SUFFIX), jnp.float32)
    np.testing.assert_array_equal(np.asarray(kept.module.layers[layer].attn.kv_b_proj[...]), np.asarray(want))
    assert not {path[-1] for path in on_device} & {"b_proj", "g_proj", "kv_b_proj"}
    tokens = np.arange(3, 40) % kept.cfg.vocab_size
    np.testing.assert_array_equal(kept.logits(tokens), dense.logits(tokens))
    # half the bytes of every quantized matrix
    bytes_of = lambda m: sum(w.nbytes for w in m.weights)
    assert bytes_of(kept) < 0.6 * bytes_of(dense)


@pytest.mark.slow
def test_bf16_checkpoint_quantized_as_it_loads():
    """weights="fp8" on a bf16 checkpoint quantizes every matrix but the router, lm_head and embeddings, each
    element within e4m3's rounding of the source; the logits stay close to the source model's."""
    source = lingjax.load(SOURCE, dtype="float32", kernels="xla")
    model = lingjax.load(SOURCE, dtype="float32", kernels="xla", weights="fp8")
    weights = _fp8_weights(model)
    names = {path[-1] for path in weights}
    assert {"in_proj", "q_proj", "w_gate", "w_down", "o_proj"} <= names
    assert not names & {"router", "lm_head", "embed"}
    for path, w in weights.items():
        want = source.module
        for key in path:
            want = want[key] if isinstance(key, int) else getattr(want, key)
        want = np.asarray(want[...])
        got = np.asarray(w[...].dequantize(jnp.float32))
        block_max = np.abs(want).max()
        assert np.all(np.abs(got - want) <= 2.0**-4 * np.abs(want) + 2.0**-9 * block_max / 448 * 64), path
    tokens = np.arange(5, 30) % model.cfg.vocab_size
    assert rel_err(model.logits(tokens), source.logits(tokens)) < 0.1


@pytest.mark.slow
def test_preset_fp8_weights_are_the_same_at_every_tp():
    """A preset in fp8 is a function of the seed: at TP 2 and 4 (tiny's expert width 32 splits into 8-row shards,
    cutting its blocks: scales refined to 8-row device blocks) the model's logits equal TP 1's to f32 rounding,
    and each device holds its shard of q and of the scales."""
    one = lingjax.load("tiny", dtype="float32", kernels="xla", weights="fp8")
    tokens = np.arange(5, 29)
    want = one.logits(tokens)
    for tp in (2, 4):
        model = lingjax.load("tiny", dtype="float32", kernels="xla", weights="fp8", tp=tp)
        gate = model.params["layers"][1]["mlp"]["w_gate"]
        scale = gate["scale"].get_value()
        assert scale.shape[1] == tp * one.params["layers"][1]["mlp"]["w_gate"]["scale"].get_value().shape[1]
        assert {shape[1] for shape in layer_shards(scale)} == {scale.shape[1] // tp}
        assert {shape[1] for shape in layer_shards(gate["q"].get_value())} == {model.cfg.moe_intermediate_size // tp}
        assert rel_err(model.logits(tokens), want) < 1e-5


@pytest.mark.slow
def test_fp8_at_tp8_matches_tp1():
    """TP8 on tiny widened to 8 heads: an fp8 model drawn for 8 devices (every block cut to 4-row device blocks in
    the expert width's shards of 4) gives TP1's logits."""
    from lingjax.config import PRESETS
    from lingjax.model import fp8_layout
    from lingjax.random_weights import random_model
    from lingjax.runtime import Model, RunOptions
    from lingjax.sharding import mesh_for

    cfg = LingConfig.from_hf({**PRESETS["tiny"], "num_attention_heads": 8, "num_key_value_heads": 8})
    models = [Model(random_model(cfg, jnp.float32, 3, mesh_for(cfg, tp), fp8=fp8_layout(cfg, tp)),
                    RunOptions(kernels="xla"), mesh=mesh_for(cfg, tp)) for tp in (1, 8)]
    assert models[1].params["layers"][1]["mlp"]["w_gate"]["scale"].get_value().shape[1] == 8
    tokens = np.arange(7, 30)
    assert rel_err(models[1].logits(tokens), models[0].logits(tokens)) < 1e-5


@pytest.mark.slow
def test_fp8_pallas_model_matches_xla():
    """The fp8 kernels (interpret mode) in the whole model: the same logits as the XLA references, to f32
    reassociation (the kernel multiplies unrounded q·s; the reference dequantizes to f32 first)."""
    model = lingjax.load("tiny", dtype="float32", kernels="xla", weights="fp8")
    tokens = np.arange(5, 25)
    want = model.incremental_logits(tokens, 16)
    assert rel_err(model.variant(kernels="pallas").incremental_logits(tokens, 16), want) < 1e-5


@pytest.mark.slow
def test_nextn_with_fp8_weights_is_lossless():
    """Greedy NEXTN speculation over fp8 weights (the shipped model quantized as it loads: its MTP layer drafts
    real tokens) equals plain greedy decoding over them, token for token."""
    from lingjax.shipped import default_checkpoint

    model = lingjax.load(default_checkpoint(), dtype="float32", kernels="xla", weights="fp8")
    prompt = "def fibonacci(n):\n    "
    plain = engine.generate(model, prompt, max_new_tokens=24)
    spec = engine.generate(model, prompt, max_new_tokens=24, spec="nextn", steps=3)
    assert spec.tokens == plain.tokens
    assert max(spec.accept_lens) > 1  # some drafts were accepted


def test_writers_refuse_fp8_on_the_device(tmp_path):
    model = lingjax.load("tiny", dtype="float32", weights="fp8")
    with pytest.raises(ValueError, match="fp8 matrices on the device"):
        checkpoint.save_safetensors(model.module, tmp_path / "out")


def test_load_checks_weights_and_mixed_stacks(fp8_dir, tmp_path):
    with pytest.raises(ValueError, match="weights must be one of"):
        lingjax.load("tiny", weights="int4")
    # one expert of a stacked parameter left in bf16: refused, naming both tensors
    import json
    import shutil

    from safetensors.numpy import save_file

    dst = tmp_path / "mixed"
    shutil.copytree(fp8_dir, dst)
    files = _Files(dst)
    tensors = {k: files.read(k) for k in files.where}
    key = next(k for k in tensors if k.endswith("experts.3.up_proj.weight"))
    tensors[key] = fp8.dequantize(tensors[key], tensors.pop(key + checkpoint.SCALE_SUFFIX), jnp.float32)
    tensors[key] = np.asarray(tensors[key])
    for p in list(dst.glob("*.safetensors")) + [dst / checkpoint.INDEX_FILE]:
        p.unlink(missing_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = LingConfig.from_file(dst / "config.json")
    with pytest.raises(CheckpointError, match="stacked into the same parameter"):
        checkpoint.load_safetensors(dst, cfg, jnp.float32)
    # dense loading still reads it
    model = checkpoint.load_safetensors(dst, cfg, jnp.float32, weights="dense")
    assert not any(isinstance(m, Fp8Weight) for _, m in nnx.iter_modules(model))
    del json


def test_param_count_counts_elements_not_scales():
    dense = lingjax.load("tiny", dtype="float32")
    quantized = lingjax.load("tiny", dtype="float32", weights="fp8")
    assert quantized.num_params() == dense.num_params()
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(quantized.module, nnx.Param))
    assert any(path_keys(p)[-1] == "scale" for p, _ in leaves)
