"""Loading an official-layout safetensors checkpoint into a LingModel: every header checked, then data streamed.

`load_safetensors` first reads every file's header and checks the whole name table (missing, unexpected,
duplicated, both spellings of one tensor, shape, dtype; the fp8 checks of lingjax.checkpoint.fp8) before a single
tensor's data is read, so a bad checkpoint fails fast with one CheckpointError naming the tensor and the file. Data
then streams one parameter at a time: per-expert tensors (and a KDA layer's input projections and conv taps) are
stacked into their [N, ...] parameter as they arrive, so host memory holds at most one parameter (the real
checkpoint is ~250 GB). fp8 weights stay fp8 on the device, or load dequantized with weights="dense".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from lingjax.checkpoint.fp8 import FP8_DTYPE, SCALE_SUFFIX, check_fp8, device_layout, read_fp8_config, read_fp8_param
from lingjax.checkpoint.names import INDEX_FILE, CheckpointError, TensorSpec, tensor_table
from lingjax.checkpoint.params import get_at, merge, refuse_nonfinite, set_at
from lingjax.config import LingConfig
from lingjax.model import LingModel, abstract_model
from lingjax.ops import fp8 as fp8_ops
from lingjax.quantization import Fp8Config

ACCEPTED_DTYPES = {"F32": np.float32, "BF16": jnp.bfloat16}
WEIGHTS = ("auto", "fp8", "dense")  # load(weights=...): as stored, every quantizable matrix in fp8, all in dtype

Placer = Callable[[tuple, np.ndarray], jax.Array]


class Files:
    """Which file holds which tensor, from the index (or every *.safetensors file without one)."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            weight_map = None
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files")
        self.handles = {}
        self._raw_headers: dict[str, tuple[int, dict]] = {}  # file -> (data offset, header), for _read_raw
        self.where: dict[str, str] = {}
        for name in files:
            path = directory / name
            if not path.exists():
                raise CheckpointError(f"{path}: listed in {INDEX_FILE} but missing")
            try:
                handle = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error type for damaged headers/lengths
                raise CheckpointError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None
            self.handles[name] = handle
            for key in handle.keys():
                if key in self.where:
                    raise CheckpointError(f"tensor {key} appears in both {self.where[key]} and {name}")
                self.where[key] = name
        if weight_map is not None:
            for key, name in weight_map.items():
                if self.where.get(key) != name:
                    raise CheckpointError(f"tensor {key}: {INDEX_FILE} says {name} but that file does not hold it")

    def header(self, key: str) -> tuple[tuple[int, ...], str]:
        sl = self.handles[self.where[key]].get_slice(key)
        return tuple(sl.get_shape()), sl.get_dtype()

    def read(self, key: str) -> np.ndarray:
        name = self.where[key]
        try:
            if self.header(key)[1] == FP8_DTYPE:
                return self._read_raw(name, key, fp8_ops.FP8)
            return self.handles[name].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"tensor {key} in {self.directory / name}: cannot read data ({e})") from None

    def _read_raw(self, name: str, key: str, dtype) -> np.ndarray:
        """One tensor's bytes as `dtype`, from the safetensors header's offsets (safetensors' numpy reader has
        no float8 dtype). Each file's header is parsed once."""
        if name not in self._raw_headers:
            with open(self.directory / name, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._raw_headers[name] = (8 + size, json.loads(f.read(size)))
        data_start, header = self._raw_headers[name]
        start, end = header[key]["data_offsets"]
        with open(self.directory / name, "rb") as f:
            f.seek(data_start + start)
            data = f.read(end - start)
        return np.frombuffer(data, np.dtype(dtype)).reshape(header[key]["shape"])


def resolve(cfg: LingConfig, files: Files, fp8: Fp8Config | None = None
            ) -> tuple[list[tuple[TensorSpec, str]], bool]:
    """Match the table against the files' headers; returns [(spec, key present)] and MTP presence. With an fp8
    layout, a float8_e4m3fn weight must be a matrix, not listed as unquantized, and have its scales."""
    mtp_prefix = f"model.layers.{cfg.mtp_layer_id}."
    with_mtp = any(k.startswith(mtp_prefix) for k in files.where)
    resolved, used = [], set()
    for spec in tensor_table(cfg, with_mtp):
        present = [n for n in spec.names if n in files.where]
        if not present:
            raise CheckpointError(f"missing tensor {' or '.join(spec.names)} in {files.directory}")
        if len(present) > 1:
            raise CheckpointError(
                f"both {present[0]} ({files.where[present[0]]}) and {present[1]} ({files.where[present[1]]}) "
                "are present; a checkpoint must hold exactly one of them"
            )
        key = present[0]
        shape, dtype = files.header(key)
        where = files.directory / files.where[key]
        if dtype == FP8_DTYPE:
            used.add(check_fp8(key, spec, files, fp8))
        elif dtype not in ACCEPTED_DTYPES:
            raise CheckpointError(f"tensor {key} in {where} has dtype {dtype}; expected one of "
                                  f"{sorted(ACCEPTED_DTYPES)}" + (f" or {FP8_DTYPE} (the fp8 layout)" if fp8 else ""))
        if int(np.prod(shape)) != int(np.prod(spec.shape)) or shape not in _accepted_shapes(spec.shape):
            raise CheckpointError(f"tensor {key} in {where} has shape {list(shape)} but config.json implies "
                                  f"{list(spec.shape)}")
        resolved.append((spec, key))
        used.add(key)
    unexpected = sorted(set(files.where) - used)
    if unexpected:
        shown = ", ".join(f"{k} ({files.where[k]})" for k in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(f"unexpected tensors in {files.directory}: {shown}{more}")
    return resolved, with_mtp


def _read_weight(files: Files, key: str, fp8: Fp8Config | None) -> np.ndarray:
    """A tensor's values; an fp8 one dequantized with its scales (q · scale_inv, in f32)."""
    array = files.read(key)
    if files.header(key)[1] != FP8_DTYPE:
        return array
    scale = files.read(key + SCALE_SUFFIX)
    return np.asarray(fp8_ops.dequantize(array, scale, jnp.float32, fp8.block))


def _accepted_shapes(shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    """Some exports store A_log as [1, 1, H, 1]; conv weights arrive as [C, 1, W] (or [C, W])."""
    out = {shape}
    if len(shape) == 1:
        out.add((1, 1, shape[0], 1))
    if len(shape) == 3 and shape[1] == 1:
        out.add((shape[0], shape[2]))
    return out


def load_safetensors(directory: str | Path, cfg: LingConfig, dtype=jnp.bfloat16,
                     place: Placer | None = None, progress: Callable[[int, int], None] | None = None,
                     weights: str = "auto", tp: int = 1) -> LingModel:
    """Load an official-layout checkpoint into a LingModel. `place(path, array)` puts one parameter on
    its device(s) (default: jax.device_put); `progress(done, total)` reports parameters loaded.
    weights: "auto" keeps the checkpoint's fp8 matrices in fp8 on the device (lingjax.model.Fp8Weight, scales cut
    for `tp`), "fp8" also quantizes its other matrices as they load (lingjax.quantization.QUANTIZED_NAMES), "dense"
    loads everything in `dtype` (fp8 dequantized). The few matrices the model reads dense (DENSE_ON_DEVICE) load
    dequantized under every option."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    files = Files(Path(directory))
    fp8 = read_fp8_config(Path(directory))
    resolved, with_mtp = resolve(cfg, files, fp8)
    groups: dict[tuple, list[tuple[TensorSpec, str]]] = {}
    for spec, key in resolved:
        groups.setdefault(spec.path, []).append((spec, key))
    if cfg.tie_word_embeddings:
        groups[("lm_head",)] = groups[("embed",)]
    layout = device_layout(files, groups, fp8, weights, tp)
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, with_mtp=with_mtp, fp8=layout))
    targets = nnx.to_pure_dict(abstract)
    place = place or (lambda path, array: jax.device_put(array))

    params: dict = {}
    for done, (path, parts) in enumerate(groups.items(), 1):
        if layout is not None and path in layout.paths:
            q, scale = read_fp8_param(files, parts, fp8, get_at(targets, path))
            set_at(params, path + ("q",), place(path + ("q",), q))
            set_at(params, path + ("scale",), place(path + ("scale",), scale))
            del q, scale
        else:
            target = get_at(targets, path)
            host = np.empty(target.shape, target.dtype)
            for spec, key in parts:
                array = _read_weight(files, key, fp8).reshape(target.shape[1:] if spec.index is not None
                                                              else target.shape)
                if spec.index is None:
                    host[...] = array
                else:
                    host[spec.index] = array
            set_at(params, path, place(path, host))
            del host
        if progress:
            progress(done, len(groups))

    def name(path, index):
        key = path[:-1] if path not in groups else path  # an fp8 weight's q or scale
        parts = groups[key]
        tensor = next((k for spec, k in parts if spec.index == index), parts[0][1])
        return tensor + ("" if key == path else f" ({path[-1]})")

    stacked = frozenset(path for path, parts in groups.items() if parts[0][0].index is not None)
    refuse_nonfinite(str(directory), params, name, stacked)
    return merge(graphdef, abstract, params)
