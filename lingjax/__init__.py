"""lingjax: a batch-1 inference engine for Ling-3.0-flash (HF `bailing_hybrid`) in JAX/Flax/Pallas.

    model = lingjax.load("tiny" | "/path/to/checkpoint", dtype="bfloat16", kernels="auto")
    model.logits(token_ids)                   # float32 [T, vocab], one full forward
    lingjax.generate(model, prompt_ids, 32)   # .tokens, .ttft_s, .tpot_mean_s, ...
"""

from lingjax.checkpoint import CheckpointError
from lingjax.config import ConfigError, LingConfig, preset
from lingjax.engine import GenerationResult, generate
from lingjax.runtime import Model, load

__all__ = ["CheckpointError", "ConfigError", "GenerationResult", "LingConfig", "Model", "generate", "load", "preset"]
