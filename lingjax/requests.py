"""Checks of a generation request, made before any work: the CLI runs them before a weight is read, the API
before the prompt reaches the device. Each raises ValueError with a message that names the argument."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

import numpy as np

from lingjax.config import DEFAULT_STEPS, VERIFY_ROWS, LingConfig

SPEC_METHODS = ("nextn", "dspark")
# Prompt tokens per prefill program (a power of two). Each chunk touches every routed expert, so each
# reads all the weights: fewer, longer chunks read them fewer times (docs/engine.md).
PREFILL_CHUNK = 2048
MIN_PREFILL_CHUNK = 2 * VERIFY_ROWS  # a chunk past the verify rows takes the chunked path


MAX_SEED = 2**63  # seeds are int64 values


def is_int(value) -> bool:
    """An integer, not a bool (True is an int in Python, never a count here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_sampling(temperature: float, top_k: int, top_p: float, vocab_size: int | None = None) -> None:
    if not is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if not is_int(top_k) or top_k < 0 or (vocab_size is not None and top_k > vocab_size):
        top = f" and at most the vocabulary's {vocab_size}" if vocab_size is not None else ""
        raise ValueError(f"top_k must be an integer >= 0{top} (0: off), got {top_k!r}")
    if not is_real(top_p) or not 0.0 < top_p <= 1.0:  # NaN fails the comparison too
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")


def check_seed(seed) -> int:
    if not is_int(seed) or not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return int(seed)


def check_callback(name: str, fn) -> None:
    if fn is not None and not callable(fn):
        raise ValueError(f"{name} must be a callable or None, got {fn!r}")


def check_prompt_ids(ids, vocab_size: int) -> np.ndarray:
    """ids: a non-empty sequence of integers in [0, vocab_size) -> int32 [T]. Floats and bools are errors, not
    truncated."""
    if isinstance(ids, (str, bytes)):
        raise ValueError("prompt token ids must be a sequence of integers, got text")
    values = list(ids) if not isinstance(ids, np.ndarray) else ids.reshape(-1).tolist()
    if not values:
        raise ValueError("the prompt is empty")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    if bad:
        raise ValueError(f"prompt token ids must be integers, got {bad[:3]!r}")
    out = np.asarray(values, dtype=np.int64)
    outside = out[(out < 0) | (out >= vocab_size)]
    if outside.size:
        raise ValueError(f"token ids {outside[:5].tolist()} are outside the vocabulary [0, {vocab_size})")
    return out.astype(np.int32)


def check_stop_ids(ids: Sequence[int], vocab_size: int) -> set[int]:
    bad = [i for i in ids if not is_int(i) or not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"stop ids {bad[:5]} are not ids of the vocabulary [0, {vocab_size})")
    return {int(i) for i in ids}


def check_widths(widths, draft_block: int) -> tuple[int, ...]:
    """DSpark verify widths to choose from each round: integers in [2, the drafter's block size + 1], at most the
    kernels' VERIFY_ROWS -> sorted, distinct."""
    top = min(draft_block + 1, VERIFY_ROWS)
    bad = [w for w in widths if not is_int(w) or not 2 <= w <= top]
    if not widths or bad:
        raise ValueError(f"widths must lie in [2, {top}] (verify widths: the drafter's block size + 1), got "
                         f"{list(widths)}")
    return tuple(sorted({int(w) for w in widths}))


def check_prefill_chunk(tokens) -> int:
    """A prefill chunk length: a power of two of at least MIN_PREFILL_CHUNK (a padded chunk then always takes the
    chunked path; lingjax.engine.prefill_bucket)."""
    if not is_int(tokens) or tokens & (tokens - 1) or tokens < MIN_PREFILL_CHUNK:
        raise ValueError(f"prefill_chunk must be a power of two >= {MIN_PREFILL_CHUNK}, got {tokens!r}")
    return int(tokens)


def default_steps(spec: str, draft_block: int | None) -> int:
    """The drafts per round when a request names none: DEFAULT_STEPS for NEXTN, the whole block for DSpark."""
    return draft_block if spec == "dspark" else DEFAULT_STEPS


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
    """A checked request, all but its prompt: what lingjax.engine.generate runs. steps: drafts per round (0 without
    spec, and with DSpark widths to choose from); widths: the verify widths a round may take (() without spec;
    steps + 1, or the widths a DSpark request gave, for the host to choose from each round:
    lingjax.spec.width_schedule.WidthSchedule)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    spec: str | None
    steps: int
    widths: tuple[int, ...]
    rounds_per_call: int
    prefill_chunk: int

    @property
    def scheduled(self) -> bool:
        """Whether the host picks each round's verify width (the request gave widths)."""
        return self.spec is not None and self.steps == 0


# check_generation's arguments a caller may name differently (a CLI flag, an API field): a message about one starts
# with its name
ARGUMENTS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "steps", "widths", "rounds_per_call")


def argument_of(message: str) -> str | None:
    """The argument of ARGUMENTS a check_generation message is about (its first word), or None."""
    first = message.split(" ", 1)[0]
    return first if first in ARGUMENTS else None


def check_generation(cfg: LingConfig, *, prompt_len: int, max_new_tokens: int, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, spec: str | None = None, steps: int | None = None,
                     widths: Sequence[int] | None = None, rounds_per_call: int = 1, has_mtp: bool | None = None,
                     draft_block: int | None = None, seed: int = 0,
                     prefill_chunk: int = PREFILL_CHUNK) -> GenerationPlan:
    """Everything about a request but the prompt's ids -> its GenerationPlan. draft_block: the block size of the
    model's DSpark drafter (None: it has none). Options that would have no effect are errors, so a typo never
    silently changes nothing."""
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p, cfg.vocab_size)
    seed = check_seed(seed)
    if temperature == 0 and (top_k != 0 or top_p != 1.0):
        raise ValueError("top_k and top_p have no effect at temperature 0 (greedy); set a temperature > 0")
    if not is_int(rounds_per_call) or rounds_per_call < 1:
        raise ValueError(f"rounds_per_call must be an integer >= 1, got {rounds_per_call!r}")
    prefill_chunk = check_prefill_chunk(prefill_chunk)
    if prompt_len + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"the prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) is past the "
                         f"model's maximum length of {cfg.max_position_embeddings} tokens")
    plan = functools.partial(GenerationPlan, int(max_new_tokens), temperature, int(top_k), top_p, seed, spec,
                             rounds_per_call=int(rounds_per_call), prefill_chunk=prefill_chunk)
    if widths is not None and spec != "dspark":
        raise ValueError("widths (verify widths chosen each round) have no effect without --spec dspark "
                         "(spec='dspark')")
    if widths is not None and steps is not None:
        raise ValueError("give steps (a fixed verify width) or widths (chosen each round), not both")
    if spec is None:
        if steps is not None:
            raise ValueError("steps (drafts per speculative round) has no effect without spec; add spec='nextn' or "
                             "'dspark'")
        return plan(0, ())
    if spec not in SPEC_METHODS:
        raise ValueError(f"spec must be one of {SPEC_METHODS} or None, got {spec!r}")
    if spec == "dspark":
        if draft_block is None:
            raise ValueError("spec='dspark' needs a DSpark drafter beside the model: load it with "
                             "lingjax.load(..., draft=DIR) (the CLI's --draft DIR)")
        if widths is not None:
            return plan(0, check_widths(widths, draft_block))
        steps = default_steps(spec, draft_block) if steps is None else steps
        if not is_int(steps) or not 1 <= steps <= draft_block:
            raise ValueError(f"steps must be an integer in [1, {draft_block}] (the drafter's block size) with "
                             f"spec='dspark', got {steps!r}")
        if steps + 1 > VERIFY_ROWS:
            raise ValueError(f"a verify of {steps + 1} rows is past the kernels' {VERIFY_ROWS}: give steps <= "
                             f"{VERIFY_ROWS - 1}")
        return plan(int(steps), (int(steps) + 1,))
    steps = default_steps(spec, draft_block) if steps is None else steps
    if not is_int(steps) or not 1 <= steps <= VERIFY_ROWS - 1:
        raise ValueError(f"steps must be an integer in [1, {VERIFY_ROWS - 1}] (verify width steps+1 <= "
                         f"{VERIFY_ROWS}), got {steps!r}")
    if cfg.num_nextn_predict_layers < 1 or has_mtp is False:
        raise ValueError(f"spec={spec!r} needs the MTP layer (model.layers.{cfg.mtp_layer_id}.*), which this "
                         "model does not have; generate without spec")
    return plan(int(steps), (int(steps) + 1,))
