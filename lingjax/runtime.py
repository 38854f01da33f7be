"""`lingjax.load` and the loaded model: parameters on device plus the jitted programs that use them.

The NNX module is split once into (graphdef, params); each jitted program merges them inside the
trace, so calls pay no Python walk of the object graph. Caches are separate pytrees, donated.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax import checkpoint
from lingjax.cache import ModelCache, init_cache
from lingjax.config import PRESETS, LingConfig, preset
from lingjax.kernels import KERNELS, missing_pallas_ops
from lingjax.model import LingModel, param_count
from lingjax.sampling import SamplingParams, sample

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def step_jit(fun, **kwargs):
    """jax.jit for a hot step program. On GPU the whole step goes into XLA command buffers (CUDA
    graphs), loops and conditionals included: measured on the H200 (bench/results/
    spec_overlap_h200_2026-11-29.md) this cut the host's dispatch of a speculative round from 3.2-4.3
    ms to 2.0 ms, below the device's time, so the run-ahead loop hides it. Elsewhere plain jax.jit."""
    if jax.default_backend() == "gpu":
        kwargs["compiler_options"] = {
            "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL",
            "xla_gpu_graph_min_graph_size": 1,
        }
    return jax.jit(fun, **kwargs)


class Model:
    """A loaded Ling model. `module` is the Flax NNX LingModel (for notebooks); the methods here are
    the jitted entry points the engine uses."""

    def __init__(self, module: LingModel, kernels: str = "xla", source: str = ""):
        self.module = module
        self.cfg: LingConfig = module.cfg
        self.kernels = kernels
        self.source = source
        self.graphdef, self.params = nnx.split(module)

        def extend(params, cache, tokens, start, n_valid):
            return nnx.merge(self.graphdef, params).forward(tokens, cache, start, n_valid, kernels)

        def lm_logits(params, hidden):
            return nnx.merge(self.graphdef, params).lm_logits(hidden)

        self._extend, self._lm_logits = extend, lm_logits
        self._full_logits = jax.jit(self._full_logits_impl)
        self._extend_logits = jax.jit(self._extend_logits_impl, donate_argnames=("cache",))
        self._prefill = step_jit(self._prefill_impl, static_argnames=("sampling",), donate_argnames=("cache",))
        self._decode = step_jit(self._decode_impl, static_argnames=("sampling",), donate_argnames=("cache",))
        self._spec_programs = {}

    @property
    def dtype(self):
        return self.module.dtype

    @property
    def has_mtp(self) -> bool:
        return self.module.has_mtp

    def num_params(self) -> int:
        return param_count(self.module)

    def new_cache(self, capacity: int) -> ModelCache:
        return init_cache(self.cfg, capacity, self.dtype)

    def spec_program(self, drafter, sampling: SamplingParams):
        """The jitted speculative prefill/round for this drafter and sampling (built once, then reused)."""
        from lingjax.spec.step import SpecProgram

        key = (drafter, sampling)
        if key not in self._spec_programs:
            self._spec_programs[key] = SpecProgram(self, drafter, sampling)
        return self._spec_programs[key]

    # ---- jitted programs --------------------------------------------------------------------
    def _full_logits_impl(self, params, tokens):
        cache = init_cache(self.cfg, tokens.shape[0], self.dtype)
        hidden, _ = self._extend(params, cache, tokens, 0, tokens.shape[0])
        return self._lm_logits(params, hidden)

    def _extend_logits_impl(self, params, cache, tokens, start):
        hidden, cache = self._extend(params, cache, tokens, start, tokens.shape[0])
        return self._lm_logits(params, hidden), cache

    def _prefill_impl(self, params, cache, tokens, start, n_valid, key, sampling: SamplingParams):
        """One prompt chunk; returns (token sampled from row n_valid-1, its logits, cache)."""
        hidden, cache = self._extend(params, cache, tokens, start, n_valid)
        last = jax.lax.dynamic_index_in_dim(hidden, n_valid - 1, keepdims=False)
        logits = self._lm_logits(params, last)
        return sample(logits, key, sampling), logits, cache

    def _decode_impl(self, params, cache, token, pos, key, sampling: SamplingParams):
        """One token at position pos -> (next token, pos + 1, cache). Everything the next step needs
        comes back as device values; the sampling key is folded with the position on device."""
        hidden, cache = self._extend(params, cache, token[None], pos, 1)
        logits = self._lm_logits(params, hidden[0])
        return sample(logits, jax.random.fold_in(key, pos), sampling), pos + 1, cache

    # ---- public -----------------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """One full forward over token_ids with no cache carried over -> float32 [T, vocab]."""
        tokens = jnp.asarray(np.asarray(token_ids, dtype=np.int32).reshape(-1))
        if tokens.shape[0] == 0:
            raise ValueError("token_ids is empty")
        _check_ids(tokens, self.cfg.vocab_size)
        return np.asarray(self._full_logits(self.params, tokens))


    def incremental_logits(self, token_ids, prompt_len: int) -> np.ndarray:
        """Logits of rows prompt_len-1 .. T-1 computed the decode way: one extend over the prompt,
        then one T=1 step per later token against the caches -> float32 [T - prompt_len + 1, vocab].
        Equal to logits(token_ids)[prompt_len-1:] up to rounding (chunked vs recurrent KDA,
        expanded vs absorbed MLA)."""
        tokens = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if not 1 <= prompt_len <= tokens.size:
            raise ValueError(f"prompt_len must be in [1, {tokens.size}], got {prompt_len}")
        _check_ids(tokens, self.cfg.vocab_size)
        cache = self.new_cache(max(tokens.size, 1))
        logits, cache = self._extend_logits(self.params, cache, jnp.asarray(tokens[:prompt_len]), jnp.int32(0))
        rows = [np.asarray(logits[-1])]
        for pos in range(prompt_len, tokens.size):
            logits, cache = self._extend_logits(self.params, cache, jnp.asarray(tokens[pos : pos + 1]), jnp.int32(pos))
            rows.append(np.asarray(logits[0]))
        return np.stack(rows)


def _check_ids(tokens, vocab: int) -> None:
    bad = np.asarray(tokens)
    bad = bad[(bad < 0) | (bad >= vocab)]
    if bad.size:
        raise ValueError(f"token ids {bad[:5].tolist()} are outside the vocabulary [0, {vocab})")


def load(path_or_preset: str | Path, dtype: str = "bfloat16", kernels: str = "xla", seed: int = 0,
         progress=None) -> Model:
    """Load a model: a preset name (random weights: {presets}), a directory in the official
    safetensors layout, or a lingjax (orbax) checkpoint written by `lingjax convert`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "pallas" and missing_pallas_ops():
        raise NotImplementedError(f"kernels='pallas' needs Pallas kernels not written yet: {missing_pallas_ops()}; "
                                  "use kernels='xla'")
    jdtype = DTYPES[dtype]
    source = str(path_or_preset)
    if source in PRESETS:
        module = LingModel(preset(source), dtype=jdtype, rngs=nnx.Rngs(seed))
        return Model(module, kernels, source=f"preset:{source}")
    directory = Path(source)
    if not directory.is_dir():
        raise FileNotFoundError(f"{source!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory")
    config_path = directory / "config.json"
    if not config_path.exists():
        raise checkpoint.CheckpointError(f"{directory}: no config.json")
    cfg = LingConfig.from_file(config_path)
    if checkpoint.is_orbax(directory):
        module = checkpoint.load_orbax(directory, cfg, jdtype)
    else:
        module = checkpoint.load_safetensors(directory, cfg, jdtype, progress=progress)
    return Model(module, kernels, source=str(directory))


load.__doc__ = load.__doc__.format(presets=", ".join(sorted(PRESETS)))
