"""The command line: text and ids out, chat, and every bad request refused in one line before any model work."""

import io
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import lingjax
from conftest import FIXTURES, run_cli
from lingjax import checkpoint, loading, memory
from lingjax.chat_repl import ChatSession

_run = run_cli


@pytest.fixture
def no_model_work(monkeypatch):
    """Any weight drawn or read fails the test: a refused request must be refused before that."""

    def model_work(*args, **kwargs):
        raise AssertionError("model work started before the request was refused")

    monkeypatch.setattr(loading, "random_model", model_work)
    monkeypatch.setattr(checkpoint, "load_safetensors", model_work)
    monkeypatch.setattr(checkpoint, "load_orbax", model_work)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


# ---- output -------------------------------------------------------------------------------------------
def test_generate_prints_text_equal_to_the_decoded_tokens(capsys):
    code, out, err = _run(["generate", "--model", "tiny", "--prompt", "hello", "--max-new-tokens", "6",
                           "--ignore-eos"], capsys)
    assert code == 0 and "TTFT" in err and "TPOT" in err
    model = lingjax.load("tiny", seed=0)
    result = lingjax.generate(model, "hello", 6, ignore_eos=True)
    want = result.text if result.text.endswith("\n") else result.text + "\n"
    assert out == want and result.text == model.tokenizer.decode(result.tokens)


def test_generate_ids_stream_without_the_stop_token(capsys):
    model = lingjax.load("tiny", seed=0)
    tokens = lingjax.generate(model, [1, 2, 3], 5, ignore_eos=True).tokens
    code, out, _ = _run(["generate", "--model", "tiny", "--prompt-ids", "1 2 3", "--max-new-tokens", "5",
                         "--ignore-eos", "--ids"], capsys)
    assert code == 0 and out == " ".join(map(str, tokens)) + "\n"  # no trailing space
    stop = tokens[2]
    code, out, _ = _run(["generate", "--model", "tiny", "--prompt-ids", "1 2 3", "--max-new-tokens", "5",
                         "--ignore-eos", "--ids", "--stop-ids", str(stop)], capsys)
    cut = tokens[:tokens.index(stop)]
    assert code == 0 and out == " ".join(map(str, cut)) + "\n"


def test_prompt_from_file_and_stdin_equal_prompt_text(tmp_path, capsys, monkeypatch):
    argv = ["generate", "--model", "tiny", "--max-new-tokens", "4", "--ignore-eos"]
    _, want, _ = _run(argv + ["--prompt", "naïve 🙂"], capsys)
    (tmp_path / "p.txt").write_text("naïve 🙂", encoding="utf-8")
    assert _run(argv + ["--prompt-file", str(tmp_path / "p.txt")], capsys)[1] == want
    monkeypatch.setattr(sys, "stdin", io.StringIO("naïve 🙂"))
    assert _run(argv, capsys)[1] == want


def test_generate_chat_applies_the_template(ling_dir, capsys):
    d, ids = ling_dir
    code, out, _ = _run(["generate", "--checkpoint", str(d), "--prompt", "hi", "--chat", "--system", "be brief",
                         "--chat-option", "enable_thinking=false", "--max-new-tokens", "5", "--ignore-eos",
                         "--ids"], capsys)
    model = lingjax.load(d, seed=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    result = lingjax.chat(model, messages, max_new_tokens=5, ignore_eos=True,
                          template_kwargs={"enable_thinking": False})
    assert code == 0 and out.split() == [str(t) for t in result.tokens]


def test_chat_command_answers_each_line(ling_dir, capsys, monkeypatch):
    d, _ = ling_dir
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/reset\nagain\n"))
    code, out, err = _run(["chat", "--checkpoint", str(d), "--max-new-tokens", "4", "--ignore-eos"], capsys)
    model = lingjax.load(d, seed=0)
    first = lingjax.chat(model, [{"role": "user", "content": "hello"}], max_new_tokens=4, ignore_eos=True).text
    again = lingjax.chat(model, [{"role": "user", "content": "again"}], max_new_tokens=4, ignore_eos=True).text
    assert code == 0 and out == first + "\n" + again + "\n" and "conversation cleared" in err


def test_ctrl_c_stops_a_reply_and_keeps_the_session():
    calls = []

    def generate(model, messages, on_text, **kwargs):
        calls.append([dict(m) for m in messages])
        on_text("partial")
        if len(calls) == 1:
            raise KeyboardInterrupt
        on_text(" answer")

    session = ChatSession(model=None, generate=generate)
    stdout, stderr = io.StringIO(), io.StringIO()
    assert session.run(io.StringIO("first\nsecond\n"), stdout, stderr) == 0
    assert stdout.getvalue() == "partial [stopped]\npartial answer\n"
    assert calls[1] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "partial"},
                        {"role": "user", "content": "second"}]


def test_the_shipped_model_is_the_default(capsys):
    from lingjax.shipped import DEFAULT_CHECKPOINT

    model = lingjax.load()
    assert model.source == str(DEFAULT_CHECKPOINT) and model.tokenizer.vocab_size == model.module.cfg.vocab_size
    result = lingjax.generate(model, "def quicksort(xs):", 8)
    code, out, _ = _run(["generate", "--prompt", "def quicksort(xs):", "--max-new-tokens", "8"], capsys)
    assert code == 0 and out.rstrip("\n") == result.text.rstrip("\n") and result.text.strip()
    code, out, _ = _run(["info"], capsys)
    assert code == 0 and "layers      8" in out and "drafter     DSpark (ling-code-tiny-dspark): 4 layers" in out
    code, named, _ = _run(["info", "--checkpoint", str(DEFAULT_CHECKPOINT)], capsys)  # named by its path: the same
    assert code == 0 and named == out


def test_info_flash(capsys):
    code, out, _ = _run(["info", "--model", "flash"], capsys)
    assert code == 0 and "124.41 B without MTP" in out and "127.49 B with MTP" in out


def test_generate_speculative(capsys):
    args = ["generate", "--model", "tiny", "--prompt-ids", "4 5 6", "--max-new-tokens", "7", "--ignore-eos",
            "--dtype", "float32", "--ids"]
    plain = _run(args, capsys)[1]
    code, out, err = _run(args + ["--spec", "nextn", "--steps", "3"], capsys)
    assert code == 0 and out == plain and "mean accept length" in err
    code, out, err = _run(args + ["--spec", "dspark", "--draft", "random", "--widths", "3,5"], capsys)
    assert code == 0 and out == plain and "mean accept length" in err


def test_generate_tensor_parallel(capsys):
    args = ["generate", "--model", "tiny", "--prompt-ids", "4 5 6", "--max-new-tokens", "5", "--ignore-eos",
            "--dtype", "float32", "--ids"]
    plain = _run(args, capsys)[1]
    assert _run(args + ["--tp", "2"], capsys)[1] == plain


# ---- refusals -----------------------------------------------------------------------------------------
TINY = ["generate", "--model", "tiny"]
BAD_REQUESTS = {
    "empty prompt": (TINY + ["--prompt", ""], "the prompt is empty"),
    "ids outside the vocabulary": (TINY + ["--prompt-ids", "1 99999"], "outside the vocabulary"),
    "negative id": (TINY + ["--prompt-ids", "1 -3"], "outside the vocabulary"),
    "non-integer ids": (TINY + ["--prompt-ids", "1 2.5"], "expected integers"),
    "temperature nan": (TINY + ["--prompt", "a", "--temperature", "nan"], "--temperature must"),
    "negative temperature": (TINY + ["--prompt", "a", "--temperature", "-1"], "temperature"),
    "top-p 0": (TINY + ["--prompt", "a", "--temperature", "1", "--top-p", "0"], "--top-p must"),
    "top-p above 1": (TINY + ["--prompt", "a", "--temperature", "1", "--top-p", "1.5"], "--top-p must"),
    "negative top-k": (TINY + ["--prompt", "a", "--temperature", "1", "--top-k", "-2"], "--top-k must"),
    "top-k when greedy": (TINY + ["--prompt", "a", "--top-k", "5"], "no effect at temperature 0"),
    "top-p when greedy": (TINY + ["--prompt", "a", "--top-p", "0.9"], "no effect at temperature 0"),
    "past the maximum length": (TINY + ["--prompt", "a", "--max-new-tokens", "10000000"], "maximum length"),
    "no new tokens": (TINY + ["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens must"),
    "steps without spec": (TINY + ["--prompt", "a", "--steps", "3"], "no effect without spec"),
    "steps past the verify width": (TINY + ["--prompt", "a", "--spec", "nextn", "--steps", "99"], "--steps must be"),
    "dspark without a drafter": (TINY + ["--prompt", "a", "--spec", "dspark"], "needs a DSpark drafter"),
    "draft without dspark": (TINY + ["--prompt", "a", "--draft", "random"], "no effect without --spec dspark"),
    "widths without dspark": (TINY + ["--prompt", "a", "--widths", "3"], "no effect without --spec dspark"),
    "no such draft": (TINY + ["--prompt", "a", "--spec", "dspark", "--draft", "no/such"], "no config.json"),
    "widths and steps": (TINY + ["--prompt", "a", "--spec", "dspark", "--draft", "random", "--steps", "3",
                                 "--widths", "3,5"], "not both"),
    "widths past the block": (TINY + ["--prompt", "a", "--spec", "dspark", "--draft", "random", "--widths", "3,12"],
                              "--widths must lie"),
    "dspark steps past the block": (TINY + ["--prompt", "a", "--spec", "dspark", "--draft", "random", "--steps",
                                            "12"], "the drafter's block size"),
    "stop id outside the vocabulary": (TINY + ["--prompt", "a", "--stop-ids", "99999"], "stop ids"),
    "system without chat": (TINY + ["--prompt", "a", "--system", "s"], "no effect without --chat"),
    "chat option without chat": (TINY + ["--prompt", "a", "--chat-option", "x=1"], "no effect without --chat"),
    "chat with ids": (TINY + ["--prompt-ids", "1 2", "--chat"], "--chat renders a text prompt"),
    "bad chat option": (TINY + ["--prompt", "a", "--chat", "--chat-option", "novalue"], "KEY=VALUE"),
    "preset as checkpoint": (["generate", "--checkpoint", "tiny", "--prompt", "a"], "use --model tiny"),
    "no such checkpoint": (["generate", "--checkpoint", "no/such/dir", "--prompt", "a"], "no such directory"),
    "tp past the devices": (TINY + ["--prompt", "a", "--tp", "16"], "16"),
    "tp not a divisor": (TINY + ["--prompt", "a", "--tp", "3"], "3"),
    "missing prompt file": (TINY + ["--prompt-file", "no/such/file.txt"], "no/such/file.txt"),
    "bad integer": (TINY + ["--prompt", "a", "--max-new-tokens", "x"], "invalid int value"),
    "unknown preset": (["generate", "--model", "nope", "--prompt", "a"], "invalid choice"),
    "preset and checkpoint": (TINY + ["--checkpoint", "x", "--prompt", "a"], "not allowed with"),
    "unknown command": (["frobnicate"], "invalid choice"),
    "unknown option": (TINY + ["--prompt", "a", "--frobnicate"], "unrecognized arguments"),
    "seed past int64": (TINY + ["--prompt", "a", "--seed", str(2**70)], "seed must be an integer in [0, 2**63)"),
    "top-k past the vocabulary": (TINY + ["--prompt", "a", "--temperature", "1", "--top-k", str(10**9)],
                                  "at most the vocabulary's 512"),
    "tp 0": (TINY + ["--prompt", "a", "--tp", "0"], "tp (tensor-parallel devices) must be an integer >= 1, got 0"),
    "widths not integers": (TINY + ["--prompt", "a", "--spec", "dspark", "--draft", "random", "--widths", "a,b"],
                            "integers separated by spaces or commas"),
    "prompt not UTF-8": (TINY + ["--prompt", "ab\udcffc"], "not valid UTF-8 (byte 0xff at character 2)"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_one_line_and_exit_2_before_model_work(case, capsys, monkeypatch, tmp_path, no_model_work):
    monkeypatch.chdir(tmp_path)  # no directory named like a preset here
    argv, says = BAD_REQUESTS[case]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "", (case, out)
    assert err.startswith("lingjax: error: ") and err.count("\n") == 1 and says in err, (case, err)


def test_no_prompt_at_a_terminal_is_refused(capsys, monkeypatch, no_model_work):
    monkeypatch.setattr(sys, "stdin", _Terminal())
    code, _, err = _run(TINY, capsys)
    assert code == 2 and err.startswith("lingjax: error: give a prompt") and err.count("\n") == 1


def test_model_too_big_for_memory_is_refused(capsys, monkeypatch, no_model_work):
    monkeypatch.setattr(memory, "free_bytes", lambda device=None: 1_000_000)
    code, _, err = _run(["generate", "--model", "mid", "--prompt", "a"], capsys)
    assert code == 2 and err.startswith("lingjax: error: mid needs about") and err.count("\n") == 1
    assert "GB free" in err


def test_text_prompt_without_a_tokenizer_is_refused(tmp_path, capsys, monkeypatch, no_model_work, caplog):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "tiny_c", d)
    code, _, err = _run(["generate", "--checkpoint", str(d), "--prompt", "hello"], capsys)
    assert code == 2 and "has no tokenizer" in err and "--prompt-ids" in err and err.count("\n") == 1


def test_bad_checkpoint_config_is_one_line(tmp_path, capsys, no_model_work):
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = _run(["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1"], capsys)
    assert code == 2 and err.startswith("lingjax: error:") and err.count("\n") == 1


def test_stdin_that_is_not_utf8_is_one_line(capsys, monkeypatch, no_model_work):
    class Stdin(io.StringIO):
        buffer = io.BytesIO(b"def f(\xff):")

    monkeypatch.setattr(sys, "stdin", Stdin())
    code, _, err = _run(TINY, capsys)
    assert code == 2 and err == "lingjax: error: stdin is not UTF-8 text (byte 0xff at offset 6)\n"


def test_config_value_of_the_wrong_type_names_file_and_key(tmp_path, capsys, no_model_work):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "tiny_c", d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"hidden_size": "big"}))
    code, _, err = _run(["generate", "--checkpoint", str(d), "--prompt-ids", "1"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert str(d / "config.json") in err and "hidden_size must be an integer, got 'big'" in err


def test_convert_refuses_a_file_or_a_directory_that_is_not_empty(tmp_path, capsys, no_model_work):
    src = FIXTURES / "tiny_a"
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("keep")
    for out, says in ((tmp_path / "file", "is not a directory"), (tmp_path / "full", "is not empty"),
                      (src, "is the checkpoint itself")):
        code, _, err = _run(["convert", str(src), str(out)], capsys)
        assert code == 2 and says in err and err.count("\n") == 1, err
    assert (tmp_path / "full" / "keep.txt").read_text() == "keep" and sorted((tmp_path / "full").iterdir()) == [
        tmp_path / "full" / "keep.txt"]


def test_chat_says_what_the_shipped_model_is(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = _run(["chat"], capsys)
    assert code == 0 and "is a code completion model, not trained for chat" in err and "lingjax generate" in err


def test_generate_summary_says_compiled_only_when_it_did(capsys):
    args = TINY + ["--prompt-ids", "4 5 6", "--max-new-tokens", "1", "--ids", "--dtype", "float32", "--seed", "11"]
    code, _, first = _run(args, capsys)
    assert code == 0 and "no TPOT (one token)" in first and "compiling took" in first
    from lingjax import compile_watch

    assert compile_watch.seconds() > 0


def _cli(*argv, env):
    return subprocess.run([sys.executable, "-m", "lingjax.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=600)


def test_generate_ends_cleanly_when_it_stops_early():
    """`lingjax generate` exits 0 (no abort in the runtime's teardown with a call launched ahead still running) when
    the first new token is a stop, when a stop falls inside a round's accepted drafts, and at max_new_tokens 1."""
    import os

    model = lingjax.load()
    prompt = "def quicksort(xs):"
    spec = lingjax.generate(model, prompt, 24, spec="nextn", steps=3, ignore_eos=True)
    tokens, rounds = spec.tokens, spec.accept_lens
    # a token inside a round (its second or later), not seen before it: the stop cuts the round's tokens after it
    starts = np.cumsum([1] + rounds[:-1]).tolist()
    inside = [starts[r] + 1 for r, n in enumerate(rounds) if n >= 2 and starts[r] + 1 < len(tokens)
              and tokens[starts[r] + 1] not in tokens[:starts[r] + 1]]
    assert inside, (tokens, rounds)
    env = dict(os.environ)  # the session's compilation cache (tests/conftest.py): the programs compiled above
    base = ["generate", "--prompt", prompt, "--ignore-eos", "--ids"]
    cases = [(base + ["--stop-ids", str(tokens[0]), "--max-new-tokens", "8"], 1),
             (base + ["--spec", "nextn", "--steps", "3", "--stop-ids", str(tokens[inside[0]]), "--max-new-tokens",
                      "24"], inside[0] + 1),
             (base + ["--max-new-tokens", "1"], 1)]
    for argv, count in cases:
        done = _cli(*argv, env=env)
        assert done.returncode == 0, (argv, done.returncode, done.stderr[-2000:])
        assert done.stdout.split() == [str(t) for t in tokens[:count]][: count - 1 if "--stop-ids" in argv else count]
        assert f"{count} tokens (" in done.stderr and "Traceback" not in done.stderr


def test_chat_refuses_bad_template_options_before_loading(ling_dir, capsys, no_model_work):
    d, _ = ling_dir
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = "{{ raise_exception('no such option') if strict else '' }}{{ messages[0]['content'] }}"
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    code, _, err = _run(["chat", "--checkpoint", str(d), "--chat-option", "strict=true"], capsys)
    assert code == 2 and "no such option" in err and err.count("\n") == 1


# ---- the program itself -------------------------------------------------------------------------------
def test_version(capsys):
    code, out, _ = _run(["--version"], capsys)
    assert code == 0 and out.strip() == f"lingjax {lingjax.__version__}"


def test_help_imports_no_jax_and_shows_defaults():
    code = ("import sys, lingjax.cli\ntry: lingjax.cli.main(['generate', '--help'])\nexcept SystemExit: pass\n"
            "print('jax imported' if 'jax' in sys.modules else 'no jax')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("no jax") and "(default: 128)" in out and "--no-cache" in out
