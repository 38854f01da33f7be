"""`save_safetensors`: a model written in the official safetensors layout, the inverse of load_safetensors.

It writes config.json and every tensor of the name table under its first spelling, in one file or sharded with an
index, and with an Fp8Config in the official fp8 layout. It refuses a model holding fp8 on the device. It exists to
make test checkpoints from random models of any config.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from lingjax.checkpoint.fp8 import SCALE_SUFFIX, quantizes, refuse_device_fp8
from lingjax.checkpoint.names import INDEX_FILE, tensor_table
from lingjax.checkpoint.params import get_at, pure_params
from lingjax.model import LingModel
from lingjax.ops import fp8 as fp8_ops
from lingjax.quantization import Fp8Config


def save_safetensors(model: LingModel, out_dir: str | Path, max_tensors_per_file: int = 0,
                     fp8: Fp8Config | None = None) -> None:
    """Write a model in the official layout (config.json + safetensors, sharded with an index when
    max_tensors_per_file > 0): the inverse of load_safetensors, used to make test checkpoints. With `fp8`, in
    the fp8 layout: every matrix weight not listed in fp8.not_converted as float8_e4m3fn with its scales, and
    config.json's quantization_config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.cfg.to_hf() | ({"quantization_config": fp8.to_hf()} if fp8 else {})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    refuse_device_fp8(model, "save_safetensors")
    params = pure_params(model)
    tensors = {}
    for spec in tensor_table(model.cfg, model.has_mtp):
        array = np.asarray(get_at(params, spec.path))
        array = np.ascontiguousarray((array[spec.index] if spec.index is not None else array).reshape(spec.shape))
        name = spec.names[0]
        if fp8 and quantizes(fp8, name, spec.shape):
            tensors[name], tensors[name + SCALE_SUFFIX] = fp8_ops.quantize(array, fp8.block, fp8.scale_fmt)
        else:
            tensors[name] = array
    names = list(tensors)
    per_file = max_tensors_per_file or len(names)
    chunks = [names[i : i + per_file] for i in range(0, len(names), per_file)]
    if len(chunks) == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for k, chunk in enumerate(chunks, 1):
        fname = f"model-{k:05d}-of-{len(chunks):05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
