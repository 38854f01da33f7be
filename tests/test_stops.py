"""Stop strings and fill-in-the-middle: one implementation (lingjax.stops, lingjax.fim) under lingjax.generate, the
CLI and the server."""

import functools

import pytest

import lingjax
from lingjax import cli
from lingjax.fim import FIM_TOKENS, fim_prompt
from lingjax.stops import StopCutter, check_stop_strings


def _cut(text, stops, pieces):
    """Text pushed in the given pieces -> (every piece emitted, joined; stopped)."""
    cutter = StopCutter(stops)
    out, at = [], 0
    for n in pieces:
        out.append(cutter.push(text[at:at + n])[0])
        at += n
    out.append(cutter.push(text[at:])[0])
    if not cutter.stopped:
        out.append(cutter.flush())
    assert "".join(out) == cutter.text
    return cutter.text, cutter.stopped


@pytest.mark.parametrize("split", [1, 2, 3, 7, 100])
def test_cut_before_the_earliest_stop_across_pieces(split):
    text = "abc<|x|>def\n\nclass A: pass"
    pieces = [split] * (len(text) // split)
    assert _cut(text, ["\n\nclass", "def"], pieces) == ("abc<|x|>", True)
    assert _cut(text, ["class", "\n\n"], pieces) == ("abc<|x|>def", True)
    assert _cut(text, ["zzz"], pieces) == (text, False)
    assert _cut(text, ["pass!"], pieces) == (text, False)  # held back "pass" comes out at the end


def test_only_what_could_start_a_stop_is_held_back():
    cutter = StopCutter(["\ndef ", "END"])
    assert cutter.push("x = 1\nde") == ("x = 1", False)  # "\nde" may start "\ndef "
    assert cutter.push("lta = 2\nE") == ("\ndelta = 2\n", False)
    assert cutter.push("NDING") == ("", True) and cutter.text == "x = 1\ndelta = 2\n"
    cutter = StopCutter(["END"])
    assert cutter.push("xEN") == ("x", False) and cutter.push("D more") == ("", True) and cutter.text == "x"


@pytest.mark.parametrize("bad", [[""], [1], "", b"x", ["a"] * 17, {"a": 1}])
def test_bad_stop_strings(bad):
    with pytest.raises(ValueError, match="stop"):
        check_stop_strings(bad)


@functools.cache
def _shipped():
    return lingjax.load(dtype="float32")


@pytest.mark.parametrize("spec", [None, "nextn"])
def test_generate_cuts_at_a_stop_string_and_stops_there(spec):
    model = _shipped()
    full = lingjax.generate(model, "def quicksort(xs):", 40, spec=spec, ignore_eos=True)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 5]  # a stop inside the text, across tokens
    pieces = []
    cut = lingjax.generate(model, "def quicksort(xs):", 40, spec=spec, stop=[stop, "never"], ignore_eos=True,
                           on_text=pieces.append)
    want = full.text[:full.text.index(stop)]
    assert cut.text == want and "".join(pieces) == want and cut.stop_reason == "stop"
    assert cut.tokens == full.tokens[:len(cut.tokens)]  # it ends with the token that completed the stop
    assert stop in model.tokenizer.decode(cut.tokens) and stop not in model.tokenizer.decode(cut.tokens[:-1])


def test_fill_in_the_middle_uses_the_tokenizers_fim_tokens():
    model = _shipped()
    ids = fim_prompt(model.tokenizer, "shipped", "def f(x):\n", "    return y\n")
    pre, suf, mid = (model.tokenizer.token_id(t) for t in FIM_TOKENS)
    assert ids[0] == pre and ids[-1] == mid and ids.count(suf) == 1
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|fim_prefix|>def f(x):\n<|fim_suffix|>    return y\n<|fim_middle|>")
    a = lingjax.generate(model, "def f(x):\n", 8, suffix="    return y\n")
    b = lingjax.generate(model, ids, 8)
    assert a.tokens == b.tokens and a.prompt_len == len(ids)


def test_fim_without_fim_tokens_is_a_clear_error(capsys):
    tiny = lingjax.load("tiny", seed=0)
    with pytest.raises(ValueError, match="no fill-in-the-middle tokens"):
        lingjax.generate(tiny, "def f():", 4, suffix="x")
    assert cli.main(["generate", "--model", "tiny", "--prompt", "a", "--suffix", "b"]) == 2
    assert "lingjax: error: tiny has no fill-in-the-middle tokens" in capsys.readouterr().err


def test_cli_stop_and_suffix(capsys):
    model = _shipped()
    full = lingjax.generate(model, "def quicksort(xs):", 24, ignore_eos=True)
    stop = full.text[10:14]
    code = cli.main(["generate", "--prompt", "def quicksort(xs):", "--max-new-tokens", "24", "--ignore-eos",
                     "--dtype", "float32", "--stop", "zzzz", "--stop", stop, "--no-cache"])
    out, err = capsys.readouterr()
    assert code == 0 and out == full.text[:full.text.index(stop)] + "\n" and "(stop)" in err
    want = lingjax.generate(model, "def f(x):\n", 6, suffix="    return y").text
    code = cli.main(["generate", "--prompt", "def f(x):\n", "--suffix", "    return y", "--max-new-tokens", "6",
                     "--dtype", "float32", "--no-cache"])
    out, _ = capsys.readouterr()
    assert code == 0 and out.rstrip("\n") == want.rstrip("\n")
    for argv, error in ((["--stop", ""], "--stop: stop strings must be non-empty"),
                        (["--stop", "x", "--ids"], "--stop cuts text"),
                        (["--suffix", "x", "--chat"], "--suffix fills in the middle")):
        assert cli.main(["generate", "--prompt", "a", *argv]) == 2
        assert error in capsys.readouterr().err
