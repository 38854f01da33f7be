"""The official fp8 layout (docs/fp8.md) as a checkpoint stores it, read and written.

A stored fp8 weight is a float8_e4m3fn matrix `X.weight` with an F32 `X.weight_scale_inv` beside it, shaped by
config.json's block size, and no module the quantization_config lists as unconverted is stored in fp8; `check_fp8`
raises one CheckpointError naming tensor and file otherwise. `device_layout` decides which parameters a load keeps
in fp8 on the device (lingjax.model.Fp8Weight, scales cut into device blocks for the TP size) and `read_fp8_param`
reads one of them. `quantizes` and FP8_NOT_CONVERTED say which tensors the writers quantize. The fp8 rules live
here, apart from the loader's plain path, so they read in one place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flax import nnx

from lingjax.checkpoint.names import CheckpointError, TensorSpec
from lingjax.model import Fp8Weight, LingModel, quantizer_block
from lingjax.ops import fp8 as fp8_ops
from lingjax.quantization import Fp8Config, Fp8Layout, held_in_fp8, quantized_paths

if TYPE_CHECKING:  # for annotations only: lingjax.checkpoint.safetensors imports this module
    from lingjax.checkpoint.safetensors import Files

FP8_DTYPE = "F8_E4M3"  # a quantized weight (with a float32 X.weight_scale_inv beside it; docs/fp8.md)
SCALE_SUFFIX = "_scale_inv"

# what `lingjax convert --fp8` leaves unquantized: the router (its choices are discrete) and lm_head (the
# logits); embeddings, norms and the KDA conv taps are no matrices it quantizes
FP8_NOT_CONVERTED = ("lm_head", "mlp.gate")


def read_fp8_config(directory: Path) -> Fp8Config | None:
    """The fp8 layout directory/config.json declares (None: none, or no config.json)."""
    path = directory / "config.json"
    if not path.exists():
        return None
    try:
        return Fp8Config.from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def check_fp8(key: str, spec: TensorSpec, files: Files, fp8: Fp8Config | None) -> str:
    """The checks of one float8_e4m3fn tensor; returns its scale's key."""
    where = files.directory / files.where[key]
    if fp8 is None:
        raise CheckpointError(f"tensor {key} in {where} is {FP8_DTYPE}, but config.json has no quantization_config "
                              "(the fp8 layout's block size and scale format)")
    if len(spec.shape) != 2 or not key.endswith(".weight"):
        raise CheckpointError(f"tensor {key} in {where} is {FP8_DTYPE}, but only matrix weights (X.weight) can be "
                              "quantized")
    module = key[: -len(".weight")]
    if fp8.excludes(module):
        raise CheckpointError(f"tensor {key} in {where} is {FP8_DTYPE}, but quantization_config lists {module} as not "
                              "converted")
    scale_key = key + SCALE_SUFFIX
    if scale_key not in files.where:
        raise CheckpointError(f"tensor {key} in {where} is {FP8_DTYPE} but its scales {scale_key} are missing")
    scale_shape, scale_dtype = files.header(scale_key)
    scale_where = files.directory / files.where[scale_key]
    if scale_dtype != "F32":
        raise CheckpointError(f"tensor {scale_key} in {scale_where} has dtype {scale_dtype}; fp8 scales are F32")
    want = fp8_ops.scale_shape(spec.shape, fp8.block)
    if scale_shape != want:
        raise CheckpointError(f"tensor {scale_key} in {scale_where} has shape {list(scale_shape)}, but {key} "
                              f"{list(spec.shape)} in blocks of {list(fp8.block)} needs {list(want)}")
    return scale_key


def device_layout(files: Files, groups: dict, fp8: Fp8Config | None, weights: str, tp: int) -> Fp8Layout | None:
    """The Fp8Layout a load keeps on the device (None: no fp8 weights): the parameters the checkpoint stores in
    fp8 (all parts of a stacked one alike) but those held dense (lingjax.quantization.held_in_fp8: dequantized as
    they load), and with weights="fp8" every other quantizable matrix too."""
    if weights == "dense":
        return None
    stored = set()
    for path, parts in groups.items():
        kinds = {files.header(key)[1] == FP8_DTYPE for _, key in parts}
        if kinds == {True}:
            stored.add(path)
        elif len(kinds) > 1:
            fp8_key = next(key for _, key in parts if files.header(key)[1] == FP8_DTYPE)
            plain = next(key for _, key in parts if files.header(key)[1] != FP8_DTYPE)
            raise CheckpointError(f"{fp8_key} ({files.where[fp8_key]}) is {FP8_DTYPE} but {plain} "
                                  f"({files.where[plain]}), stacked into the same parameter, is not")
    paths = {p for p in stored if held_in_fp8(p)} | (set(quantized_paths(groups)) if weights == "fp8" else set())
    if not paths:
        return None
    return Fp8Layout(frozenset(paths), block=fp8.block if fp8 else fp8_ops.BLOCK, tp=tp,
                     scale_fmt=fp8.scale_fmt if fp8 else "float32")


def read_fp8_param(files: Files, parts, fp8: Fp8Config | None, target) -> tuple[np.ndarray, np.ndarray]:
    """One fp8 parameter on the host: (q float8_e4m3fn, scales in the target's device blocks), its parts stacked
    (experts, KDA in_proj). A stored fp8 tensor keeps its values, its scales refined to the device blocks; a
    plain one is quantized (lingjax.model.quantizer_block blocks)."""
    q_target, s_target = target["q"], target["scale"]
    (n, k), (sn, sk) = q_target.shape[-2:], s_target.shape[-2:]
    device = (n // sn, k // sk)
    q = np.empty(q_target.shape, q_target.dtype)
    scale = np.empty(s_target.shape, np.float32)
    block = fp8.block if fp8 else fp8_ops.BLOCK
    for spec, key in parts:
        if files.header(key)[1] == FP8_DTYPE:
            values, own = files.read(key), files.read(key + SCALE_SUFFIX)
            part_scale = fp8_ops.refine_scales(own, values.shape, block, device)
        else:
            step = quantizer_block(spec.shape, block)
            values, own = fp8_ops.quantize(files.read(key), step)
            part_scale = fp8_ops.refine_scales(own, values.shape, step, device)
        if spec.index is None:
            q[...], scale[...] = values, part_scale
        else:
            q[spec.index], scale[spec.index] = values, part_scale
    return q, scale


def quantizes(fp8: Fp8Config, key: str, shape: tuple[int, ...]) -> bool:
    """Whether a writer of the fp8 layout stores tensor `key` in fp8: a matrix weight, not the embeddings, not
    excluded by the layout."""
    return (len(shape) == 2 and key.endswith(".weight") and key != "model.word_embeddings.weight"
            and not fp8.excludes(key[: -len(".weight")]))


def refuse_device_fp8(model: LingModel, what: str) -> None:
    """The writers take dense weights: fp8 on the device has blocks cut for one TP size, not the official layout."""
    if any(isinstance(m, Fp8Weight) for _, m in nnx.iter_modules(model)):
        raise ValueError(f"{what} writes dense weights; this model holds fp8 matrices on the device (load it with "
                         "weights='dense' first; lingjax convert --fp8 writes the fp8 layout)")
