"""The packed token stream and what reads it: deterministic training batches, evaluation windows over the
held-out stream, and the tokenizer-independent bits-per-byte yardstick with its lzma baseline
(docs/corpus.md).

    stream = encode_files(tok, shuffled_files(corpus.train, seed=0))   # TokenStream, uint16
    batches = PackedBatches(stream.tokens, batch_size=32, seq_len=1024, seed=0)
    x = batches.batch(step)                                              # int32 [32, 1026]
    ev = eval_windows(encode_files(tok, corpus.held_out).tokens, 1024)   # windows [n, 1025], mask [n, 1024]
    bpb = bits_per_byte(sum_of_target_nll_nats, stream_of_held_out.num_bytes)
"""

from __future__ import annotations

import hashlib
import lzma
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer

from lingjax.train.bpe import EOS, EOS_ID
from lingjax.train.corpus import SourceFile


@dataclass(frozen=True)
class TokenStream:
    """tokens: uint16 [N], each file's ids followed by one EOS id, files in order; num_bytes: the UTF-8
    bytes of the files' texts (EOS adds none), the denominator of bits per byte; num_files.
    np.asarray(stream) is stream.tokens."""

    tokens: np.ndarray
    num_bytes: int
    num_files: int

    def __len__(self) -> int:
        return len(self.tokens)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.tokens if dtype is None else self.tokens.astype(dtype)


def encode_files(tok: Tokenizer, files: Sequence[SourceFile], *, batch: int = 256) -> TokenStream:
    """The token stream of files: ids of each text, then EOS, in the given order; batch texts at a time
    through tok.encode_batch_fast (parallel in Rust). Special-token strings inside a text (a docstring
    that says "<role>") encode as plain text, so the only special ids are the EOS separators."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert vocab <= 65536, f"vocab {vocab} does not fit uint16"
    eos = tok.token_to_id(EOS)
    assert eos == EOS_ID, f"{EOS} must be id {EOS_ID}, got {eos}"
    parts: list[np.ndarray] = []
    num_bytes = 0
    plain = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        for lo in range(0, len(files), batch):
            texts = [f.text for f in files[lo : lo + batch]]
            num_bytes += sum(len(t.encode("utf-8")) for t in texts)
            for enc in tok.encode_batch_fast(texts, add_special_tokens=False):
                parts.append(np.asarray(enc.ids, dtype=np.uint16))
                parts.append(np.array([eos], dtype=np.uint16))
    finally:
        tok.encode_special_tokens = plain
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    return TokenStream(tokens=tokens, num_bytes=num_bytes, num_files=len(files))


def _order_key(seed: int, f: SourceFile) -> bytes:
    return hashlib.blake2b(f"{seed}\0{f.name}\0{f.sha256}".encode(), digest_size=16).digest()


def shuffled_files(files: Sequence[SourceFile], seed: int) -> list[SourceFile]:
    """files in an order fixed by (seed, each file's name and hash): the same set gives the same order
    whatever order it comes in, and neighbours in a pack come from unrelated places."""
    return sorted(files, key=lambda f: _order_key(seed, f))


class PackedBatches:
    """Random windows of a packed stream. batch(step) is int32 [batch_size, seq_len + 2]: row r is
    tokens[s_r : s_r + seq_len + 2], the offsets s_r drawn uniformly from [0, N - seq_len - 2] by a
    generator seeded with (seed, step), so batch k is a pure function of (tokens, seed, k) and a resumed
    run sees the batches it would have seen. The +2 serves the MTP objective (the token at t+2). Windows
    cross EOS separators; nothing past the stream's end is read."""

    def __init__(self, tokens: np.ndarray | TokenStream, batch_size: int, seq_len: int, seed: int):
        self.tokens = np.asarray(tokens)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.width = seq_len + 2
        if self.tokens.ndim != 1 or len(self.tokens) < self.width:
            raise ValueError(f"the stream holds {self.tokens.shape} tokens, a window needs {self.width}")

    @property
    def num_starts(self) -> int:
        """How many distinct window offsets the stream has."""
        return len(self.tokens) - self.width + 1

    def starts(self, step: int) -> np.ndarray:
        """int64 [batch_size]: the window offsets of batch(step)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, self.num_starts, size=self.batch_size)

    def batch(self, step: int) -> np.ndarray:
        idx = self.starts(step)[:, None] + np.arange(self.width)
        return self.tokens[idx].astype(np.int32)


class EvalWindows(NamedTuple):
    """windows: int32 [n, seq_len + 1], inputs windows[:, :-1], targets windows[:, 1:]; mask: bool
    [n, seq_len], True where a target is real (False on the padding of the last window)."""

    windows: np.ndarray
    mask: np.ndarray

    @property
    def num_targets(self) -> int:
        return int(self.mask.sum())


def eval_windows(tokens: np.ndarray | TokenStream, seq_len: int, *, start_id: int | None = EOS_ID) -> EvalWindows:
    """Non-overlapping windows over a held-out stream, every token scored exactly once. The stream is
    start_id followed by tokens (start_id None: tokens alone, whose first token is then context only);
    window i is stream[i*seq_len : i*seq_len + seq_len + 1], so window i's targets are stream positions
    i*seq_len+1 .. i*seq_len+seq_len and consecutive windows share one token (the last target of one is
    the first input of the next). The last window is padded with EOS_ID and mask False. With start_id
    set, the real targets are exactly tokens (EOS separators included): num_targets == len(tokens)."""
    body = np.asarray(tokens)
    stream = body if start_id is None else np.concatenate([np.array([start_id], body.dtype), body])
    targets = len(stream) - 1
    if targets < 1:
        raise ValueError("the stream has no targets")
    n = math.ceil(targets / seq_len)
    padded = np.full(n * seq_len + 1, EOS_ID, dtype=np.int32)
    padded[: len(stream)] = stream
    rows = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)
    mask = (np.arange(n)[:, None] * seq_len + np.arange(1, seq_len + 1)) <= targets
    return EvalWindows(windows=padded[rows], mask=mask)


def bits_per_byte(nll_nats: float, num_bytes: int) -> float:
    """Total negative log-likelihood (natural log, summed over every scored target) in bits per UTF-8
    byte of the text: tokenizer-independent, comparable with lzma_bits_per_byte."""
    return nll_nats / math.log(2) / num_bytes


def lzma_bits_per_byte(data: bytes) -> float:
    """8 * len(xz at preset 9 | EXTREME) / len(data): the baseline any model should beat."""
    return 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data)


def held_out_bytes(files: Sequence[SourceFile]) -> bytes:
    """The UTF-8 texts of files concatenated in order, as the token stream joins them; the EOS separator
    contributes 0 bytes, so len() is encode_files(...).num_bytes."""
    return b"".join(f.text.encode("utf-8") for f in files)
