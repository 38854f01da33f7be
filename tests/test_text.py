"""Text in and out: the checkpoint's tokenizer (official Ling-3 layout), the presets' byte-level tokenizer,
streaming detokenization, chat templates, and the text side of the Python API."""

import json

import numpy as np
import pytest

import lingjax
from conftest import FIXTURES, SALT
from lingjax.chat_template import ChatError, render
from lingjax.config import LingConfig, preset
from lingjax.detokenize import TextStream
from lingjax.tokenizer import Tokenizer, TokenizerError

TEXTS = ["def add(a, b):\n    return a + b\n", "naïve café: Übergröße", "日本語のテキスト 🙂🚀 mixed\twith tabs",
         "a<|role_end|>b", " leading and trailing spaces  "]


def _cfg(d):
    return LingConfig.from_file(d / "config.json")


def test_ling_layout_round_trip_and_stops(ling_dir):
    d, ids = ling_dir
    tok = Tokenizer.from_dir(d, _cfg(d))
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode("a<|role_end|>b")) == "ab"  # specials are one id each, left out of text
    assert tok.encode("<|role_end|>") == [ids["<|role_end|>"]]
    assert tok.stop_ids == {ids["<|endoftext|>"], ids["<|role_end|>"]}
    assert tok.special_tokens["eos_token"] == "<|endoftext|>" and tok.chat_template is not None


def test_special_token_precedence(ling_dir):
    """tokenizer_config.json names the EOS token before special_tokens_map.json, which comes before the
    generation config's id, which comes before config.json's."""
    d, ids = ling_dir
    cfg = _cfg(d)
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</role>"}))
    assert Tokenizer.from_dir(d, cfg).special_tokens["eos_token"] == "<|endoftext|>"
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    del tok_cfg["eos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    assert Tokenizer.from_dir(d, cfg).special_tokens["eos_token"] == "</role>"
    (d / "special_tokens_map.json").unlink()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<role>"]}))
    tok = Tokenizer.from_dir(d, cfg)
    assert tok.special_tokens["eos_token"] == "<role>" and tok.stop_ids == {ids["<role>"]}
    (d / "generation_config.json").unlink()
    tok = Tokenizer.from_dir(d, cfg)
    assert tok.stop_ids == set(cfg.eos_token_ids)


def test_tokenizer_errors(ling_dir, tmp_path):
    d, _ = ling_dir
    small = LingConfig.from_hf({**json.loads((d / "config.json").read_text()), "vocab_size": 300})
    with pytest.raises(TokenizerError, match="past the model's vocabulary of 300"):
        Tokenizer.from_dir(d, small)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(d, _cfg(d))
    assert Tokenizer.from_dir(tmp_path, _cfg(d)) is None  # no tokenizer.json: ids only


def test_byte_level_preset_tokenizer():
    cfg = preset("tiny")
    tok = Tokenizer.byte_level(cfg)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("é") == list("é".encode())
    assert tok.stop_ids == set(cfg.eos_token_ids) and tok.decode(sorted(cfg.eos_token_ids)) == ""
    assert all(len(tok.decode([i])) <= 1 for i in range(cfg.vocab_size))  # every id a model draws has a text


def _stream_check(tok, ids, rng):
    """Push ids in random bursts; after each push the printed text is a prefix of decode(everything pushed),
    short of it only by replacement characters (bytes of a character still incomplete); at the end they are
    equal."""
    stream = TextStream(tok)
    printed, i = "", 0
    while i < len(ids):
        n = int(rng.integers(1, 4))
        printed += stream.push(ids[i:i + n])
        i += n
        full = tok.decode(ids[:i])
        assert full.startswith(printed), (printed, full)
        held = full[len(printed):]
        assert set(held) <= {"\ufffd"}, (held, full)  # only an incomplete character is held back
    printed += stream.flush()
    assert printed == tok.decode(ids) == stream.text


@pytest.mark.parametrize("case", range(4))
def test_streaming_is_exact_with_merges_and_split_characters(ling_dir, case):
    d, _ = ling_dir
    tok = Tokenizer.from_dir(d, _cfg(d))
    rng = np.random.default_rng([SALT, case])
    text = "".join(rng.choice(TEXTS, 6))
    _stream_check(tok, tok.encode(text), rng)
    # byte-level tokens: a multi-byte character split over tokens prints only once it is whole
    _stream_check(tok, [tok.token_id(b) for b in ("Ã", "©", "æ", "Ĺ", "¥")], rng)  # "é" "日" in byte symbols


@pytest.mark.parametrize("case", range(3))
def test_streaming_byte_fallback_tokens(case):
    """The presets' tokenizer emits one token per byte: 2-4 byte characters arrive split across tokens."""
    tok = Tokenizer.byte_level(preset("tiny"))
    rng = np.random.default_rng([SALT, 100 + case])
    text = "".join(rng.choice(TEXTS, 5))
    _stream_check(tok, tok.encode(text), rng)
    _stream_check(tok, rng.integers(0, 512, 64).tolist(), rng)  # random ids: invalid UTF-8 too


def test_chat_template_renders_like_hf(ling_dir):
    d, _ = ling_dir
    tok = Tokenizer.from_dir(d, _cfg(d))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "ça va?"}]
    text = render(tok.chat_template, messages, special_tokens=tok.special_tokens)
    assert text == ("<role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role>hello<|role_end|>"
                    "<role>HUMAN</role>ça va?<|role_end|><role>ASSISTANT</role>")
    off = render(tok.chat_template, messages[:1], add_generation_prompt=False, enable_thinking=False)
    assert off == "<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>hi<|role_end|>"
    with pytest.raises(ChatError, match="role must be one of system, user, assistant, tool, got .robot."):
        render(tok.chat_template, [{"role": "robot", "content": "x"}])
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": 3}], "hi"):
        with pytest.raises(ChatError):
            render(tok.chat_template, bad)


def test_generate_and_chat_return_text(ling_dir):
    d, ids = ling_dir
    model = lingjax.load(d, dtype="float32")
    tok = model.tokenizer
    result = lingjax.generate(model, "def add(a, b):", 12, ignore_eos=True)
    assert result.text == tok.decode(result.tokens)
    pieces = []
    again = lingjax.generate(model, tok.encode("def add(a, b):"), 12, ignore_eos=True, on_text=pieces.append)
    assert again.tokens == result.tokens and "".join(pieces) == result.text
    stop = result.tokens[3]
    cut = lingjax.generate(model, "def add(a, b):", 12, stop_ids=[stop])
    first = result.tokens.index(stop)
    assert cut.tokens == result.tokens[:first + 1] and cut.text == tok.decode(result.tokens[:first])
    reply = lingjax.chat(model, [{"role": "user", "content": "hi"}], 6, ignore_eos=True,
                         template_kwargs={"enable_thinking": False})
    rendered = render(tok.chat_template, [{"role": "user", "content": "hi"}], enable_thinking=False)
    assert reply.tokens == lingjax.generate(model, rendered, 6, ignore_eos=True).tokens
    assert reply.prompt_len == len(tok.encode(rendered))


def test_ids_must_be_integers():
    model = lingjax.load("tiny", dtype="float32")
    for bad in ([1.5, 2], [True, 2], ["1"], [[1, 2]], np.array([1.0, 2.0])):
        with pytest.raises(ValueError, match="integer"):
            lingjax.generate(model, bad, 2)
    with pytest.raises(ValueError, match="empty"):
        lingjax.generate(model, "", 2)
    assert model.tokenizer is not None and lingjax.generate(model, "hi", 2, ignore_eos=True).text is not None


def test_checkpoint_without_tokenizer_says_so_once(caplog):
    with caplog.at_level("WARNING", logger="lingjax"):
        model = lingjax.load(FIXTURES / "tiny_a", dtype="float32")
    assert model.tokenizer is None and sum("no tokenizer.json" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="no tokenizer"):
        lingjax.generate(model, "text", 2)
    assert lingjax.generate(model, [1, 2], 2, ignore_eos=True).text is None
