"""`lingjax convert`: an official checkpoint to lingjax's orbax format (`convert`), or an official bf16 (or f32)
checkpoint to the official fp8 layout (`convert_fp8`), its tokenizer files copied along.

Each checks every header of the source against the name table before it writes a file, so a source that does
not match its config fails before any output exists. The module is `conversion`, not `convert`, so that
`lingjax.checkpoint.convert` names one thing: the function.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
from safetensors.numpy import save_file

from lingjax.checkpoint.fp8 import FP8_NOT_CONVERTED, SCALE_SUFFIX, quantizes
from lingjax.checkpoint.names import INDEX_FILE, CheckpointError
from lingjax.checkpoint.orbax import save_orbax
from lingjax.checkpoint.safetensors import Files, load_safetensors, resolve
from lingjax.config import LingConfig
from lingjax.model import LingModel
from lingjax.ops import fp8 as fp8_ops
from lingjax.quantization import Fp8Config
from lingjax.tokenizer import TOKENIZER_FILES


def convert(hf_dir: str | Path, out_dir: str | Path, dtype=jnp.bfloat16,
            progress: Callable[[int, int], None] | None = None) -> LingModel:
    """Official safetensors checkpoint -> lingjax orbax checkpoint (the fast load path)."""
    hf_dir = Path(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    cfg = LingConfig.from_hf(raw)
    model = load_safetensors(hf_dir, cfg, dtype, progress=progress)
    save_orbax(model, out_dir, raw)
    _copy_tokenizer(hf_dir, Path(out_dir))
    return model


def convert_fp8(hf_dir: str | Path, out_dir: str | Path, scale_fmt: str = "float32",
                progress: Callable[[int, int], None] | None = None) -> Fp8Config:
    """An official bf16 (or f32) checkpoint -> the same checkpoint in the official fp8 layout (128 x 128 blocks;
    FP8_NOT_CONVERTED, vectors, embeddings and conv taps left as they are), file by file (host memory holds one
    file's tensors), with its tokenizer files. The source is checked whole first. Returns the layout written."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    if raw.get("quantization_config") is not None:
        raise CheckpointError(f"{hf_dir}: already quantized (config.json has a quantization_config)")
    files = Files(hf_dir)
    resolve(LingConfig.from_hf(raw), files)
    fp8 = Fp8Config(scale_fmt=scale_fmt, not_converted=FP8_NOT_CONVERTED)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for done, (name, handle) in enumerate(files.handles.items(), 1):
        tensors = {}
        for key in handle.keys():
            array = files.read(key)
            if quantizes(fp8, key, array.shape):
                tensors[key], tensors[key + SCALE_SUFFIX] = fp8_ops.quantize(array, fp8.block, fp8.scale_fmt)
            else:
                tensors[key] = array
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        if progress:
            progress(done, len(files.handles))
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (out_dir / "config.json").write_text(json.dumps(raw | {"quantization_config": fp8.to_hf()}, indent=2))
    _copy_tokenizer(hf_dir, out_dir)
    return fp8


def _copy_tokenizer(hf_dir: Path, out_dir: Path) -> None:
    for extra in TOKENIZER_FILES:  # the tokenizer, its special tokens and chat template, the stop ids
        if (hf_dir / extra).exists():
            shutil.copy(hf_dir / extra, out_dir / extra)
