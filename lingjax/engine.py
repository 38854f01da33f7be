"""Plain (non-speculative) generation: jitted prefill chunks, a jitted decode step, a host loop.

The loop runs one step ahead: step k+1 is dispatched with step k's token still on the device
(decode takes the device token as input), and the host reads step k's token through an
asynchronous copy started at dispatch. Every device-to-host read goes through `host_read`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lingjax.model import SMALL_T
from lingjax.runtime import Model, _check_ids
from lingjax.sampling import SamplingParams

PREFILL_CHUNK = 512  # prompt tokens per prefill program (power of two)
MIN_CAPACITY = 256


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # new token ids (a stop token, when hit, is the last one)
    stop_reason: str  # "stop" (a stop/EOS id) or "length" (max_new_tokens)
    prompt_len: int
    ttft_s: float  # submit -> first new token on the host
    tpot_mean_s: float  # mean time per output token after the first (excludes TTFT)
    tpot_median_s: float
    total_s: float
    token_times_s: list[float]  # host arrival time of each new token, from submit

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else float("nan")


def host_read(x: jax.Array) -> np.ndarray:
    """The one place the generation loop reads a device value (tests watch it)."""
    return np.asarray(x)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_bucket(n: int) -> int:
    """Padded length of a prompt chunk: a power of two above SMALL_T, so a padded chunk always takes
    the chunked path (the decode-shaped path assumes every row is valid)."""
    return max(2 * SMALL_T, _pow2(n))


def cache_capacity(prompt_len: int, max_new_tokens: int) -> int:
    """Slots for the (chunk-padded) prompt and every new token, rounded to a power of two so few
    capacities (and so few compiled decode programs) ever exist."""
    full, rest = divmod(prompt_len, PREFILL_CHUNK)
    padded = full * PREFILL_CHUNK + (prefill_bucket(rest) if rest else 0)
    return max(MIN_CAPACITY, _pow2(max(padded, prompt_len + max_new_tokens) + 1))


def generate(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, stop_ids: Sequence[int] = (), *, top_k: int = 0, top_p: float = 1.0,
             ignore_eos: bool = False, on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Generate up to max_new_tokens after prompt_ids. Stops at any of stop_ids or the config's EOS
    ids (unless ignore_eos). on_token(id) is called as each token reaches the host."""
    prompt = np.asarray(list(prompt_ids), dtype=np.int32)
    if prompt.size == 0:
        raise ValueError("prompt_ids is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    _check_ids(prompt, model.cfg.vocab_size)
    sampling = SamplingParams(temperature, top_k, top_p)
    stops = set(int(s) for s in stop_ids) | (set() if ignore_eos else set(model.cfg.eos_token_ids))
    base_key = jax.random.key(seed)
    capacity = cache_capacity(prompt.size, max_new_tokens)

    t0 = time.perf_counter()
    cache = model.new_cache(capacity)
    token = None
    for start in range(0, prompt.size, PREFILL_CHUNK):
        chunk = prompt[start : start + PREFILL_CHUNK]
        padded = np.zeros(prefill_bucket(chunk.size), np.int32)
        padded[: chunk.size] = chunk
        token, _, cache = model._prefill(model.params, cache, jnp.asarray(padded), jnp.int32(start),
                                         jnp.int32(chunk.size), jax.random.fold_in(base_key, 0), sampling=sampling)
    token.copy_to_host_async()

    tokens: list[int] = []
    times: list[float] = []
    stop_reason = "length"
    pos = prompt.size
    while True:
        pending = token
        if len(tokens) + 1 < max_new_tokens:  # run ahead: dispatch the next step before reading this one
            token, cache = model._decode(model.params, cache, pending, jnp.int32(pos),
                                         jax.random.fold_in(base_key, len(tokens) + 1), sampling=sampling)
            token.copy_to_host_async()
            pos += 1
        value = int(host_read(pending))
        times.append(time.perf_counter() - t0)
        tokens.append(value)
        if on_token:
            on_token(value)
        if value in stops:
            stop_reason = "stop"
            break
        if len(tokens) >= max_new_tokens:
            break
    gaps = np.diff(times).tolist()
    return GenerationResult(
        tokens=tokens,
        stop_reason=stop_reason,
        prompt_len=int(prompt.size),
        ttft_s=times[0],
        tpot_mean_s=statistics.fmean(gaps) if gaps else float("nan"),
        tpot_median_s=statistics.median(gaps) if gaps else float("nan"),
        total_s=times[-1],
        token_times_s=times,
    )
