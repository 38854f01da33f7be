"""lingjax.train's data side: corpus collection and split, the manifest, the byte-level BPE tokenizer and
its HF files, the packed stream, training batches, evaluation windows and the lzma baseline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import jinja2.sandbox
import numpy as np
import pytest
import tokenizers

from conftest import SALT
from lingjax.train import bpe, corpus, data
from lingjax.train.corpus import SourceFile

SPECIALS = bpe.SPECIAL_TOKENS


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([SALT, *key])


def _code(rng: np.random.Generator, lines: int = 30) -> str:
    """A fresh Python-looking text: random identifiers, indentation and literals."""
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz_"), size=rng.integers(2, 9))) for _ in range(12)]
    out = []
    for i in range(lines):
        indent = "    " * int(rng.integers(0, 3))
        a, b, c = rng.choice(words, size=3)
        out.append(f"{indent}{a}_{i} = {b}({c}, {int(rng.integers(0, 10_000))})  # {c}")
    return "def f():\n" + "\n".join(out) + "\n"


def _write(path: Path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))


@pytest.fixture
def tree(tmp_path):
    """A fake stdlib and site-packages. Returns (roots, the held-out texts by name, the decoder text)."""
    rng = _rng(1)
    std, site = tmp_path / "lib", tmp_path / "site"
    decoder = _code(rng, 40)
    texts = {
        std / "json/__init__.py": _code(rng),
        std / "json/decoder.py": decoder,
        std / "tomllib.py": _code(rng),  # a held-out module file
        std / "jsonx/a.py": _code(rng),  # "json" as a prefix only: train
        std / "os.py": _code(rng),
        std / "dup_b.py": (dup := _code(rng)),
        std / "dup_a.py": dup,  # sorts first: the copy kept
        std / "json/__pycache__/c.py": _code(rng),
        std / "site-packages/base.py": _code(rng),  # the base interpreter's packages: skipped
        std / "notes.txt": _code(rng),
        site / "vendored/json_decoder.py": decoder,  # exact copy of a held-out file
        site / "near/decoder.py": decoder.replace("def f", "def g").replace("= ", "=  ", 3),  # near copy
        site / "crlf.py": "x = 1\r\ny = '\u00e9\U0001f642'\r\n",
        site / "empty.py": "",
        site / "blank.py": "  \n\t\n",
        site / "big.py": "x = 1\n" * 1000,
        site / "pkg/mod.py": _code(rng),
    }
    for path, text in texts.items():
        _write(path, text)
    _write(site / "latin1.py", b"s = '\xe9\xff'\n")  # not UTF-8
    os.symlink(std / "json", site / "linked_json", target_is_directory=True)  # not followed
    return {"stdlib": std, "site-packages": site}, decoder


def _collect(roots, **kw):
    return corpus.collect(roots, max_file_bytes=5000, held_out_packages=("json", "tomllib"), **kw)


def test_collect_splits_dedups_and_skips(tree):
    roots, decoder = tree
    calls = []
    c = _collect(roots, progress=lambda done, total: calls.append((done, total)))
    assert [f.name for f in c.held_out] == ["stdlib/json/__init__.py", "stdlib/json/decoder.py", "stdlib/tomllib.py"]
    assert [f.name for f in c.train] == [
        "site-packages/crlf.py", "site-packages/pkg/mod.py", "stdlib/dup_a.py", "stdlib/jsonx/a.py", "stdlib/os.py"
    ]
    assert c.skipped == {"duplicate": 1, "empty": 2, "held_out_copy": 1, "held_out_near_copy": 1,
                         "not_utf8": 1, "too_large": 1}
    assert calls[-1][0] == calls[-1][1] == len(calls) == 15  # every *.py candidate, read once
    crlf = c.train[0]
    assert crlf.text == "x = 1\r\ny = '\u00e9\U0001f642'\r\n"  # bytes as stored, no newline translation
    assert crlf.num_bytes == len(crlf.text.encode()) and crlf.sha256 == corpus.sha256_hex(crlf.text.encode())
    assert c.held_out[1].text == decoder
    assert c.train_bytes == sum(f.num_bytes for f in c.train) and c.total_bytes == c.train_bytes + c.held_out_bytes
    without = _collect(roots, near_copy_fraction=None)
    assert [f.name for f in without.train] == ["site-packages/crlf.py", "site-packages/near/decoder.py",
                                               *[f.name for f in c.train[1:]]]


def test_collect_is_deterministic(tree):
    roots, _ = tree
    a = _collect(roots)
    b = _collect(dict(reversed(list(roots.items()))))
    assert a == b
    assert {f.sha256 for f in a.train}.isdisjoint({f.sha256 for f in a.held_out})
    assert len({f.sha256 for f in a.train}) == len(a.train)


def test_is_held_out():
    pk = ("json", "http")
    assert corpus.is_held_out("stdlib/json/decoder.py", pk) and corpus.is_held_out("stdlib/http/server.py", pk)
    assert not corpus.is_held_out("stdlib/jsonx.py", pk) and not corpus.is_held_out("stdlib/test/test_json/a.py", pk)
    assert not corpus.is_held_out("site-packages/json/decoder.py", pk)
    assert corpus.is_held_out("stdlib/json.py", pk)


def test_default_roots_exist_and_are_distinct():
    roots = corpus.default_roots()
    assert {"stdlib", "site-packages"} <= set(roots)
    assert all(p.is_dir() for p in roots.values())
    assert len({p.resolve() for p in roots.values()}) == len(roots)
    assert all((roots["stdlib"] / p).exists() for p in ("json", "email", "asyncio", "tomllib", "urllib", "http"))


def test_manifest_round_trip(tree, tmp_path):
    roots, _ = tree
    c = _collect(roots)
    path, again = tmp_path / "m.jsonl", tmp_path / "m2.jsonl"
    extra = {"python": "3.12", "roots": roots}
    corpus.write_manifest(c, path, extra=extra)
    corpus.write_manifest(_collect(roots), again, extra=extra)
    assert path.read_bytes() == again.read_bytes()
    m = corpus.read_manifest(path)
    for split in ("train", "held_out"):
        files = getattr(c, split)
        assert m[split] == [{"name": f.name, "sha256": f.sha256[:16], "bytes": f.num_bytes} for f in files]
        assert m["totals"][split] == {"files": len(files), "bytes": sum(f.num_bytes for f in files)}
    assert m["extra"]["roots"]["stdlib"] == str(roots["stdlib"]) and m["skipped"] == c.skipped
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 2 + len(c.train) + len(c.held_out) and max(map(len, lines[1:])) < 120
    lines[-1] = lines[-1].replace(f",{c.train[-1].num_bytes}]", f",{c.train[-1].num_bytes + 1}]")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="totals"):
        corpus.read_manifest(path)


# --- tokenizer ---------------------------------------------------------------------------------------

def _sample_texts() -> list[str]:
    """Real Python source from the running stdlib, plus fresh generated code."""
    import json as json_pkg
    import string
    import textwrap
    paths = [Path(m.__file__) for m in (textwrap, string)] + sorted(Path(json_pkg.__file__).parent.glob("*.py"))
    rng = _rng(2)
    return [p.read_text(encoding="utf-8") for p in paths] + [_code(rng) for _ in range(20)]


@pytest.fixture(scope="module")
def tok():
    return bpe.train_tokenizer(_sample_texts(), 400)


def _random_unicode(rng: np.random.Generator, n: int) -> str:
    """n code points from ASCII (controls and NUL included), Latin-1, Greek, CJK, emoji and the astral
    planes, with whitespace runs, \\r\\n and the special-token strings mixed in."""
    ranges = [(0, 0x80), (0x80, 0x250), (0x370, 0x400), (0x4E00, 0x4F00), (0x1F300, 0x1F650), (0x10000, 0x10FFFF)]
    pieces = []
    for _ in range(n):
        r = rng.integers(0, len(ranges) + 2)
        if r == len(ranges):
            pieces.append(str(rng.choice(["\r\n", "\t\t", "    ", "\n\n    ", " \u00a0", "\0", *SPECIALS])))
        else:
            lo, hi = ranges[min(r, len(ranges) - 1)]
            cp = int(rng.integers(lo, hi))
            pieces.append(chr(cp) if not 0xD800 <= cp < 0xE000 else "?")
    return "".join(pieces)


def test_tokenizer_vocab_and_special_ids(tok):
    assert tok.get_vocab_size(with_added_tokens=True) == 400
    assert len(tok.get_vocab(with_added_tokens=True)) == 400
    for i, t in enumerate(SPECIALS):
        assert tok.token_to_id(t) == i and tok.encode(t).ids == [i]
    assert bpe.EOS_ID == 0 and bpe.EOS == SPECIALS[0]
    assert tok.encode("a<|role_end|>b").ids[1] == 1


def test_tokenizer_round_trips(tok):
    rng = _rng(3)
    texts = [_random_unicode(rng, int(rng.integers(1, 400))) for _ in range(200)]
    texts += _sample_texts()[:3] + ["", "\0", "\r\n", "\t", " ", "  x", "\U0001f642\U0001f642", "e\u0301"]
    texts.append(bytes(rng.integers(0, 256, 3000, dtype=np.uint8)).decode("latin-1"))
    for s in texts:
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s
    encs = tok.encode_batch(texts)
    assert [tok.decode(e.ids, skip_special_tokens=False) for e in encs] == texts


def test_tokenizer_compresses_code_and_splits_indentation(tok):
    text = _sample_texts()[0]
    assert len(text.encode()) / len(tok.encode(text).ids) > 1.8  # 136 merges: about 1.95 bytes a token
    pieces = [p for p, _ in bpe.new_tokenizer().pre_tokenizer.pre_tokenize_str("x):\n        return y")]
    assert pieces == ["x", "):", "Ċ" + "Ġ" * 8, "return", "Ġy"]


def test_tokenizer_needs_enough_text():
    with pytest.raises(ValueError, match="fill only"):
        bpe.train_tokenizer(["ab ab ab"], 400)
    with pytest.raises(ValueError):
        bpe.train_tokenizer(["x"], 100)


def _chat_env(sandboxed: bool) -> jinja2.Environment:
    if sandboxed:  # as transformers renders a chat template
        return jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return jinja2.Environment()


def test_saved_files_reload_and_chat_template_renders(tok, tmp_path):
    bpe.save_tokenizer_files(tok, tmp_path, model_max_length=2048)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                           "tokenizer_config.json"]
    raw = (tmp_path / "tokenizer.json").read_text()
    assert raw.count("\n") <= 1  # compact
    again = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    s = _sample_texts()[1] + "\r\n\U0001f642<role>"
    assert again.encode(s).ids == tok.encode(s).ids == bpe.load_tokenizer(tmp_path).encode(s).ids
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["model_max_length"] == 2048
    assert cfg["eos_token"] == cfg["pad_token"] == "<|endoftext|>" and cfg["bos_token"] is None
    assert cfg["add_bos_token"] is False and cfg["clean_up_tokenization_spaces"] is False
    assert {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()} == dict(enumerate(SPECIALS))
    assert all(v["special"] and not v["normalized"] for v in cfg["added_tokens_decoder"].values())
    stm = json.loads((tmp_path / "special_tokens_map.json").read_text())
    assert stm["eos_token"] == "<|endoftext|>" and len(stm["additional_special_tokens"]) == 7

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi\n"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
    want = ("<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>hi\n<|role_end|>"
            "<role>ASSISTANT</role>hello<|role_end|><role>HUMAN</role>2+2?<|role_end|><role>ASSISTANT</role>")
    off = "<role>SYSTEM</role>detailed thinking off<|role_end|>"
    for sandboxed in (False, True):
        tpl = _chat_env(sandboxed).from_string(cfg["chat_template"])
        assert tpl.render(messages=msgs, add_generation_prompt=True) == want
        assert tpl.render(messages=msgs, add_generation_prompt=False) == want.removesuffix("<role>ASSISTANT</role>")
        assert tpl.render(messages=msgs, add_generation_prompt=True, enable_thinking=False) == want
        assert tpl.render(messages=msgs[1:2], add_generation_prompt=True, enable_thinking=False) == (
            off + "<role>HUMAN</role>hi\n<|role_end|><role>ASSISTANT</role>")
        assert tpl.render(messages=msgs[1:2], enable_thinking=True) == "<role>HUMAN</role>hi\n<|role_end|>"
    ids = tok.encode(want).ids
    assert ids[0] == 2 and ids.count(3) == 5 and ids.count(1) == 4  # <role>, </role>, <|role_end|>


# --- stream, batches, windows ------------------------------------------------------------------------

def test_encode_files_stream(tok):
    rng = _rng(4)
    files = [SourceFile.from_text(f"t/{i}.py", _code(rng, 5) + ("<|endoftext|> <role>" if i % 3 == 0 else ""))
             for i in range(11)]
    stream = data.encode_files(tok, files, batch=4)
    t = stream.tokens
    assert t.dtype == np.uint16 and len(stream) == len(t) and np.asarray(stream) is t
    assert stream.num_files == 11 and stream.num_bytes == sum(f.num_bytes for f in files)
    assert stream.num_bytes == len(data.held_out_bytes(files))
    ends = np.flatnonzero(t == bpe.EOS_ID)
    assert len(ends) == 11 and ends[-1] == len(t) - 1  # special strings in a text stay text
    segments = np.split(t, ends + 1)[:-1]
    assert [tok.decode(s[:-1].tolist(), skip_special_tokens=False) for s in segments] == [f.text for f in files]
    assert tok.encode("<role>").ids == [2]  # the tokenizer is left as it was


def test_shuffled_files_is_a_deterministic_permutation():
    rng = _rng(5)
    files = [SourceFile.from_text(f"p/{i}.py", f"x = {rng.integers(1 << 40)}\n") for i in range(60)]
    a = data.shuffled_files(files, seed=7)
    assert sorted(f.name for f in a) == sorted(f.name for f in files) and a != files
    assert data.shuffled_files(files[::-1], seed=7) == a
    assert data.shuffled_files(files, seed=8) != a


@pytest.mark.parametrize("n, seq_len, batch_size", [(5000, 64, 8), (66, 64, 4), (300, 7, 16)])
def test_packed_batches(n, seq_len, batch_size):
    rng = _rng(6, n)
    tokens = rng.integers(0, 65536, n, dtype=np.uint16)
    seed = int(rng.integers(1 << 30))
    pb = data.PackedBatches(tokens, batch_size, seq_len, seed)
    w = seq_len + 2
    for step in (0, 1, 12345):
        x = pb.batch(step)
        assert x.shape == (batch_size, w) and x.dtype == np.int32
        starts = pb.starts(step)
        assert starts.min() >= 0 and starts.max() <= n - w
        assert all((x[r] == tokens[s : s + w]).all() for r, s in enumerate(starts))
        again = data.PackedBatches(data.TokenStream(tokens.copy(), 0, 0), batch_size, seq_len, seed)
        assert (again.batch(step) == x).all()
    if pb.num_starts ** batch_size > 1e12:  # two steps could only coincide on an absurd draw
        assert not (pb.batch(0) == pb.batch(1)).all()
        assert not (data.PackedBatches(tokens, batch_size, seq_len, seed + 1).batch(0) == pb.batch(0)).all()
    with pytest.raises(ValueError):
        data.PackedBatches(tokens[: w - 1], batch_size, seq_len, seed)
    with pytest.raises(ValueError):
        pb.batch(-1)


def test_packed_batches_at_the_exact_length():
    tokens = np.arange(10, dtype=np.uint16)
    x = data.PackedBatches(tokens, 3, 8, seed=0).batch(5)
    assert (x == np.arange(10)).all()


@pytest.mark.parametrize("n, seq_len", [(1, 4), (4, 4), (5, 4), (1000, 64), (1023, 1024), (1024, 1024), (2049, 1024)])
def test_eval_windows_score_every_token_once(n, seq_len):
    tokens = _rng(7, n).integers(1, 65536, n, dtype=np.uint16)
    ev = data.eval_windows(tokens, seq_len)
    assert ev.windows.dtype == np.int32 and ev.windows.shape[1] == seq_len + 1 and ev.mask.shape[1] == seq_len
    assert len(ev.windows) == -(-n // seq_len) and ev.num_targets == n
    assert (ev.windows[:, 1:][ev.mask] == tokens).all()
    assert ev.windows[0, 0] == bpe.EOS_ID
    assert (ev.windows[1:, 0] == ev.windows[:-1, -1]).all()  # the last target of a window is the next's first input
    assert (ev.windows[:, 1:][~ev.mask] == bpe.EOS_ID).all() and ev.mask[:-1].all()
    if n > 1:
        bare = data.eval_windows(tokens, seq_len, start_id=None)
        assert bare.num_targets == n - 1 and (bare.windows[:, 1:][bare.mask] == tokens[1:]).all()


def test_lzma_bits_per_byte_and_held_out_bytes():
    rng = _rng(8)
    files = [SourceFile.from_text(f"h/{i}.py", _code(rng, 60)) for i in range(5)]
    joined = data.held_out_bytes(files)
    assert joined == "".join(f.text for f in files).encode()
    bpb = data.lzma_bits_per_byte(joined)
    assert 0 < bpb < 4
    assert data.lzma_bits_per_byte(bytes(rng.integers(0, 256, 20_000, dtype=np.uint8))) > 7.5
    assert data.bits_per_byte(8 * np.log(2) * 100, 100) == pytest.approx(8.0)


def test_package_import_is_light():
    code = "import sys, lingjax.train; assert not {'numpy', 'tokenizers', 'jax'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)
