"""A trained state as a checkpoint directory in the official Hugging Face layout (docs/training.md), read by
`lingjax.load(dir)` and by transformers' BailingHybridForCausalLM:

    export(out_dir, params, biases, model_config.config_dict("embedded"), tokenizer=tok)

writes
- config.json: the model config dict as given (model_config's official spelling, `tie_word_embeddings` false);
- generation_config.json: eos [0, 1] (<|endoftext|>, <|role_end|>), pad 0;
- model-0000k-of-0000N.safetensors, each at most max_shard_bytes, and model.safetensors.index.json;
- with a tokenizer, its files (lingjax.train.bpe.save_tokenizer_files).

Tensors follow `lingjax.checkpoint.names.tensor_table`, the name table the loader reads, in its order, with the
official spellings (KDA `attention.o_proj.weight`, MLA `attention.dense.weight`, `mlp.gate.expert_bias`):
per-expert and per-projection tensors are the slices of lingjax's stacked parameters, the MTP layer is
`model.layers.{num_hidden_layers}.*`, and `lm_head.weight` is written explicitly (the embedding, when
training ties them), since HF's model ties nothing. Every tensor is the master rounded to bf16 (round to
nearest even, as forward.cast_params rounds it), except the ones the inference model keeps in f32 by design
(conv taps, A_log, dt_bias, router biases), written in f32: lingjax.load(dir, dtype="float32") then holds
exactly forward.to_model(cast_params(params, bf16), biases) (tests/test_train_model.py).

`python -m lingjax.train` exports through export_and_check, which then loads the directory back with
lingjax.load and prints its greedy completion of command.SMOKE_PROMPT (SMOKE_TOKENS tokens) as a check.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

import lingjax
from lingjax.checkpoint.names import INDEX_FILE, TensorSpec, tensor_table
from lingjax.config import KDA, LingConfig
from lingjax.train import checkpointing, forward
from lingjax.train.bpe import save_tokenizer_files
from lingjax.train.command import SMOKE_PROMPT
from lingjax.train.model_config import EOS_TOKEN_IDS, PAD_TOKEN_ID
from lingjax.train.report import Reporter, mb, since

MAX_SHARD_BYTES = 16_000_000
_HEADER_ALLOWANCE = 262_144  # bytes a shard's safetensors header may take beyond its data
GENERATION_CONFIG = {"eos_token_id": EOS_TOKEN_IDS, "pad_token_id": PAD_TOKEN_ID}
SMOKE_TOKENS = 16


def official_name(spec: TensorSpec, cfg: LingConfig) -> str:
    """The spelling written for a table entry: KDA output projections as `o_proj`, every other alternative
    (MLA `dense`, the router bias `expert_bias`) as the table's first name."""
    path = spec.path
    if len(spec.names) > 1 and path[-1] == "o_proj" and path[0] == "layers" and cfg.layer_types[path[1]] == KDA:
        return next(n for n in spec.names if n.endswith(".o_proj.weight"))
    return spec.names[0]


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def hf_tensors(params: dict, biases, cfg: LingConfig) -> dict[str, np.ndarray]:
    """{official name: host array}, in tensor_table order: bf16, or f32 for forward.f32_leaf_names."""
    tree = forward.join_tree(params, biases, cfg)
    keep = forward.f32_leaf_names(cfg)
    with_mtp = bool(cfg.num_nextn_predict_layers)
    out: dict[str, np.ndarray] = {}
    cache: dict[tuple, np.ndarray] = {}
    for spec in tensor_table(cfg, with_mtp):
        if spec.path not in cache:
            master = np.asarray(jnp.asarray(_get(tree, spec.path), jnp.float32))
            cache[spec.path] = master if spec.path[-1] in keep else master.astype(ml_dtypes.bfloat16)
        array = cache[spec.path]
        array = array[spec.index] if spec.index is not None else array
        out[official_name(spec, cfg)] = np.ascontiguousarray(array.reshape(spec.shape))
    return out


def shard(tensors: dict[str, np.ndarray], max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[str]]:
    """Names grouped into consecutive shards whose data stays under max_shard_bytes less a header allowance."""
    budget = max_shard_bytes - _HEADER_ALLOWANCE
    groups: list[list[str]] = [[]]
    size = 0
    for name, array in tensors.items():
        if array.nbytes > budget:
            raise ValueError(f"tensor {name} ({array.nbytes} B) does not fit a {max_shard_bytes} B shard")
        if groups[-1] and size + array.nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += array.nbytes
    return groups


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def export(out_dir: str | Path, params: dict, biases, config: dict, *, tokenizer=None,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write the checkpoint directory (module docstring) for f32 masters params and biases [M, E] of the
    model config dict `config`; tokenizer: a `tokenizers.Tokenizer` or None. Returns the files written."""
    cfg = LingConfig.from_hf(config)
    if cfg.tie_word_embeddings:
        raise ValueError("the exported config must be untied (tie_word_embeddings false): HF ties no weights")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors"):  # a shard count of an earlier export
        old.unlink()
    tensors = hf_tensors(params, biases, cfg)
    groups = shard(tensors, max_shard_bytes)
    weight_map, files = {}, []
    for k, names in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
        files.append(fname)
        if (out / fname).stat().st_size > max_shard_bytes:
            raise AssertionError(f"{fname} exceeds {max_shard_bytes} B")
    total = sum(a.nbytes for a in tensors.values())
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    files += [INDEX_FILE, "config.json", "generation_config.json"]
    if tokenizer is not None:
        save_tokenizer_files(tokenizer, out, model_max_length=cfg.max_position_embeddings)
        files += ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    return files


def shipped_bytes(cfg: LingConfig) -> int:
    """Bytes of the tensors export writes for cfg (bf16, f32 for the f32-by-design leaves), from shapes."""
    keep = forward.f32_leaf_names(cfg)
    return sum(int(np.prod(s.shape)) * (4 if s.path[-1] in keep else 2)
               for s in tensor_table(cfg, bool(cfg.num_nextn_predict_layers)))


def export_and_check(export_dir: Path, state: dict, config: dict, tok, rep: Reporter) -> str:
    """export the state ({"params", "biases", ...}) of the model config dict `config` with the tokenizer, reload
    it with lingjax.load and print the greedy completion of SMOKE_PROMPT; -> the completion's text."""
    t = time.perf_counter()
    files = export(export_dir, state["params"], state["biases"], config, tokenizer=tok)
    rep.say(f"export: {len(files)} files ({mb(checkpointing.dir_bytes(export_dir))}) to {export_dir} in "
            f"{since(t)}")
    t = time.perf_counter()
    model = lingjax.load(export_dir)
    result = lingjax.generate(model, SMOKE_PROMPT, SMOKE_TOKENS)
    rep.say(f"smoke: lingjax.load({str(export_dir)!r}) greedy {SMOKE_PROMPT!r} -> {result.text!r} "
            f"({len(result.tokens)} tokens, {since(t)})")
    return result.text


def exported(path: Path) -> bool:
    """Whether path holds an export (its safetensors index)."""
    return (path / INDEX_FILE).exists()
