"""The official fp8 layout on disk: `lingjax convert --fp8` writes it from a fixture, the loader reads it as a plain
dequantize-then-load reference does, and every inconsistency is one CheckpointError naming tensor and file."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from conftest import FIXTURES, rel_err
from lingjax import checkpoint, cli
from lingjax.checkpoint import INDEX_FILE, CheckpointError
from lingjax.checkpoint.safetensors import Files as _Files
from lingjax.config import ConfigError, LingConfig
from lingjax.ops import fp8
from lingjax.quantization import Fp8Config

SOURCE = FIXTURES / "tiny_c"


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "tiny_c_fp8"
    checkpoint.convert_fp8(SOURCE, out)
    return out


def _tensors(directory):
    files = _Files(directory)
    return {key: files.read(key) for key in files.where}


def _rewrite(src, dst, edit):
    """A copy of checkpoint src in one file, its tensors passed through edit(dict) and its config through
    edit's optional second return value."""
    shutil.copytree(src, dst)
    tensors = _tensors(dst)
    for p in list(dst.glob("*.safetensors")) + [dst / INDEX_FILE]:
        p.unlink(missing_ok=True)
    config = json.loads((dst / "config.json").read_text())
    config = edit(tensors, config) or config
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _load(directory, weights="dense"):
    """The checkpoint loaded in f32; weights="dense" dequantizes its fp8 matrices (tests/test_fp8_device.py keeps
    them in fp8)."""
    return checkpoint.load_safetensors(directory, LingConfig.from_file(directory / "config.json"), jnp.float32,
                                       weights=weights)


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_convert_writes_the_layout(fp8_dir):
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128],
                                             "modules_to_not_convert": ["lm_head", "mlp.gate"]}
    tensors = _tensors(fp8_dir)
    quantized = [k for k, v in tensors.items() if v.dtype == np.dtype(fp8.FP8)]
    assert quantized and all(k + "_scale_inv" in tensors for k in quantized)
    assert any(".experts." in k for k in quantized) and any("attention.q_proj" in k for k in quantized)
    for k, v in tensors.items():  # what stays: router, lm_head, embeddings, norms, vectors, conv taps
        if k.endswith(("mlp.gate.weight", "lm_head.weight", "word_embeddings.weight", "layernorm.weight")) \
                or v.ndim != 2:
            assert v.dtype != np.dtype(fp8.FP8), k
    assert (fp8_dir / "tokenizer.json").exists() == (SOURCE / "tokenizer.json").exists()


def test_fp8_loads_as_dequantize_then_load(fp8_dir, tmp_path):
    """The loader's fp8 path equals a checkpoint dequantized beforehand in plain numpy (q * the scale of each
    element's block, f32), parameter for parameter, exactly; and stays within e4m3's rounding of the source."""
    def dequantize_all(tensors, config):
        for key in [k for k in tensors if k.endswith("_scale_inv")]:
            scale, weight = tensors.pop(key), key[: -len("_scale_inv")]
            q = tensors[weight].astype(np.float32)
            full = np.kron(scale, np.ones((128, 128), np.float32))[: q.shape[0], : q.shape[1]]
            tensors[weight] = q * full
        config.pop("quantization_config")

    reference = _load(_rewrite(fp8_dir, tmp_path / "dequantized", dequantize_all))
    got, source = _params(_load(fp8_dir)), _params(_load(SOURCE))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, _params(reference))
    errors = jax.tree.leaves(jax.tree.map(lambda a, b: rel_err(a, b), got, source))
    assert max(errors) < 2.0**-4 and sum(e == 0 for e in errors) < len(errors)


def test_ue8m0_scales(tmp_path):
    out = tmp_path / "ue8m0"
    layout = checkpoint.convert_fp8(SOURCE, out, scale_fmt="ue8m0")
    assert layout.scale_fmt == "ue8m0"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    scales = [v for k, v in _tensors(out).items() if k.endswith("_scale_inv")]
    assert scales and all((np.exp2(np.round(np.log2(s))) == s).all() for s in scales)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, _params(_load(out)), _params(_load(SOURCE))))) < 2.0**-4


def _first_quantized(tensors, part="attention.q_proj.weight"):
    return next(k for k, v in tensors.items() if k.endswith(part) and v.dtype == np.dtype(fp8.FP8))


@pytest.mark.parametrize("case, message", [
    ("missing scale", "is F8_E4M3 but its scales .*_scale_inv are missing"),
    ("scale shape", "_scale_inv in .*model.safetensors has shape \\[1, 2\\], but .* needs \\[1, 1\\]"),
    ("scale dtype", "_scale_inv in .*model.safetensors has dtype BF16; fp8 scales are F32"),
    ("no quantization_config", "is F8_E4M3, but config.json has no quantization_config"),
    ("listed as not converted", "is F8_E4M3, but quantization_config lists .*q_proj as not converted"),
    ("vector in fp8", "is F8_E4M3, but only matrix weights"),
])
def test_inconsistent_layouts_name_tensor_and_file(fp8_dir, tmp_path, case, message):
    def edit(tensors, config):
        key = _first_quantized(tensors)
        if case == "missing scale":
            del tensors[key + "_scale_inv"]
        elif case == "scale shape":
            tensors[key + "_scale_inv"] = np.ones((1, 2), np.float32)
        elif case == "scale dtype":
            tensors[key + "_scale_inv"] = tensors[key + "_scale_inv"].astype(jnp.bfloat16)
        elif case == "no quantization_config":
            config.pop("quantization_config")
        elif case == "listed as not converted":
            config["quantization_config"]["modules_to_not_convert"].append("attention.q_proj")
        elif case == "vector in fp8":
            norm = next(k for k in tensors if k.endswith("input_layernorm.weight"))
            tensors[norm] = tensors[norm].astype(np.float32).astype(fp8.FP8)
    broken = _rewrite(fp8_dir, tmp_path / "broken", edit)
    with pytest.raises(CheckpointError, match=message):
        _load(broken)


@pytest.mark.parametrize("raw, message", [
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ({"quant_method": "fp8", "scale_fmt": "e8m0"}, "scale_fmt 'e8m0'"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["lm_head"], "ignored_layers": ["mlp.gate"]}, "they differ"),
    ({"quant_method": "fp8", "ignored_layers": "lm_head"}, "must be lists of module names"),
])
def test_quantization_config_errors(raw, message):
    with pytest.raises(ConfigError, match=message):
        Fp8Config.from_hf({"quantization_config": raw})


def test_quantization_config_reads_both_spellings():
    a = Fp8Config.from_hf({"quantization_config": {"quant_method": "fp8", "ignored_layers": ["lm_head"]}})
    assert a.not_converted == ("lm_head",) and a.excludes("lm_head") and a.excludes("model.layers.3.lm_head")
    assert not a.excludes("model.layers.3.mlp.gate") and not a.excludes("xlm_head")
    assert Fp8Config.from_hf({}) is None and Fp8Config.from_hf({"quantization_config": a.to_hf()}) == a


def test_cli_convert_fp8(tmp_path, capsys):
    try:
        code = cli.main(["convert", str(SOURCE), str(tmp_path / "out"), "--fp8"])
    except SystemExit as done:
        code = done.code
    assert code == 0 and "wrote" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    for argv, message in ((["--scale-fmt", "ue8m0"], "--scale-fmt has no effect without --fp8"),
                          (["--fp8", "--dtype", "float32"], "--dtype has no effect with --fp8")):
        try:
            code = cli.main(["convert", str(SOURCE), str(tmp_path / "other"), *argv])
        except SystemExit as done:
            code = done.code
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("lingjax: error:") and message in err, err
        assert not (tmp_path / "other").exists()
