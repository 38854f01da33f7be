"""Fill-in-the-middle prompts: the text before and after a gap -> the token ids that ask the model for the gap.

The layout is prefix-suffix-middle, with the tokenizer's own FIM tokens (as Ling-3's and Qwen-Coder's tokenizers
name them): `<|fim_prefix|>` PREFIX `<|fim_suffix|>` SUFFIX `<|fim_middle|>`, the model's reply being the middle.
A tokenizer without these tokens cannot take a suffix: ValueError, naming what is missing.
"""

from __future__ import annotations

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def fim_token_ids(tokenizer, source: str) -> tuple[int, int, int]:
    """(prefix, suffix, middle) ids of the FIM tokens; ValueError naming `source` when its tokenizer lacks any."""
    ids = [tokenizer.token_id(t) if tokenizer is not None else None for t in FIM_TOKENS]
    missing = [t for t, i in zip(FIM_TOKENS, ids) if i is None]
    if missing:
        raise ValueError(f"{source} has no fill-in-the-middle tokens ({', '.join(missing)} are not in its "
                         "tokenizer): a suffix is not supported with this model")
    return ids[0], ids[1], ids[2]


def fim_prompt(tokenizer, source: str, prefix: str, suffix: str) -> list[int]:
    """The ids of `prefix` and `suffix` around the FIM tokens (each text encoded on its own, so a piece never
    merges across the tokens)."""
    pre, suf, mid = fim_token_ids(tokenizer, source)
    return [pre, *tokenizer.encode(prefix), suf, *tokenizer.encode(suffix), mid]
