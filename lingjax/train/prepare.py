"""The data of a `python -m lingjax.train` run (docs/training.md, Data), built once and cached:

    run_data = prepare_data(opts, rep)   # RunData: tokenizer, train and held-out streams, fingerprint, lzma

From RUN_DIR/cache/ when it holds the streams for this key (the manifest, the tokenizer, the roots and the
seed: cache_key), memory-mapped, without reading the corpus. Otherwise, deterministically: the corpus is
collected under the roots; the first call writes RUN_DIR/corpus_manifest.jsonl and a later one must find
exactly its files (else CommandError); the first call trains the tokenizer on the train split and saves it to
RUN_DIR/tokenizer/, a later one loads it; the train split, shuffled by the seed, and the held-out split are
encoded; lzma's bits per byte on the held-out bytes is computed once into RUN_DIR/lzma_bpb.json; and the
streams go to cache/, whose meta.json, written last, marks it complete. The fingerprint (fingerprint: sha256
over both streams and the held-out byte count) is the data's identity in the checkpoint record. The drafter
trainer (lingjax.train.dspark) builds its streams from collect_corpus, encode_stream and the cache functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from lingjax.train import bpe, corpus, data
from lingjax.train.command import CommandError
from lingjax.train.options import Options
from lingjax.train.report import Reporter, mb, since

MANIFEST_FILE = "corpus_manifest.jsonl"
TOKENIZER_DIR = "tokenizer"
LZMA_FILE = "lzma_bpb.json"
CACHE_DIR = "cache"
CACHE_FORMAT = "lingjax.train.cache/1"
ENCODE_CHUNK_BYTES = 16_000_000  # text per encode_files call: one progress line each


@dataclasses.dataclass
class RunData:
    """What the loop reads: the tokenizer, the packed train stream (uint16 [N]), the held-out stream and the
    UTF-8 bytes it encodes (the bits-per-byte denominator), its fingerprint and lzma's figure."""

    tokenizer: object
    train_tokens: np.ndarray
    held_out_tokens: np.ndarray
    held_out_bytes: int
    fingerprint: str
    lzma_bpb: float


def _file_sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def cache_key(run_dir: Path, roots: dict[str, Path], seed: int) -> str:
    """What the cached streams are a function of: the manifest, the tokenizer, the roots and the data seed."""
    parts = {"format": CACHE_FORMAT, "manifest": _file_sha(run_dir / MANIFEST_FILE),
             "tokenizer": _file_sha(run_dir / TOKENIZER_DIR / "tokenizer.json"), "seed": seed,
             "roots": {k: str(Path(v).resolve()) for k, v in sorted(roots.items())},
             "held_out_packages": list(corpus.HELD_OUT_PACKAGES)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def fingerprint(train: np.ndarray, held_out: np.ndarray, held_out_bytes: int) -> str:
    """16 hex digits of sha256 over both token streams and the held-out byte count: the data's identity."""
    h = hashlib.sha256()
    for tokens in (train, held_out):
        h.update(len(tokens).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(tokens, dtype="<u2").tobytes())
    h.update(held_out_bytes.to_bytes(8, "little"))
    return h.hexdigest()[:16]


def load_cache(run_dir: Path, key: str) -> dict | None:
    """The cached streams ({"meta", "train", "held_out"}) when cache/ holds them for this key, else None."""
    root = run_dir / CACHE_DIR
    try:
        meta = json.loads((root / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("key") != key:
        return None
    try:
        return {"meta": meta, "train": np.load(root / "train.npy", mmap_mode="r"),
                "held_out": np.load(root / "held_out.npy")}
    except (OSError, ValueError):
        return None


def save_cache(run_dir: Path, key: str, train: np.ndarray, held_out: np.ndarray, meta: dict) -> None:
    """cache/{train,held_out}.npy and meta.json, the meta written last: its key marks the cache complete."""
    root = run_dir / CACHE_DIR
    root.mkdir(parents=True, exist_ok=True)
    (root / "meta.json").unlink(missing_ok=True)
    for name, tokens in (("train", train), ("held_out", held_out)):
        tmp = root / f".{name}.tmp.npy"
        np.save(tmp, tokens)
        os.replace(tmp, root / f"{name}.npy")
    (root / "meta.json").write_text(json.dumps({"key": key, **meta}, indent=1, sort_keys=True) + "\n")


def _rows(files) -> list[dict]:
    return [{"name": f.name, "sha256": f.sha256[: corpus.MANIFEST_HASH_CHARS], "bytes": f.num_bytes} for f in files]


def check_manifest(found: corpus.Corpus, path: Path) -> None:
    """CommandError unless the collected corpus has exactly the files (names, hashes, sizes) of the manifest."""
    saved = corpus.read_manifest(path)
    problems = []
    for split in ("train", "held_out"):
        want = {r["name"]: r for r in saved.get(split, [])}
        got = {r["name"]: r for r in _rows(getattr(found, split))}
        added, removed = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        changed = sorted(n for n in set(got) & set(want) if got[n] != want[n])
        if added or removed or changed:
            first = (added + removed + changed)[0]
            problems.append(f"{split}: {len(added)} added, {len(removed)} missing, {len(changed)} changed "
                            f"(first: {first})")
    if problems:
        raise CommandError(f"the corpus under these roots differs from {path}: " + "; ".join(problems)
                       + "; resume where the run started (the same interpreter or --roots) or use another --out")


def collect_corpus(roots: dict[str, Path], rep: Reporter) -> corpus.Corpus:
    t = time.perf_counter()
    shown = {"tenth": 0}

    def progress(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if total >= 2000 and tenth > shown["tenth"]:
            shown["tenth"] = tenth
            rep.say(f"corpus: read {done}/{total} candidate files")

    rep.say("corpus: collecting *.py under " + ", ".join(f"{k}={v}" for k, v in roots.items()))
    found = corpus.collect(roots, progress=progress)
    rep.say(f"corpus: {len(found.train)} train files ({mb(found.train_bytes)}), {len(found.held_out)} held-out "
            f"({mb(found.held_out_bytes)}), skipped {found.skipped} in {since(t)}")
    return found


def tokenizer_for(run_dir: Path, found: corpus.Corpus, cfg, rep: Reporter):
    """RUN_DIR/tokenizer when it exists (its vocabulary checked), else one trained on the train split."""
    tok_dir, vocab_size = run_dir / TOKENIZER_DIR, cfg.vocab_size
    if (tok_dir / "tokenizer.json").exists():
        tok = bpe.load_tokenizer(tok_dir)
        got = tok.get_vocab_size(with_added_tokens=True)
        if got != vocab_size:
            raise CommandError(f"{tok_dir} has {got} ids but this config needs {vocab_size}; use the run's --config "
                           "or another --out")
        rep.say(f"tokenizer: {tok_dir} ({got} ids)")
        return tok
    t = time.perf_counter()
    rep.say(f"tokenizer: training byte-level BPE, {vocab_size} ids, on {mb(found.train_bytes)} of train text")
    try:
        tok = bpe.train_tokenizer((f.text for f in found.train), vocab_size)
    except ValueError as e:
        raise CommandError(f"tokenizer: {e} (the corpus is too small for this vocabulary)") from None
    bpe.save_tokenizer_files(tok, tok_dir, model_max_length=cfg.max_position_embeddings)
    rep.say(f"tokenizer: trained in {since(t)}, saved to {tok_dir}")
    return tok


def encode_stream(tok, files, label: str, rep: Reporter) -> data.TokenStream:
    """data.encode_files over chunks of about ENCODE_CHUNK_BYTES of text (encode_batch inside, all cores),
    one progress line a chunk."""
    t = time.perf_counter()
    parts, chunk, size, done = [], [], 0, 0
    total = sum(f.num_bytes for f in files)
    for i, f in enumerate(files):
        chunk.append(f)
        size += f.num_bytes
        if size >= ENCODE_CHUNK_BYTES or i == len(files) - 1:
            parts.append(data.encode_files(tok, chunk))
            done += size
            chunk, size = [], 0
            if total > ENCODE_CHUNK_BYTES:
                rep.say(f"encode {label}: {mb(done)} of {mb(total)}")
    tokens = np.concatenate([p.tokens for p in parts]) if parts else np.zeros(0, np.uint16)
    stream = data.TokenStream(tokens, sum(p.num_bytes for p in parts), sum(p.num_files for p in parts))
    secs = time.perf_counter() - t
    rep.say(f"encode {label}: {len(files)} files, {mb(stream.num_bytes)} -> {len(stream)} tokens "
            f"({stream.num_bytes / max(len(stream), 1):.2f} bytes/token) in {secs:.1f} s "
            f"({stream.num_bytes / max(secs, 1e-9) / 1e6:.1f} MB/s)")
    return stream


def lzma_figure(run_dir: Path, held_out_text: bytes, rep: Reporter) -> float:
    """lzma's bits per byte on the held-out bytes, from RUN_DIR/lzma_bpb.json when it was computed for these
    bytes, else computed (slow: xz at its strongest preset) and written there."""
    path = run_dir / LZMA_FILE
    digest = corpus.sha256_hex(held_out_text)
    try:
        saved = json.loads(path.read_text())
        if saved.get("held_out_sha256") == digest:
            return float(saved["lzma_bpb"])
    except (OSError, json.JSONDecodeError, KeyError, ValueError):
        pass
    t = time.perf_counter()
    bpb = data.lzma_bits_per_byte(held_out_text)
    path.write_text(json.dumps({"held_out_sha256": digest, "bytes": len(held_out_text), "preset": "9|EXTREME",
                                "lzma_bpb": bpb}, indent=1) + "\n")
    rep.say(f"lzma: {bpb:.4f} bits/byte on the {mb(len(held_out_text))} held-out in {since(t)}")
    return bpb


def prepare_data(opts: Options, rep: Reporter) -> RunData:
    """The run's data: from cache/ when it matches (no corpus read), else built deterministically from the
    corpus (checked against the manifest when there is one) and the saved or freshly trained tokenizer."""
    run_dir, rc = opts.out, opts.rc
    key = cache_key(run_dir, opts.roots, rc.seed)
    cached = load_cache(run_dir, key)
    if cached is not None:
        meta = cached["meta"]
        rep.say(f"data: cached streams in {run_dir / CACHE_DIR}: {len(cached['train'])} train tokens, "
                f"{len(cached['held_out'])} held-out tokens")
        return RunData(bpe.load_tokenizer(run_dir / TOKENIZER_DIR), cached["train"], cached["held_out"],
                       meta["held_out_bytes"], meta["fingerprint"], float(meta["lzma_bpb"]))
    found = collect_corpus(opts.roots, rep)
    if not found.train or not found.held_out:
        raise CommandError(f"the corpus has {len(found.train)} train and {len(found.held_out)} held-out files; both "
                       f"must be non-empty (held out: {', '.join(corpus.HELD_OUT_PACKAGES)} under the "
                       f"'{corpus.STDLIB}' root)")
    manifest = run_dir / MANIFEST_FILE
    if manifest.exists():
        check_manifest(found, manifest)
    else:
        corpus.write_manifest(found, manifest, extra={"python": sys.version.split()[0], "roots": opts.roots})
        rep.say(f"corpus: manifest written to {manifest}")
    tok = tokenizer_for(run_dir, found, rc.cfg, rep)
    train = encode_stream(tok, data.shuffled_files(found.train, seed=rc.seed), "train", rep)
    held = encode_stream(tok, found.held_out, "held-out", rep)
    lzma_bpb = lzma_figure(run_dir, data.held_out_bytes(found.held_out), rep)
    fp = fingerprint(train.tokens, held.tokens, held.num_bytes)
    meta = {"fingerprint": fp, "held_out_bytes": held.num_bytes, "train_bytes": train.num_bytes,
            "lzma_bpb": lzma_bpb}
    t = time.perf_counter()
    save_cache(run_dir, cache_key(run_dir, opts.roots, rc.seed), train.tokens, held.tokens, meta)
    rep.say(f"data: fingerprint {fp}, streams cached in {run_dir / CACHE_DIR} in {since(t)}")
    return RunData(tok, train.tokens, held.tokens, held.num_bytes, fp, lzma_bpb)
