"""Checkpoint I/O: official safetensors layout (streamed tensor by tensor) and lingjax's orbax format.

`tensor_table` is the one name table from checkpoint keys to parameter paths. Loading first reads
every file's header and checks the whole table (missing, unexpected, duplicated, both spellings of
one tensor, shape, dtype) before a single tensor's data is read, so a bad checkpoint fails fast with
one CheckpointError naming the tensor and the file. Data then streams one parameter at a time:
per-expert tensors (and a KDA layer's input projections and conv taps) are stacked into their [N, ...]
parameter as they arrive, so host memory holds at most one parameter (the real checkpoint is ~250 GB).

The official fp8 layout (docs/fp8.md) is checked tensor by tensor (scales present, shaped by the block size, F32;
no listed-unquantized module stored in fp8) and stays fp8 on the device (lingjax.model.Fp8Weight, scales cut into
device blocks for the TP size), or loads dequantized with weights="dense"; `convert_fp8` writes it from a bf16
checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from lingjax.config import KDA, MOE, LingConfig
from lingjax.model import LingModel, abstract_model
from lingjax.ops import fp8 as fp8_ops
from lingjax.quantization import Fp8Config

INDEX_FILE = "model.safetensors.index.json"
ORBAX_DIR = "params"
META_FILE = "lingjax.json"
ACCEPTED_DTYPES = {"F32": np.float32, "BF16": jnp.bfloat16}
FP8_DTYPE = "F8_E4M3"  # a quantized weight (with a float32 X.weight_scale_inv beside it; docs/fp8.md)
SCALE_SUFFIX = "_scale_inv"
PARAM_LAYOUT = 2  # orbax parameter tree version; 2: KDA q/k/v/f/g stacked into in_proj, q/k/v conv into conv


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


# ---- reading safetensors headers -------------------------------------------------------------
class _Files:
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


def _resolve(cfg: LingConfig, files: _Files, fp8: Fp8Config | None = None
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
            used.add(_check_fp8(key, spec, files, fp8))
        elif dtype not in ACCEPTED_DTYPES:
            raise CheckpointError(f"tensor {key} in {where} has dtype {dtype}; expected one of {sorted(ACCEPTED_DTYPES)}"
                                  + (f" or {FP8_DTYPE} (the fp8 layout)" if fp8 else ""))
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


def _check_fp8(key: str, spec: TensorSpec, files: _Files, fp8: Fp8Config | None) -> str:
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


def _read_weight(files: _Files, key: str, fp8: Fp8Config | None) -> np.ndarray:
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


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


Placer = Callable[[tuple, np.ndarray], jax.Array]


WEIGHTS = ("auto", "fp8", "dense")  # load(weights=...): as stored, every quantizable matrix in fp8, all in dtype


def load_safetensors(directory: str | Path, cfg: LingConfig, dtype=jnp.bfloat16,
                     place: Placer | None = None, progress: Callable[[int, int], None] | None = None,
                     weights: str = "auto", tp: int = 1) -> LingModel:
    """Load an official-layout checkpoint into a LingModel. `place(path, array)` puts one parameter on
    its device(s) (default: jax.device_put); `progress(done, total)` reports parameters loaded.
    weights: "auto" keeps the checkpoint's fp8 matrices in fp8 on the device (lingjax.model.Fp8Weight, scales cut
    for `tp`), "fp8" also quantizes its other matrices as they load (lingjax.quantization.QUANTIZED_NAMES), "dense"
    loads everything in `dtype` (fp8 dequantized)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    files = _Files(Path(directory))
    fp8 = read_fp8_config(Path(directory))
    resolved, with_mtp = _resolve(cfg, files, fp8)
    groups: dict[tuple, list[tuple[TensorSpec, str]]] = {}
    for spec, key in resolved:
        groups.setdefault(spec.path, []).append((spec, key))
    if cfg.tie_word_embeddings:
        groups[("lm_head",)] = groups[("embed",)]
    layout = _device_layout(files, groups, fp8, weights, tp)
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, with_mtp=with_mtp, fp8=layout))
    targets = nnx.to_pure_dict(abstract)
    place = place or (lambda path, array: jax.device_put(array))

    params: dict = {}
    for done, (path, parts) in enumerate(groups.items(), 1):
        if layout is not None and path in layout.paths:
            q, scale = _read_fp8_param(files, parts, fp8, _get(targets, path))
            _set(params, path + ("q",), place(path + ("q",), q))
            _set(params, path + ("scale",), place(path + ("scale",), scale))
            del q, scale
        else:
            target = _get(targets, path)
            host = np.empty(target.shape, target.dtype)
            for spec, key in parts:
                array = _read_weight(files, key, fp8).reshape(target.shape[1:] if spec.index is not None
                                                              else target.shape)
                if spec.index is None:
                    host[...] = array
                else:
                    host[spec.index] = array
            _set(params, path, place(path, host))
            del host
        if progress:
            progress(done, len(groups))

    def name(path, index):
        key = path[:-1] if path not in groups else path  # an fp8 weight's q or scale
        parts = groups[key]
        tensor = next((k for spec, k in parts if spec.index == index), parts[0][1])
        return tensor + ("" if key == path else f" ({path[-1]})")

    stacked = frozenset(path for path, parts in groups.items() if parts[0][0].index is not None)
    _refuse_nonfinite(str(directory), params, name, stacked)
    return _merge(graphdef, abstract, params)


def _device_layout(files: _Files, groups: dict, fp8: Fp8Config | None, weights: str, tp: int):
    """The Fp8Layout a load keeps on the device (None: no fp8 weights): the parameters the checkpoint stores in
    fp8 (all parts of a stacked one alike), and with weights="fp8" every other quantizable matrix too."""
    from lingjax.quantization import Fp8Layout, quantized_paths

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
    paths = stored | (set(quantized_paths(groups)) if weights == "fp8" else set())
    if not paths:
        return None
    return Fp8Layout(frozenset(paths), block=fp8.block if fp8 else fp8_ops.BLOCK, tp=tp,
                     scale_fmt=fp8.scale_fmt if fp8 else "float32")


def _read_fp8_param(files: _Files, parts, fp8: Fp8Config | None, target) -> tuple[np.ndarray, np.ndarray]:
    """One fp8 parameter on the host: (q float8_e4m3fn, scales in the target's device blocks), its parts stacked
    (experts, KDA in_proj). A stored fp8 tensor keeps its values, its scales refined to the device blocks; a
    plain one is quantized (lingjax.model.quantizer_block blocks)."""
    from lingjax.model import quantizer_block

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


def read_fp8_config(directory: Path) -> Fp8Config | None:
    """The fp8 layout directory/config.json declares (None: none, or no config.json)."""
    path = directory / "config.json"
    if not path.exists():
        return None
    try:
        return Fp8Config.from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def nonfinite(params: dict, stacked=frozenset()) -> list[tuple[tuple, int | None]]:
    """(parameter path, index or None) of each parameter in the pure dict `params` that holds a NaN or an infinity,
    checked on the device in one program; a path in `stacked` is checked per entry of its leading axis (experts
    stacked from separate tensors), so the tensor can be named."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    paths = [tuple(k.key for k in path) for path, _ in leaves]
    per_entry = [path[:-1] in stacked or path in stacked for path in paths]

    def flags(arrays):
        return [jnp.all(jnp.isfinite(a), axis=tuple(range(1, a.ndim))) if entry else jnp.all(jnp.isfinite(a))
                for a, entry in zip(arrays, per_entry)]

    found = jax.jit(flags)([a for _, a in leaves])
    bad = []
    for path, entry, ok in zip(paths, per_entry, found):
        ok = np.asarray(ok)
        bad += [(path, int(i)) for i in np.flatnonzero(~ok)] if entry else [] if ok else [(path, None)]
    return bad


def _refuse_nonfinite(where: str, params: dict, names: Callable[[tuple, int | None], str],
                      stacked=frozenset()) -> None:
    """A CheckpointError naming the first tensors that hold NaN or infinite values."""
    bad = nonfinite(params, stacked)
    if bad:
        listed = ", ".join(names(path, index) for path, index in bad[:3]) + (" ..." if len(bad) > 3 else "")
        raise CheckpointError(f"{where}: NaN or infinite values in {listed}")


def _merge(graphdef, abstract, params: dict) -> LingModel:
    nnx.replace_by_pure_dict(abstract, params)
    return nnx.merge(graphdef, abstract)


# ---- orbax: lingjax's own fast format ----------------------------------------------------------
def save_orbax(model: LingModel, out_dir: str | Path, config_json: dict) -> None:
    """Write config.json, lingjax.json and the parameters (orbax) under out_dir."""
    import orbax.checkpoint as ocp

    _refuse_device_fp8(model, "save_orbax")
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    (out / META_FILE).write_text(json.dumps({"has_mtp": model.has_mtp, "dtype": str(model.dtype),
                                             "layout": PARAM_LAYOUT}))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / ORBAX_DIR, params, force=True)


def _refuse_device_fp8(model: LingModel, what: str) -> None:
    """The writers take dense weights: fp8 on the device has blocks cut for one TP size, not the official layout."""
    from lingjax.model import Fp8Weight

    if any(isinstance(m, Fp8Weight) for _, m in nnx.iter_modules(model)):
        raise ValueError(f"{what} writes dense weights; this model holds fp8 matrices on the device (load it with "
                         "weights='dense' first; lingjax convert --fp8 writes the fp8 layout)")


def is_orbax(directory: str | Path) -> bool:
    return (Path(directory) / META_FILE).exists() and (Path(directory) / ORBAX_DIR).is_dir()


def load_orbax(directory: str | Path, cfg: LingConfig, dtype=jnp.bfloat16,
               sharding_for: Callable[[tuple], jax.sharding.Sharding] | None = None) -> LingModel:
    """Restore a checkpoint written by save_orbax, cast to `dtype` (f32-by-design parameters stay f32).
    `sharding_for(path)` restores each parameter straight into that sharding (each device reads its
    own shard); without it everything lands on the default device."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    meta = json.loads((directory / META_FILE).read_text())
    if meta.get("layout", 1) != PARAM_LAYOUT:
        raise CheckpointError(f"{directory}: written by a lingjax with parameter layout {meta.get('layout', 1)}, "
                              f"this one reads layout {PARAM_LAYOUT}; convert the official checkpoint again "
                              f"(lingjax convert)")
    _, saved = nnx.split(abstract_model(cfg, jnp.dtype(meta["dtype"]), with_mtp=meta["has_mtp"]))
    target = nnx.to_pure_dict(saved)
    if sharding_for is not None:
        target = jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                    sharding=sharding_for(tuple(k.key for k in path))), target)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            params = ckptr.restore(directory / ORBAX_DIR, target)
        except Exception as e:
            raise CheckpointError(f"{directory / ORBAX_DIR}: cannot restore ({e})") from None
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, with_mtp=meta["has_mtp"]))
    params = jax.tree.map(lambda a, t: a.astype(t.dtype), params, nnx.to_pure_dict(abstract))
    _refuse_nonfinite(str(directory), params, lambda path, index: "parameter " + ".".join(map(str, path)))
    return _merge(graphdef, abstract, params)


def convert_fp8(hf_dir: str | Path, out_dir: str | Path, scale_fmt: str = "float32",
                progress: Callable[[int, int], None] | None = None) -> Fp8Config:
    """An official bf16 (or f32) checkpoint -> the same checkpoint in the official fp8 layout (128 x 128 blocks;
    FP8_NOT_CONVERTED, vectors, embeddings and conv taps left as they are), file by file (host memory holds one
    file's tensors), with its tokenizer files. The source is checked whole first. Returns the layout written."""
    from safetensors.numpy import save_file

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    if raw.get("quantization_config") is not None:
        raise CheckpointError(f"{hf_dir}: already quantized (config.json has a quantization_config)")
    files = _Files(hf_dir)
    _resolve(LingConfig.from_hf(raw), files)
    fp8 = Fp8Config(scale_fmt=scale_fmt, not_converted=FP8_NOT_CONVERTED)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for done, (name, handle) in enumerate(files.handles.items(), 1):
        tensors = {}
        for key in handle.keys():
            array = files.read(key)
            if _quantizes(fp8, key, array.shape):
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
    from lingjax.tokenizer import TOKENIZER_FILES

    for extra in TOKENIZER_FILES:  # the tokenizer, its special tokens and chat template, the stop ids
        if (hf_dir / extra).exists():
            shutil.copy(hf_dir / extra, out_dir / extra)


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


# what `lingjax convert --fp8` leaves unquantized: the router (its choices are discrete) and lm_head (the
# logits); embeddings, norms and the KDA conv taps are no matrices it quantizes
FP8_NOT_CONVERTED = ("lm_head", "mlp.gate")


def _quantizes(fp8: Fp8Config, key: str, shape: tuple[int, ...]) -> bool:
    return (len(shape) == 2 and key.endswith(".weight") and key != "model.word_embeddings.weight"
            and not fp8.excludes(key[: -len(".weight")]))


def save_safetensors(model: LingModel, out_dir: str | Path, max_tensors_per_file: int = 0,
                     fp8: Fp8Config | None = None) -> None:
    """Write a model in the official layout (config.json + safetensors, sharded with an index when
    max_tensors_per_file > 0): the inverse of load_safetensors, used to make test checkpoints. With `fp8`, in
    the fp8 layout: every matrix weight not listed in fp8.not_converted as float8_e4m3fn with its scales, and
    config.json's quantization_config."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.cfg.to_hf() | ({"quantization_config": fp8.to_hf()} if fp8 else {})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _refuse_device_fp8(model, "save_safetensors")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors = {}
    for spec in tensor_table(model.cfg, model.has_mtp):
        array = np.asarray(_get(params, spec.path))
        array = np.ascontiguousarray((array[spec.index] if spec.index is not None else array).reshape(spec.shape))
        name = spec.names[0]
        if fp8 and _quantizes(fp8, name, spec.shape):
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
