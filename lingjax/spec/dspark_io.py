"""A DSpark draft checkpoint on disk: config.json (lingjax.spec.dspark_model.DSparkConfig, HF-spelled) and
model.safetensors under the one name table (tensor_names). Reading checks every tensor's name, shape and dtype
before any is read, so a bad file fails naming the tensor."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from lingjax.checkpoint import CheckpointError
from lingjax.dtypes import dtype_of
from lingjax.sharding import path_keys
from lingjax.spec.dspark import DSpark
from lingjax.spec.dspark_model import DSparkConfig, DSparkConfigError, abstract_draft

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def tensor_names(cfg: DSparkConfig) -> dict[str, tuple[tuple, tuple[int, ...]]]:
    """checkpoint name -> (parameter path, shape): the one name table of a DSpark draft checkpoint."""
    d, g, h, hd, i = cfg.hidden_size, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    table = {
        "fc.weight": (("fc",), (d, cfg.feature_size)),
        "hidden_norm.weight": (("hidden_norm",), (d,)),
        "norm.weight": (("norm",), (d,)),
        "markov_head.markov_w1.weight": (("markov_w1",), (cfg.vocab_size, cfg.markov_rank)),
        "markov_head.markov_w2.weight": (("markov_w2",), (cfg.vocab_size, cfg.markov_rank)),
        "confidence_head.proj.weight": (("confidence_w",), (1, d + cfg.markov_rank)),
        "confidence_head.proj.bias": (("confidence_b",), (1,)),
    }
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        table.update({
            p + "input_layernorm.weight": (("layers", n, "input_norm"), (d,)),
            p + "self_attn.q_proj.weight": (("layers", n, "q_proj"), (h * hd, d)),
            p + "self_attn.k_proj.weight": (("layers", n, "k_proj"), (g * hd, d)),
            p + "self_attn.v_proj.weight": (("layers", n, "v_proj"), (g * hd, d)),
            p + "self_attn.o_proj.weight": (("layers", n, "o_proj"), (d, h * hd)),
            p + "self_attn.q_norm.weight": (("layers", n, "q_norm"), (hd,)),
            p + "self_attn.k_norm.weight": (("layers", n, "k_norm"), (hd,)),
            p + "post_attention_layernorm.weight": (("layers", n, "post_norm"), (d,)),
            p + "mlp.gate_proj.weight": (("layers", n, "gate_proj"), (i, d)),
            p + "mlp.up_proj.weight": (("layers", n, "up_proj"), (i, d)),
            p + "mlp.down_proj.weight": (("layers", n, "down_proj"), (d, i)),
        })
    return table


def save_dspark(draft: DSpark, out_dir: str | Path) -> Path:
    """Write config.json and model.safetensors (the name table's names; dtype as held)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_path = {path: name for name, (path, _) in tensor_names(draft.cfg).items()}
    tensors = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(draft.params)):
        tensors[by_path[path_keys(path)]] = np.asarray(jax.device_get(leaf))
    (out / CONFIG_FILE).write_text(json.dumps({**draft.cfg.to_hf(), "torch_dtype": draft.dtype}, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE))
    return out


def read_dspark_config(directory: str | Path) -> DSparkConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise DSparkConfigError(f"{directory}: no {CONFIG_FILE} (not a DSpark draft checkpoint)")
    try:
        return DSparkConfig.from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise DSparkConfigError(f"{path}: not JSON ({e})") from None


def load_dspark(directory: str | Path, dtype: str = "bfloat16", target_cfg=None) -> DSpark:
    """A DSpark draft checkpoint -> DSpark. Every tensor is checked against the name table (missing, unexpected,
    mis-shaped, a dtype other than F32/BF16) before any is read; a problem raises lingjax.checkpoint.CheckpointError
    naming the tensor and the file. target_cfg: the target's config, checked against the draft's."""
    directory = Path(directory)
    cfg = read_dspark_config(directory)
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no .safetensors file")
    table = tensor_names(cfg)
    with contextlib.ExitStack() as stack:  # each file opened once: headers checked first, then the data read
        handles = {f: stack.enter_context(safe_open(str(f), framework="flax")) for f in files}
        where: dict[str, Path] = {}
        stored: dict[str, str] = {}  # name without a leading "model." -> the name in its file
        for f, handle in handles.items():
            for key in handle.keys():
                name = key.removeprefix("model.")
                if name in where:
                    raise CheckpointError(f"{name}: in both {where[name].name} and {f.name}")
                where[name], stored[name] = f, key
        # the shared embeddings and head may be stored with the draft: the target's are used
        extra = sorted(set(where) - set(table) - {"embed_tokens.weight", "lm_head.weight"})
        if extra:
            raise CheckpointError(f"{extra[0]} ({where[extra[0]].name}): not a tensor of this DSpark config")
        missing = sorted(set(table) - set(where))
        if missing:
            raise CheckpointError(f"{missing[0]}: missing from {directory}")
        for name, (_, shape) in table.items():
            sl = handles[where[name]].get_slice(stored[name])
            if tuple(sl.get_shape()) != shape or sl.get_dtype() not in ("F32", "BF16"):
                raise CheckpointError(f"{name} ({where[name].name}): {sl.get_dtype()} {sl.get_shape()}, expected "
                                      f"F32 or BF16 {list(shape)}")
        graphdef, state = nnx.split(abstract_draft(cfg, dtype_of(dtype)))
        name_of = {path: name for name, (path, _) in table.items()}
        pure = nnx.to_pure_dict(state)
        leaves = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(pure):
            name = name_of[path_keys(path)]
            leaves.append(jnp.asarray(handles[where[name]].get_tensor(stored[name]), leaf.dtype))
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(jax.tree.structure(pure), leaves))
    return DSpark(nnx.merge(graphdef, state), source=str(directory))
