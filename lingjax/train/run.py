"""`python -m lingjax.train`: the one command that starts or resumes a training run (docs/training.md).

    python -m lingjax.train --out RUN_DIR [--config embedded|small] [--steps N] [--time-limit-s S]
        [--batch B] [--seq-len T] [--lr LR] [--warmup-steps W] [--seed K] [--remat] [--eval-every N]
        [--log-every N] [--save-every-s S] [--export EXPORT_DIR] [--roots LABEL=PATH ...]

The same command, repeated with the same RUN_DIR and options, continues the run until it reaches --steps;
a call that reaches the final step exports the Hugging Face layout and checks it with lingjax.load. RUN_DIR:

    corpus_manifest.jsonl  the corpus (lingjax.train.corpus), written by the first call
    tokenizer/             the BPE tokenizer's HF files, trained on the train split by the first call
    lzma_bpb.json          lzma's bits per byte on the held-out bytes, computed once
    checkpoint/step_N/     the newest resume state (lingjax.train.checkpointing)
    log.jsonl              one JSON object per log line, evaluation and call summary
    cache/                 the encoded token streams: not carried between machines, rebuilt when absent
    export/                the HF checkpoint of the final step, unless --export names another directory

Everything but cache/ is small (under 60 MB for the embedded config), so the directory can be carried
between machines; the data fingerprint in the checkpoint makes a resume on a different corpus fail.
Errors before any work (bad flags, an --out that is a file, a resume with other options) are one line
`lingjax.train: error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from lingjax.train import bpe, checkpointing, corpus, data, model_config, optim, step
from lingjax.train.checkpointing import CheckpointMismatch

PROG = "lingjax.train"
MANIFEST_FILE = "corpus_manifest.jsonl"
TOKENIZER_DIR = "tokenizer"
LZMA_FILE = "lzma_bpb.json"
LOG_FILE = "log.jsonl"
CACHE_DIR = "cache"
EXPORT_DIR = "export"
CACHE_FORMAT = "lingjax.train.cache/1"
SMOKE_PROMPT = "def quicksort(xs):"
SMOKE_TOKENS = 16
ENCODE_CHUNK_BYTES = 16_000_000  # text per encode_files call: one progress line each
# What the time limit keeps in hand for the work after the last step, before it has been measured in this
# call: a save writes about SAVE_BYTES_PER_S; an export with its smoke completion takes EXPORT_RESERVE_S.
SAVE_BYTES_PER_S = 50_000_000
SAVE_FIXED_S = 2.0
EXPORT_RESERVE_S = 45.0


class RunError(Exception):
    """A problem reported as one `lingjax.train: error: ...` line, exit status 2."""


# ---- flags ------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: main turns it into exit status 2
        raise RunError(message)


def _parser() -> argparse.ArgumentParser:
    defaults = optim.OptimConfig()
    p = _Parser(prog=f"python -m {PROG}", description="Start or resume a training run of the embedded code "
                "model (docs/training.md).")
    p.add_argument("--out", required=True, type=Path, help="the run directory (created; resumed when it holds "
                   "a checkpoint)")
    p.add_argument("--config", default="embedded", choices=sorted(model_config.CONFIGS), help="model config")
    p.add_argument("--steps", type=int, default=defaults.total_steps, help="total optimizer steps of the run "
                   "(the schedule's length)")
    p.add_argument("--time-limit-s", type=float, default=None, help="stop this call early enough to save "
                   "(and export) within this many seconds of its start")
    p.add_argument("--batch", type=int, default=step.RunConfig.batch, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=step.RunConfig.seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    p.add_argument("--remat", action="store_true", help="recompute each layer's activations in the backward "
                   "pass (less memory, more time)")
    p.add_argument("--eval-every", type=int, default=500, help="held-out evaluation every N steps (and at "
                   "the end of each call)")
    p.add_argument("--log-every", type=int, default=10, help="a log line every N steps")
    p.add_argument("--save-every-s", type=float, default=600.0, help="a checkpoint every S seconds (and at "
                   "the end of each call)")
    p.add_argument("--export", type=Path, default=None, metavar="EXPORT_DIR", help="export the HF layout "
                   "here at the end of this call (default: RUN_DIR/export, at the final step only)")
    p.add_argument("--roots", nargs="+", default=None, metavar="LABEL=PATH", help="corpus roots (default: "
                   "this interpreter's stdlib and site-packages); the label 'stdlib' holds the held-out packages")
    return p


@dataclasses.dataclass(frozen=True)
class Options:
    """The parsed command: the run's identity (rc) and how this call runs."""

    rc: step.RunConfig
    out: Path
    roots: dict[str, Path]
    time_limit_s: float | None
    eval_every: int
    log_every: int
    save_every_s: float
    export: Path | None


def _positive(name: str, value, minimum=1) -> None:
    if value < minimum:
        raise RunError(f"{name} must be >= {minimum}, got {value}")


def parse_roots(items: list[str]) -> dict[str, Path]:
    """["label=path", ...] -> {label: path}; each path an existing directory, each label unique."""
    roots: dict[str, Path] = {}
    for item in items:
        label, sep, raw = item.partition("=")
        if not sep or not label or "/" in label or not raw:
            raise RunError(f"--roots takes LABEL=PATH items, got {item!r}")
        if label in roots:
            raise RunError(f"--roots names {label!r} twice")
        path = Path(raw).expanduser()
        if not path.is_dir():
            raise RunError(f"--roots {label}={raw}: not a directory")
        roots[label] = path
    return roots


def parse_args(argv: list[str] | None) -> Options:
    """The command line -> Options; every check that needs no data (RunError on the first failure)."""
    a = _parser().parse_args(argv)
    _positive("--steps", a.steps)
    _positive("--warmup-steps", a.warmup_steps, 0)
    _positive("--eval-every", a.eval_every)
    _positive("--log-every", a.log_every)
    if not a.lr > 0 or not math.isfinite(a.lr):
        raise RunError(f"--lr must be a positive number, got {a.lr}")
    if a.save_every_s <= 0:
        raise RunError(f"--save-every-s must be > 0, got {a.save_every_s}")
    if a.time_limit_s is not None and not a.time_limit_s >= 0:
        raise RunError(f"--time-limit-s must be >= 0, got {a.time_limit_s}")
    try:
        rc = step.RunConfig(config=a.config, batch=a.batch, seq_len=a.seq_len, seed=a.seed, remat=a.remat,
                            optim=optim.OptimConfig(lr=a.lr, warmup_steps=a.warmup_steps, total_steps=a.steps))
    except ValueError as e:
        raise RunError(str(e)) from None
    max_len = model_config.config_dict(a.config)["max_position_embeddings"]
    if a.seq_len + 1 > max_len:
        raise RunError(f"--seq-len {a.seq_len} does not fit the model's {max_len} positions")
    for flag, path in (("--out", a.out), ("--export", a.export)):
        if path is not None and path.exists() and not path.is_dir():
            raise RunError(f"{flag} {path} is a file, not a directory")
    roots = parse_roots(a.roots) if a.roots is not None else corpus.default_roots()
    return Options(rc=rc, out=a.out, roots=roots, time_limit_s=a.time_limit_s, eval_every=a.eval_every,
                   log_every=a.log_every, save_every_s=a.save_every_s, export=a.export)


# ---- reporting --------------------------------------------------------------------------------------
class Reporter:
    """Progress lines on stdout, each led by the seconds since the call started; JSON events in log.jsonl."""

    def __init__(self, run_dir: Path, t0: float):
        self.log_path = run_dir / LOG_FILE
        self.t0 = t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():8.1f}s] {message}", flush=True)

    def event(self, kind: str, **fields) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"event": kind, **fields}, sort_keys=True) + "\n")


def _since(t: float) -> str:
    return f"{time.perf_counter() - t:.1f} s"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# ---- data -------------------------------------------------------------------------------------------
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
    """RunError unless the collected corpus has exactly the files (names, hashes, sizes) of the manifest."""
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
        raise RunError(f"the corpus under these roots differs from {path}: " + "; ".join(problems)
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
    rep.say(f"corpus: {len(found.train)} train files ({_mb(found.train_bytes)}), {len(found.held_out)} held-out "
            f"({_mb(found.held_out_bytes)}), skipped {found.skipped} in {_since(t)}")
    return found


def tokenizer_for(run_dir: Path, found: corpus.Corpus, cfg, rep: Reporter):
    """RUN_DIR/tokenizer when it exists (its vocabulary checked), else one trained on the train split."""
    tok_dir, vocab_size = run_dir / TOKENIZER_DIR, cfg.vocab_size
    if (tok_dir / "tokenizer.json").exists():
        tok = bpe.load_tokenizer(tok_dir)
        got = tok.get_vocab_size(with_added_tokens=True)
        if got != vocab_size:
            raise RunError(f"{tok_dir} has {got} ids but this config needs {vocab_size}; use the run's --config "
                           "or another --out")
        rep.say(f"tokenizer: {tok_dir} ({got} ids)")
        return tok
    t = time.perf_counter()
    rep.say(f"tokenizer: training byte-level BPE, {vocab_size} ids, on {_mb(found.train_bytes)} of train text")
    try:
        tok = bpe.train_tokenizer((f.text for f in found.train), vocab_size)
    except ValueError as e:
        raise RunError(f"tokenizer: {e} (the corpus is too small for this vocabulary)") from None
    bpe.save_tokenizer_files(tok, tok_dir, model_max_length=cfg.max_position_embeddings)
    rep.say(f"tokenizer: trained in {_since(t)}, saved to {tok_dir}")
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
                rep.say(f"encode {label}: {_mb(done)} of {_mb(total)}")
    tokens = np.concatenate([p.tokens for p in parts]) if parts else np.zeros(0, np.uint16)
    stream = data.TokenStream(tokens, sum(p.num_bytes for p in parts), sum(p.num_files for p in parts))
    secs = time.perf_counter() - t
    rep.say(f"encode {label}: {len(files)} files, {_mb(stream.num_bytes)} -> {len(stream)} tokens "
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
    rep.say(f"lzma: {bpb:.4f} bits/byte on the {_mb(len(held_out_text))} held-out in {_since(t)}")
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
        raise RunError(f"the corpus has {len(found.train)} train and {len(found.held_out)} held-out files; both "
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
    rep.say(f"data: fingerprint {fp}, streams cached in {run_dir / CACHE_DIR} in {_since(t)}")
    return RunData(tok, train.tokens, held.tokens, held.num_bytes, fp, lzma_bpb)


# ---- evaluation -------------------------------------------------------------------------------------
def eval_batches(windows: data.EvalWindows, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The windows in (rows int32 [batch, T + 1], mask bool [batch, T]) pieces, the last padded with masked
    EOS rows, so one program shape serves them all."""
    n = len(windows.windows)
    padded = -(-n // batch) * batch
    rows = np.full((padded, windows.windows.shape[1]), bpe.EOS_ID, np.int32)
    rows[:n] = windows.windows
    mask = np.zeros((padded, windows.mask.shape[1]), bool)
    mask[:n] = windows.mask
    return [(rows[i : i + batch], mask[i : i + batch]) for i in range(0, padded, batch)]


def evaluate(fn, state: dict, pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int]:
    """(summed next-token NLL in nats, scored targets) over every piece (eval_batches) with fn
    (step.eval_fn's program); one device read at the end."""
    import jax

    outs = [fn(state["params"], state["biases"], rows, mask) for rows, mask in pieces]
    host = jax.device_get(outs)
    return float(sum(float(nll) for nll, _ in host)), int(sum(int(c) for _, c in host))


# ---- the loop ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class CallProgress:
    """This call's counters and the estimates the time limit uses (seconds)."""

    start_step: int
    step: int
    steady_s: float = 0.0  # time in measured step windows (no compile, eval or save)
    steady_steps: int = 0
    step_s: float | None = None  # one step, latest estimate
    save_s: float | None = None
    eval_s: float | None = None
    last_bpb: float | None = None
    last_eval_step: int | None = None
    saved_step: int | None = None
    loop_t0: float | None = None  # when this call's loop began
    loop_s: float | None = None  # how long it ran, once it has ended

    @property
    def steps_done(self) -> int:
        return self.step - self.start_step


class Trainer:
    """The train loop of one call over a restored or fresh state (module docstring)."""

    def __init__(self, opts: Options, run_data: RunData, state: dict, start: int, restored: bool, prior: dict,
                 rep: Reporter):
        self.opts, self.rc, self.d, self.state, self.rep = opts, opts.rc, run_data, state, rep
        self.prior = prior  # the checkpoint record's "progress" ({} for a fresh run)
        self.p = CallProgress(start_step=start, step=start, saved_step=start if restored else None)
        self.p.last_bpb = prior.get("last_bpb")
        try:
            self.batches = data.PackedBatches(run_data.train_tokens, self.rc.batch, self.rc.seq_len, self.rc.seed)
        except ValueError as e:
            raise RunError(f"the train stream is too short for --seq-len {self.rc.seq_len}: {e}") from None
        self.windows = data.eval_windows(run_data.held_out_tokens, self.rc.seq_len)
        self.eval_pieces = eval_batches(self.windows, self.rc.batch)
        self.train_program = self.eval_program = None  # compiled by _compile
        self.schedule = optim.lr_schedule(self.rc.optim)
        self.tokens_per_step = self.rc.batch * self.rc.seq_len

    # -- time limit
    def _reserve(self, exports: bool) -> float:
        """Seconds the work after the last step needs: an evaluation, a save and, when one follows, the export."""
        step_s = self.p.step_s or 0.0
        eval_s = self.p.eval_s if self.p.eval_s is not None else step_s * len(self.eval_pieces) / 2
        save_s = self.p.save_s if self.p.save_s is not None else SAVE_FIXED_S + optim.tree_bytes(
            self.state) / SAVE_BYTES_PER_S
        return eval_s + save_s + (EXPORT_RESERVE_S if exports else 0.0)

    def _out_of_time(self, synced_at: float, synced_step: int) -> bool:
        """Whether one more step (after those dispatched since the last sync) would leave too little for the
        reserve. The first step of a call is always taken, so every call makes progress."""
        if self.opts.time_limit_s is None or self.p.steps_done == 0:
            return False
        queued = self.p.step - synced_step + 1
        exports = self.opts.export is not None or self.p.step + 1 >= self.rc.optim.total_steps
        projected = synced_at - self.rep.t0 + queued * (self.p.step_s or 0.0) + self._reserve(exports)
        return projected > self.opts.time_limit_s

    # -- the loop
    def run(self) -> str:
        """Steps until the final step or the time limit; -> why it stopped ("final_step" or "time_limit")."""
        import jax

        total = self.rc.optim.total_steps
        t_loop = self.p.loop_t0 = time.perf_counter()
        if self.p.step < total:
            self._compile()
        fn = self.train_program
        last_save = t_loop
        window: list = []
        synced_at, synced_step = time.perf_counter(), self.p.step
        reason = "final_step"
        while self.p.step < total:
            if self._out_of_time(synced_at, synced_step):
                reason = "time_limit"
                break
            self.state, metrics = fn(self.state, self.batches.batch(self.p.step))
            self.p.step += 1
            window.append(metrics)
            n = self.p.steps_done
            if n <= 2:  # the first two steps are timed alone: the first step's estimate, then a steady one
                jax.block_until_ready(metrics)
                now = time.perf_counter()
                self.p.step_s = now - synced_at
                if n == 1:
                    self.rep.say(f"step {self.p.step}: the first step ran in {self.p.step_s:.2f} s")
                else:
                    self.p.steady_s += now - synced_at
                    self.p.steady_steps += 1
                synced_at, synced_step = now, self.p.step
            if self.p.step % self.opts.log_every == 0 or self.p.step == total:
                synced_at, synced_step = self._log(window, synced_at, synced_step)
                window = []
            if self.p.step % self.opts.eval_every == 0:
                self._eval()
                synced_at, synced_step = time.perf_counter(), self.p.step
            if time.perf_counter() - last_save >= self.opts.save_every_s:
                self._save()
                last_save = synced_at = time.perf_counter()
                synced_step = self.p.step
        if window:
            self._log(window, synced_at, synced_step)
        if self.p.last_eval_step != self.p.step:
            self._eval()
        if self.p.saved_step != self.p.step:
            self._save()
        self.p.loop_s = time.perf_counter() - t_loop
        return reason

    def _compile(self) -> None:
        """Compile the train step and the evaluation ahead of the first step (jax's persistent cache serves a
        program compiled before), so that the first step's time is a step's and the time limit can use it."""
        t = time.perf_counter()
        self.train_program = step.train_step_fn(self.rc).lower(self.state, self.batches.batch(self.p.step)).compile()
        rows, mask = self.eval_pieces[0]
        self.eval_program = step.eval_fn(self.rc).lower(self.state["params"], self.state["biases"], rows,
                                                         mask).compile()
        self.rep.say(f"compile: the train step and the evaluation in {_since(t)}")

    def _log(self, window: list, synced_at: float, synced_step: int) -> tuple[float, int]:
        """One log line over the steps since the last sync (means of their metrics) -> the new sync point."""
        import jax

        host = jax.device_get(window)
        now = time.perf_counter()
        steps = self.p.step - synced_step
        if steps > 0 and synced_step > self.p.start_step:  # a window after the first step (timed alone)
            self.p.steady_s += now - synced_at
            self.p.steady_steps += steps
            self.p.step_s = (now - synced_at) / steps
        mean = {k: float(np.mean([m[k] for m in host])) for k in host[0]} if host else {}
        rate = steps * self.tokens_per_step / max(now - synced_at, 1e-9) if steps else None
        lr = float(self.schedule(self.p.step - 1))
        fields = {"step": self.p.step, "loss": mean.get("loss"), "main_ce": mean.get("main_ce"),
                  "mtp_ce": mean.get("mtp_ce"), "balance": mean.get("balance"),
                  "load_imbalance_max": mean.get("load_imbalance_max"), "grad_norm": mean.get("grad_norm"),
                  "lr": lr, "tokens_per_s": rate, "elapsed_s": self.rep.elapsed()}
        if host:
            self.rep.say(f"step {self.p.step:>7}/{self.rc.optim.total_steps}  loss {mean['loss']:.4f}  "
                         f"ce {mean['main_ce']:.4f}  mtp {mean['mtp_ce']:.4f}  lr {lr:.3e}  "
                         f"grad_norm {mean['grad_norm']:.3f}  tok/s {'-' if rate is None else f'{rate:,.0f}'}")
            self.rep.event("train", **fields)
        return now, self.p.step

    def _eval(self) -> None:
        t = time.perf_counter()
        if self.eval_program is None:  # a call that takes no step still evaluates its state
            self.eval_program = step.eval_fn(self.rc)
        nll, count = evaluate(self.eval_program, self.state, self.eval_pieces)
        self.p.eval_s = time.perf_counter() - t
        bpb = data.bits_per_byte(nll, self.d.held_out_bytes)
        self.p.last_bpb, self.p.last_eval_step = bpb, self.p.step
        self.rep.say(f"eval step {self.p.step}: held-out {bpb:.4f} bits/byte (lzma {self.d.lzma_bpb:.4f}), "
                     f"{nll / max(count, 1):.4f} nats/token over {count} tokens in {self.p.eval_s:.1f} s")
        self.rep.event("eval", step=self.p.step, bpb=bpb, lzma_bpb=self.d.lzma_bpb, nats_per_token=nll / max(count, 1),
                       tokens=count, bytes=self.d.held_out_bytes)

    def record(self) -> dict:
        """The checkpoint record of the current state (checkpointing.save)."""
        return {"run": run_identity(self.rc),
                "data": {"seed": self.rc.seed, "position": self.p.step, "fingerprint": self.d.fingerprint,
                         "train_tokens": int(len(self.d.train_tokens)), "held_out_bytes": self.d.held_out_bytes},
                "progress": self.progress()}

    def progress(self) -> dict:
        if self.p.loop_s is not None:
            loop_s = self.p.loop_s
        else:
            loop_s = time.perf_counter() - self.p.loop_t0 if self.p.loop_t0 is not None else 0.0
        return {"tokens_seen": self.p.step * self.tokens_per_step, "device_s": self.prior.get("device_s", 0.0)
                + loop_s, "calls": self.prior.get("calls", 0) + 1, "last_bpb": self.p.last_bpb,
                "last_eval_step": self.p.last_eval_step}

    def _save(self) -> None:
        t = time.perf_counter()
        path = checkpointing.save(self.opts.out, self.p.step, self.state, self.record())
        self.p.save_s = time.perf_counter() - t
        self.p.saved_step = self.p.step
        self.rep.say(f"saved step {self.p.step} to {path} ({_mb(checkpointing.dir_bytes(path))}) in "
                     f"{self.p.save_s:.1f} s")


def run_identity(rc: step.RunConfig) -> dict:
    """The RunConfig as the checkpoint record holds it (a JSON round trip, so comparisons see JSON values)."""
    return json.loads(json.dumps(rc.to_json()))


# ---- export -----------------------------------------------------------------------------------------
def export_and_check(export_dir: Path, rc: step.RunConfig, state: dict, tok, rep: Reporter) -> str:
    """export.export the state with the tokenizer, reload it with lingjax.load and print the greedy completion
    of SMOKE_PROMPT; -> the completion's text."""
    import lingjax
    from lingjax.train import export

    t = time.perf_counter()
    files = export.export(export_dir, state["params"], state["biases"], model_config.config_dict(rc.config),
                          tokenizer=tok)
    rep.say(f"export: {len(files)} files ({_mb(checkpointing.dir_bytes(export_dir))}) to {export_dir} in "
            f"{_since(t)}")
    t = time.perf_counter()
    model = lingjax.load(export_dir)
    result = lingjax.generate(model, SMOKE_PROMPT, SMOKE_TOKENS)
    rep.say(f"smoke: lingjax.load({str(export_dir)!r}) greedy {SMOKE_PROMPT!r} -> {result.text!r} "
            f"({len(result.tokens)} tokens, {_since(t)})")
    return result.text


def _exported(path: Path) -> bool:
    from lingjax.checkpoint import INDEX_FILE

    return (path / INDEX_FILE).exists()


# ---- the command ------------------------------------------------------------------------------------
def _restore(opts: Options, found, rep: Reporter) -> tuple[int, dict, dict]:
    """The newest checkpoint, its run identity checked before any data work. -> (step, state, record)."""
    _, path = found
    record = checkpointing.read_record(path)
    checkpointing.check_identity(record, {"run": run_identity(opts.rc), "data": record.get("data", {})}, path)
    t = time.perf_counter()
    restored_step, state, record = checkpointing.restore(opts.out, step.abstract_state(opts.rc))
    rep.say(f"resume: step {restored_step} from {path} in {_since(t)}")
    return restored_step, state, record


def run(opts: Options, t0: float) -> int:
    """One call of the command (module docstring) on parsed options; t0: when the call started (the time
    limit counts from it). -> exit status 0; RunError or CheckpointMismatch for the one-line errors."""
    run_dir = opts.out
    run_dir.mkdir(parents=True, exist_ok=True)
    rep = Reporter(run_dir, t0)
    rc = opts.rc
    rep.say(f"run {run_dir}: config {rc.config}, batch {rc.batch} x {rc.seq_len}, {rc.optim.total_steps} steps, "
            f"lr {rc.optim.lr} (warm-up {rc.optim.warmup_steps})")
    found = checkpointing.latest(run_dir)
    if found is not None:
        start, state, record = _restore(opts, found, rep)
    else:
        start, state, record = 0, None, {}
    total = rc.optim.total_steps
    prior = record.get("progress", {})
    export_dir = opts.export or (run_dir / EXPORT_DIR)
    if start >= total:  # nothing to train: export if asked or not done yet, then the summary
        rep.say(f"the run is at its final step {start}")
        tok = bpe.load_tokenizer(run_dir / TOKENIZER_DIR)
        completion = None
        if opts.export is not None or not _exported(export_dir):
            completion = export_and_check(export_dir, rc, state, tok, rep)
        lzma = json.loads((run_dir / LZMA_FILE).read_text())["lzma_bpb"] if (run_dir / LZMA_FILE).exists() else None
        return _summary(rep, rc, start, 0, prior, None, prior.get("last_bpb"), lzma, "final_step",
                        export_dir if completion is not None else None, completion)
    run_data = prepare_data(opts, rep)
    if found is not None:  # the data part of the identity, now that the streams exist
        checkpointing.check_identity(record, {"run": run_identity(rc), "data": {"fingerprint": run_data.fingerprint}},
                                     found[1])
    else:
        t = time.perf_counter()
        state = step.init_state(rc)
        rep.say(f"init: fresh state ({_mb(optim.tree_bytes(state))} resume state) in {_since(t)}")
    trainer = Trainer(opts, run_data, state, start, found is not None, prior, rep)
    reason = trainer.run()
    p = trainer.p
    rep.say(f"stopped at step {p.step} ({reason}): {p.steps_done} steps this call in {p.loop_s:.1f} s")
    completion = None
    if opts.export is not None or p.step >= total:
        completion = export_and_check(export_dir, rc, trainer.state, run_data.tokenizer, rep)
    rate = p.steady_steps * trainer.tokens_per_step / p.steady_s if p.steady_s > 0 else None
    return _summary(rep, rc, p.step, p.steps_done, trainer.progress(), rate, p.last_bpb, run_data.lzma_bpb, reason,
                    export_dir if completion is not None else None, completion)


def _summary(rep, rc, at, steps_done, progress, rate, bpb, lzma_bpb, reason, export_dir, completion) -> int:
    """The call's last line, one JSON object (also a "summary" event in log.jsonl). -> exit status 0."""
    summary = {"step": at, "total_steps": rc.optim.total_steps, "steps_this_call": steps_done,
               "tokens_seen": at * rc.batch * rc.seq_len, "device_s": round(progress.get("device_s", 0.0), 3),
               "tokens_per_s": rate, "bpb": bpb, "lzma_bpb": lzma_bpb, "stopped": reason,
               "export": str(export_dir) if export_dir is not None else None, "completion": completion}
    rep.event("summary", **summary)
    print(json.dumps(summary), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command (module docstring); -> exit status: 0, or 2 after one `lingjax.train: error:` line."""
    t0 = time.perf_counter()
    try:
        opts = parse_args(argv)
        from lingjax import compilation_cache

        compilation_cache.enable(os.environ.get("JAX_COMPILATION_CACHE_DIR") or None)
        return run(opts, t0)
    except (RunError, CheckpointMismatch) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
