"""lingjax: a batch-1 inference engine for Ling-3.0-flash (HF `bailing_hybrid`) in JAX/Flax/Pallas.

    model = lingjax.load("tiny" | "/path/to/checkpoint", dtype="bfloat16", kernels="auto")
    model.logits(token_ids)                   # float32 [T, vocab], one full forward
    lingjax.generate(model, "text" | ids, 32)  # .text, .tokens, .ttft_s, .tpot_mean_s, ...
    lingjax.chat(model, [{"role": "user", "content": "..."}])  # the chat template, then generate

The names below import on first use, so `import lingjax` (and `lingjax --help`) starts without importing jax.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("lingjax")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "CheckpointError": "lingjax.checkpoint",
    "ConfigError": "lingjax.config",
    "LingConfig": "lingjax.config",
    "preset": "lingjax.config",
    "GenerationResult": "lingjax.engine",
    "chat": "lingjax.engine",
    "generate": "lingjax.engine",
    "Model": "lingjax.runtime",
    "RunOptions": "lingjax.runtime",
    "load": "lingjax.loading",
    "Tokenizer": "lingjax.tokenizer",
    "TokenizerError": "lingjax.tokenizer",
    "enable_compilation_cache": "lingjax.compilation_cache",
}

_RENAMED = {"enable_compilation_cache": "enable"}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lingjax' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_EXPORTS[name])
    value = getattr(module, _RENAMED.get(name, name))
    globals()[name] = value
    return value
