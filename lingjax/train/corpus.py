"""The training corpus: every *.py file of this interpreter's stdlib and site-packages, deduplicated by
content and split into train and a held-out set of whole stdlib packages (docs/corpus.md).

    corpus = collect()                     # default_roots() of the running interpreter
    corpus.train, corpus.held_out          # list[SourceFile], sorted by name
    write_manifest(corpus, Path("corpus.jsonl"), extra={"python": sys.version})

Everything is deterministic for a given set of files: candidates are read in sorted-name order, the first
copy of a content wins, and both splits come back sorted by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

# Whole packages present in every CPython 3.12, held out from training: a parser (json, tomllib), a
# large asyncio framework, protocol and MIME code (email, http, urllib) and markup handling (xml). About
# 1.6 MB of source in all (docs/corpus.md has the measured size).
HELD_OUT_PACKAGES: tuple[str, ...] = ("json", "email", "asyncio", "tomllib", "urllib", "http", "xml")

STDLIB = "stdlib"  # the root label whose packages can be held out
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})  # below a root, never the root
NEAR_COPY_MIN_LINE = 16  # characters of a stripped line for it to count in the near-copy test
NEAR_COPY_MIN_LINES = 4  # distinct counted lines a file needs before the near-copy test applies
MANIFEST_FORMAT = "lingjax.train.corpus.manifest/1"
MANIFEST_HASH_CHARS = 16  # hex digits of sha256 kept per row of a manifest
_COMPACT = (",", ":")


@dataclass(frozen=True)
class SourceFile:
    """One source file. name: "<root label>/<relative posix path>", e.g. "stdlib/json/decoder.py";
    sha256: hex digest of the UTF-8 bytes of text; text: the file's content, exactly as stored (no
    newline translation)."""

    name: str
    sha256: str
    text: str

    @classmethod
    def from_text(cls, name: str, text: str) -> SourceFile:
        return cls(name, sha256_hex(text.encode("utf-8")), text)

    @cached_property
    def num_bytes(self) -> int:
        """Length of the UTF-8 encoding of text."""
        return len(self.text.encode("utf-8"))


@dataclass
class Corpus:
    """train and held_out: disjoint by name and by content, each sorted by name. skipped: counts of the
    candidates left out, by reason ("not_utf8", "empty", "too_large", "duplicate", "held_out_copy",
    "held_out_near_copy", "unreadable")."""

    train: list[SourceFile]
    held_out: list[SourceFile]
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def train_bytes(self) -> int:
        return sum(f.num_bytes for f in self.train)

    @property
    def held_out_bytes(self) -> int:
        return sum(f.num_bytes for f in self.held_out)

    @property
    def total_bytes(self) -> int:
        return self.train_bytes + self.held_out_bytes


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def default_roots() -> dict[str, Path]:
    """{"stdlib": ..., "site-packages": purelib, "platlib": platlib} of the running interpreter; a root
    that is missing, or the same directory as an earlier one, is left out."""
    paths = sysconfig.get_paths()
    candidates = [(STDLIB, paths["stdlib"]), ("site-packages", paths["purelib"]), ("platlib", paths["platlib"])]
    roots: dict[str, Path] = {}
    seen: set[Path] = set()
    for label, raw in candidates:
        path = Path(raw)
        if not path.is_dir() or path.resolve() in seen:
            continue
        seen.add(path.resolve())
        roots[label] = path
    return roots


def is_held_out(name: str, packages: Sequence[str] = HELD_OUT_PACKAGES) -> bool:
    """Whether name is "stdlib/<pkg>.py" or under "stdlib/<pkg>/" for a pkg in packages."""
    label, _, rel = name.partition("/")
    if label != STDLIB:
        return False
    head, sep, _ = rel.partition("/")
    return (head in packages) if sep else rel.removesuffix(".py") in packages


def _walk_root(label: str, root: Path, other_roots: set[Path]) -> list[tuple[str, Path]]:
    """(name, path) of every *.py file under root. Symlinked directories are not followed; __pycache__,
    nested site-packages/dist-packages and directories that are themselves other roots are skipped."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and (here / d).resolve() not in other_roots]
        for fname in filenames:
            path = here / fname
            if fname.endswith(".py") and path.is_file():
                rel = path.relative_to(root).as_posix()
                found.append((f"{label}/{rel}", path))
    return found


def _read_text(path: Path, max_file_bytes: int) -> tuple[str | None, str | None]:
    """(text, None) for a usable file, else (None, reason)."""
    try:
        if path.stat().st_size > max_file_bytes:
            return None, "too_large"
        data = path.read_bytes()
    except OSError:
        return None, "unreadable"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    if not text.strip():
        return None, "empty"
    return text, None


def _candidates(roots: Mapping[str, Path]) -> list[tuple[str, Path]]:
    resolved = {label: Path(p).resolve() for label, p in roots.items() if Path(p).is_dir()}
    found: list[tuple[str, Path]] = []
    for label, root in resolved.items():
        others = {r for lab, r in resolved.items() if lab != label}
        found += _walk_root(label, root, others)
    found = [(n, p) for n, p in found if n.isprintable()]  # names go into JSON and display paths
    return sorted(found)


def collect(
    roots: Mapping[str, Path] | None = None,
    *,
    max_file_bytes: int = 512_000,
    held_out_packages: Sequence[str] = HELD_OUT_PACKAGES,
    progress: Callable[[int, int], None] | None = None,
    near_copy_fraction: float | None = 0.5,
) -> Corpus:
    """Every *.py file under roots ({label: directory}, default_roots() when None), split into train and
    held-out. A file is skipped when it is not valid UTF-8, empty or whitespace-only, or larger than
    max_file_bytes. Held-out: "stdlib/<pkg>/..." or "stdlib/<pkg>.py" for pkg in held_out_packages.
    Dedup by exact content (sha256), the first copy in sorted-name order kept, within each split; a train
    file with the content of a held-out file is dropped, so vendored copies do not leak, and so is a
    near copy (a vendored file with edited imports): one where at least near_copy_fraction of its
    distinct stripped lines of NEAR_COPY_MIN_LINE+ characters occur in held-out files (None: no such
    test). progress(done, total) is called after each candidate is read."""
    files = _candidates(default_roots() if roots is None else roots)
    skipped: dict[str, int] = {}
    held: list[SourceFile] = []
    train: list[SourceFile] = []
    for i, (name, path) in enumerate(files):
        text, reason = _read_text(path, max_file_bytes)
        if text is None:
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            (held if is_held_out(name, held_out_packages) else train).append(SourceFile.from_text(name, text))
        if progress is not None:
            progress(i + 1, len(files))
    held = _dedup(held, set(), skipped, "duplicate")
    held_hashes = {f.sha256 for f in held}
    train = _dedup(train, held_hashes, skipped, "held_out_copy")
    if near_copy_fraction is not None:
        train = _drop_near_copies(train, held, near_copy_fraction, skipped)
    return Corpus(train=train, held_out=held, skipped=dict(sorted(skipped.items())))


def _dedup(files: list[SourceFile], banned: set[str], skipped: dict[str, int], banned_reason: str) -> list[SourceFile]:
    """files (in sorted-name order) without the later copies of a content and without contents in banned."""
    seen: set[str] = set()
    kept: list[SourceFile] = []
    for f in files:
        reason = banned_reason if f.sha256 in banned else "duplicate" if f.sha256 in seen else None
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        seen.add(f.sha256)
        kept.append(f)
    return kept


def _long_lines(text: str) -> set[str]:
    return {s for line in text.splitlines() if len(s := line.strip()) >= NEAR_COPY_MIN_LINE}


def _drop_near_copies(
    train: list[SourceFile], held: list[SourceFile], fraction: float, skipped: dict[str, int]
) -> list[SourceFile]:
    """train without the files most of whose long lines occur in held (see collect)."""
    held_lines: set[str] = set().union(*(_long_lines(f.text) for f in held))
    kept: list[SourceFile] = []
    for f in train:
        lines = _long_lines(f.text)
        if len(lines) >= NEAR_COPY_MIN_LINES and len(lines & held_lines) >= fraction * len(lines):
            skipped["held_out_near_copy"] = skipped.get("held_out_near_copy", 0) + 1
        else:
            kept.append(f)
    return kept


def _rows(files: Sequence[SourceFile]) -> list[str]:
    return [json.dumps([f.name, f.sha256[:MANIFEST_HASH_CHARS], f.num_bytes], separators=_COMPACT) for f in files]


def write_manifest(corpus: Corpus, path: Path, extra: dict | None = None) -> None:
    """A JSONL manifest of corpus: a header object (format, totals per split, skipped counts, extra),
    then for each split, "held_out" first, a {"split": ...} line followed by one
    ["name", "first 16 hex of sha256", bytes] row per file in name order. Deterministic: the same corpus
    and extra give the same bytes. extra must be JSON-serialisable (Paths are written as strings)."""
    splits = {"held_out": corpus.held_out, "train": corpus.train}
    header = {
        "format": MANIFEST_FORMAT,
        "sha256_hex_chars": MANIFEST_HASH_CHARS,
        "totals": {k: {"files": len(v), "bytes": sum(f.num_bytes for f in v)} for k, v in splits.items()},
        "skipped": corpus.skipped,
        "extra": extra or {},
    }
    lines = [json.dumps(header, sort_keys=True, separators=_COMPACT, default=str)]
    for split, files in splits.items():
        lines.append(json.dumps({"split": split}, separators=_COMPACT))
        lines += _rows(files)
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_manifest(path: Path) -> dict:
    """The header of a manifest written by write_manifest, plus "held_out" and "train": lists of
    {"name", "sha256" (the stored prefix), "bytes"}. Raises ValueError when the rows disagree with the
    header's totals."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    manifest = json.loads(lines[0])
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    split = None
    for line in lines[1:]:
        row = json.loads(line)
        if isinstance(row, dict):
            split = row["split"]
            manifest[split] = []
        else:
            name, sha, size = row
            manifest[split].append({"name": name, "sha256": sha, "bytes": size})
    for split, total in manifest["totals"].items():
        rows = manifest.get(split, [])
        if total != {"files": len(rows), "bytes": sum(r["bytes"] for r in rows)}:
            raise ValueError(f"{path}: the {split} rows do not add up to the header's totals")
    return manifest
