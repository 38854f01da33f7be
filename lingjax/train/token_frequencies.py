"""The token frequency table of a model's training corpus, for its draft vocabulary (lingjax.spec.draft_vocab):

    python -m lingjax.train.token_frequencies --checkpoint checkpoints/ling-code-tiny \\
        --out checkpoints/ling-code-tiny/token_frequencies.npy

The corpus is lingjax.train.corpus.collect() of the running interpreter (its stdlib and site-packages, the held-out
packages left out: the train split alone), encoded by the checkpoint's tokenizer.json as training encodes it
(lingjax.train.data.encode_files: each file's ids, then the end-of-text id). The table is the count of each id,
uint32 [vocab_size] (.npy). Deterministic for a given set of files; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from lingjax.train import bpe, corpus, data

CHUNK_FILES = 2000  # files per encode call: one progress line each


def count_tokens(tok, files, vocab_size: int, say=lambda s: None) -> np.ndarray:
    """Count of each id in the training encoding of files -> uint32 [vocab_size]."""
    counts = np.zeros(vocab_size, np.int64)
    for lo in range(0, len(files), CHUNK_FILES):
        stream = data.encode_files(tok, files[lo : lo + CHUNK_FILES])
        counts += np.bincount(stream.tokens, minlength=vocab_size)[:vocab_size]
        say(f"encoded {min(lo + CHUNK_FILES, len(files))} of {len(files)} files")
    if counts.max() >= 2**32:
        raise ValueError("a token count exceeds uint32")
    return counts.astype(np.uint32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lingjax.train.token_frequencies", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint directory with tokenizer.json")
    ap.add_argument("--out", type=Path, required=True, help="the .npy table written")
    args = ap.parse_args(argv)
    tok_file = args.checkpoint / "tokenizer.json"
    config = args.checkpoint / "config.json"
    if not tok_file.is_file() or not config.is_file():
        print(f"lingjax: error: {args.checkpoint} has no tokenizer.json and config.json", file=sys.stderr)
        return 2
    if args.out.suffix != ".npy":
        print(f"lingjax: error: --out {args.out}: the table is a .npy file", file=sys.stderr)
        return 2
    vocab_size = int(json.loads(config.read_text())["vocab_size"])
    tok = bpe.load_tokenizer(tok_file)
    t = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - t:6.1f} s] {line}", file=sys.stderr, flush=True)

    found = corpus.collect()
    say(f"corpus: {len(found.train)} train files, {found.train_bytes / 1e6:.1f} MB (held out: "
        f"{', '.join(corpus.HELD_OUT_PACKAGES)})")
    counts = count_tokens(tok, found.train, vocab_size, say)
    np.save(args.out, counts)
    say(f"{int(counts.sum())} tokens, {int((counts > 0).sum())} of {vocab_size} ids seen -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
