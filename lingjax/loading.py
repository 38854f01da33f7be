"""lingjax.load: a model source (the shipped model, a preset, an official checkpoint directory or a `lingjax convert`
output) resolved, checked against the device memory, and read into a Model with its tokenizer and DSpark drafter.
Every argument is checked before a weight is drawn or read."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from lingjax import checkpoint, requests, sharding
from lingjax.config import PRESETS, LingConfig, preset
from lingjax.dtypes import dtype_of
from lingjax.memory import check_fits
from lingjax.model import fp8_layout
from lingjax.quantization import Fp8Layout
from lingjax.random_weights import random_model
from lingjax.runtime import Model, RunOptions
from lingjax.shipped import default_checkpoint, default_draft, is_default_checkpoint
from lingjax.spec import draft_vocab as draft_vocab_lib
from lingjax.spec import dspark, dspark_io
from lingjax.tokenizer import Tokenizer

log = logging.getLogger("lingjax")


def resolve(path_or_preset: str | Path) -> tuple[LingConfig, Path | None]:
    """(config, checkpoint directory) of a preset name (directory None) or a checkpoint directory, read
    without touching a weight: what the CLI checks a request against before loading anything."""
    source = str(path_or_preset)
    if source in PRESETS:
        return preset(source), None
    directory = Path(source)
    if not directory.is_dir():
        raise FileNotFoundError(f"{source!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory")
    if not (directory / "config.json").exists():
        raise checkpoint.CheckpointError(f"{directory}: no config.json")
    return LingConfig.from_file(directory / "config.json"), directory


def source_tokenizer(cfg: LingConfig, directory: Path | None, name: str) -> Tokenizer | None:
    """The tokenizer a model source carries: a checkpoint's own files (None, said once, when it has no
    tokenizer.json), or the byte-level tokenizer of a preset."""
    if directory is None:
        return Tokenizer.byte_level(cfg, source=f"byte-level, preset {name}")
    tokenizer = Tokenizer.from_dir(directory, cfg)
    if tokenizer is None:
        log.warning("lingjax: %s has no tokenizer.json: token ids in and out only", directory)
    return tokenizer


def weights_layout(cfg: LingConfig, directory: Path | None, weights: str, tp: int) -> Fp8Layout | None:
    """The fp8 layout load(weights=...) makes for a source, as lingjax would quantize it (an fp8 checkpoint's own
    list of quantized tensors is read as it loads; this estimate serves the memory check): None for dense."""
    if weights not in checkpoint.WEIGHTS:
        raise ValueError(f"weights must be one of {checkpoint.WEIGHTS}, got {weights!r}")
    if weights == "fp8" and directory is not None and checkpoint.is_orbax(directory):
        raise ValueError(f"{directory} is a lingjax (orbax) checkpoint, which loads dense; give its official "
                         "safetensors form (or its `lingjax convert --fp8` copy) for fp8 weights")
    stored_fp8 = directory is not None and checkpoint.read_fp8_config(directory) is not None
    return fp8_layout(cfg, tp) if weights == "fp8" or (weights == "auto" and stored_fp8) else None


_OWN = object()  # load(tokenizer=...) default: the source's own tokenizer


def load_draft(draft, cfg: LingConfig, dtype: str, shipped: bool):
    """load's `draft` argument -> a lingjax.spec.dspark.DSpark or None (see load)."""
    if draft is None or isinstance(draft, dspark.DSpark):
        return draft
    if draft == "auto":
        directory = default_draft() if shipped else None
        return dspark_io.load_dspark(directory, dtype, cfg) if directory is not None else None
    if draft == "random":
        return dspark.random_dspark(dspark.default_config(cfg), dtype)
    return dspark_io.load_dspark(draft, dtype, cfg)


def draft_vocab_ids(draft_vocab, table, cfg: LingConfig, directory: Path | None, tp: int = 1):
    """load's draft_vocab and draft_vocab_table -> the subset's token ids (int32, ascending) or None (the whole
    vocabulary), checked without a weight. The table: a .npy path or an array of cfg.vocab_size counts; None takes
    the checkpoint directory's own token_frequencies.npy (the shipped model has one: docs/speculation.md)."""
    if draft_vocab is None and table is not None:
        raise ValueError("draft_vocab_table given without a draft_vocab")
    n = draft_vocab_lib.resolve_size(draft_vocab, cfg.vocab_size, tp)
    if n is None:
        return None
    if table is None:
        own = None if directory is None else directory / draft_vocab_lib.TABLE_NAME
        if own is None or not own.is_file():
            raise ValueError(f"draft_vocab {draft_vocab!r} needs a token frequency table: draft_vocab_table=FILE "
                             f"(this model has no {draft_vocab_lib.TABLE_NAME} beside it)")
        table = own
    if isinstance(table, (str, Path)):
        counts = draft_vocab_lib.read_table(table, cfg.vocab_size)
    else:
        counts = draft_vocab_lib.check_counts(table, cfg.vocab_size)
    return draft_vocab_lib.top_ids(counts, n)


def with_draft_vocab(model: Model, ids) -> Model:
    """model drafting over the tokens `ids` (None: unchanged), the gathered copy's size said in the log."""
    if ids is None:
        return model
    vocab = draft_vocab_lib.build(model.module.lm_head[...], ids, model.mesh)
    log.info("lingjax: draft vocabulary %d of %d tokens (%.1f%%): a gathered copy of lm_head rows, %.1f MB%s",
             vocab.size, model.cfg.vocab_size, 100 * vocab.size / model.cfg.vocab_size, vocab.nbytes / 1e6,
             f" ({vocab.nbytes / model.tp / 1e6:.1f} MB a device)" if model.tp > 1 else "")
    return model.with_draft_vocab(vocab)


def load(path_or_preset: str | Path | None = None, dtype: str = "bfloat16", kernels: str = "auto", seed: int = 0,
         progress=None, tp: int = 1, router_precision: str = "f32", tokenizer=_OWN, weights: str = "auto",
         draft="auto", draft_vocab=None, draft_vocab_table=None) -> Model:
    """Load a model: the shipped code model (no argument: lingjax.shipped), a preset name (random weights:
    {presets}), a directory in the official
    safetensors layout, or a lingjax (orbax) checkpoint written by `lingjax convert`. tp > 1 shards
    it over that many devices (safetensors stream each tensor straight into its shards).
    kernels: "auto" (Pallas on a GPU, the XLA references elsewhere), "pallas" or "xla".
    router_precision="bf16" runs the MoE gate GEMV on bf16 operands (faster; a declared rounding
    change, so parity tests keep the default "f32"). tokenizer: a lingjax.Tokenizer (or None) in place of
    the source's own. weights: "auto" keeps what a checkpoint stores in fp8 in fp8 on the device (docs/fp8.md),
    "fp8" quantizes every other matrix too (a preset's random weights, a bf16 checkpoint as it loads), "dense"
    holds everything in `dtype`. draft: the DSpark drafter for spec="dspark" (Model.draft): "auto" (the shipped
    model's own drafter with the shipped model, loaded by default or by its path; none otherwise), a draft
    checkpoint directory, "random" (a random drafter shaped for the model, lingjax.spec.dspark.default_config: for
    timing rounds), or None. draft_vocab: the drafters (NEXTN's drafts and draft-extend, DSpark's block) draft
    over the N or P% most frequent tokens (N | "P%"; None or "full": all), from draft_vocab_table (a .npy file
    of vocab_size counts, or such an array; default: token_frequencies.npy beside the checkpoint, which the
    shipped model has); the verify keeps the full lm_head, so output is unchanged (docs/speculation.md). It is
    a load option, not a request's, because its gathered lm_head rows are made once here (Vd·D·dtype bytes,
    split like the lm_head under TP). Every argument is checked, and the model's size against the free
    device memory, before any weight is drawn or read."""
    jdtype = dtype_of(dtype)
    options = RunOptions(kernels=kernels, router_precision=router_precision)
    seed = requests.check_seed(seed)
    if path_or_preset is None:
        path_or_preset = default_checkpoint()
    shipped = is_default_checkpoint(path_or_preset)
    source = str(path_or_preset)
    cfg, directory = resolve(source)
    mesh = sharding.mesh_for(cfg, tp)  # every parameter goes straight into its shards
    fp8 = weights_layout(cfg, directory, weights, tp)
    vocab_ids = draft_vocab_ids(draft_vocab, draft_vocab_table, cfg, directory, tp)
    copy_bytes = 0 if vocab_ids is None else vocab_ids.size * cfg.hidden_size * np.dtype(jdtype).itemsize
    check_fits(cfg, jdtype, tp, source, fp8=fp8, extra_bytes=copy_bytes)
    if tokenizer is _OWN:
        tokenizer = source_tokenizer(cfg, directory, source)  # read before the weights: a bad file fails fast
    drafter = load_draft(draft, cfg, dtype, shipped)  # small: read before the target, so a bad one fails fast
    if directory is None:
        return with_draft_vocab(Model(random_model(cfg, jdtype, seed, mesh, fp8=fp8), options, mesh=mesh,
                                      source=f"preset:{source}", tokenizer=tokenizer).with_draft(drafter), vocab_ids)
    sharding_for = place = None
    if mesh is not None:

        def sharding_for(path):
            return NamedSharding(mesh, sharding.param_spec(path))

        def place(path, array):
            return jax.device_put(array, sharding_for(path))

    if checkpoint.is_orbax(directory):
        module = checkpoint.load_orbax(directory, cfg, jdtype, sharding_for=sharding_for)
    else:
        module = checkpoint.load_safetensors(directory, cfg, jdtype, place=place, progress=progress, weights=weights,
                                             tp=tp)
    model = Model(module, options, mesh=mesh, source=str(directory), tokenizer=tokenizer).with_draft(drafter)
    return with_draft_vocab(model, vocab_ids)


load.__doc__ = load.__doc__.format(presets=", ".join(sorted(PRESETS)))
