"""lingjax.train: training a small Ling-architecture code model on the Python source a machine already
holds. The data side is `corpus` (collect, dedup and split the *.py files of this interpreter's stdlib
and site-packages), `bpe` (the byte-level BPE tokenizer, its special tokens, chat template and HF files)
and `data` (the packed uint16 token stream, deterministic training batches, evaluation windows and the
lzma bits-per-byte baseline); docs/corpus.md describes the contract. Import the submodules directly:
this package imports nothing at import time, so `import lingjax.train` stays free of numpy, tokenizers
and jax.
"""
