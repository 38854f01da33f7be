"""`python -m lingjax.train.dspark`: the objective's pieces, the command on a few stdlib files against the shipped
model (runs, resumes, refuses other options, exports a drafter that loads beside the target), its errors."""

import contextlib
import json
import logging
import shutil
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

import lingjax
from conftest import key_for
from lingjax.train import dspark as train_dspark
from lingjax.train.command import SMOKE_PROMPT

FLAGS = ["--steps", "3", "--batch", "2", "--seq-len", "32", "--anchors", "4", "--block-size", "4", "--layers", "1",
         "--markov-rank", "8", "--intermediate", "64", "--log-every", "1", "--mask-token-id", "7"]


def test_anchors_are_distinct_sorted_and_leave_room_for_the_block():
    a = np.asarray(train_dspark.sample_anchors(key_for("anchors"), 3, 40, 20, 8))
    assert a.shape == (3, 20) and (np.diff(a, axis=1) > 0).all()
    assert a.min() >= 0 and a.max() + 8 <= 40


def _roots(root: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (root / "json").mkdir(parents=True)
    for name in ("textwrap.py", "string.py", "bisect.py"):
        shutil.copy(stdlib / name, root / name)
    shutil.copy(stdlib / "json" / "scanner.py", root / "json" / "scanner.py")
    return root


@contextlib.contextmanager
def _step_compiles():
    """The training step's lowerings while open (jax's "Compiling jit(step)" log lines), as a list."""
    names = []

    class Handler(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling jit(step)"):
                names.append("step")

    handler, logger = Handler(logging.WARNING), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield names
    finally:
        logger.removeHandler(handler)


def _main(argv, capsys):
    code = train_dspark.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_command_trains_resumes_and_exports(tmp_path, capsys):
    roots = _roots(tmp_path / "corpus")
    out, export = tmp_path / "run", tmp_path / "draft"
    argv = ["--out", out, "--roots", f"stdlib={roots}", *FLAGS]
    # the time limit keeps the export's reserve (command.EXPORT_RESERVE_S, 45 s) in hand: under it, the one step
    # every call takes, then a stop before the next, saved, not exported
    code, stdout, _ = _main(argv + ["--time-limit-s", "40"], capsys)
    assert code == 0
    first = json.loads(stdout.strip().splitlines()[-1])
    assert first["step"] == 1 < first["total"]
    assert not (out / "export").exists()
    with _step_compiles() as compiles:
        code, stdout, _ = _main(argv + ["--export", export], capsys)
    assert code == 0 and "step 3:" in stdout and "export:" in stdout
    assert compiles == ["step"]  # the resumed run's two steps: one program (the restored step is committed)
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["step"] == 3 and np.isfinite(summary["held_out"]["loss"])
    model = lingjax.load(draft=export)
    assert model.draft.cfg.block_size == 4 and model.draft.cfg.mask_token_id == 7
    # the export's own check completion (its DSpark programs compiled once, in the command), against plain greedy
    spec = lingjax.generate(model, SMOKE_PROMPT, 24, spec="dspark")
    assert spec.tokens == lingjax.generate(model, SMOKE_PROMPT, 24).tokens
    code, _, err = _main(["--out", out, "--roots", f"stdlib={roots}", *FLAGS[:-2], "--mask-token-id", "8"], capsys)
    assert code == 2 and "another run" in err and "mask_token_id" in err
    # a new run starting from the exported drafter with longer blocks (its identity names the drafter), and one of
    # another shape
    again = ["--out", tmp_path / "again", "--roots", f"stdlib={roots}", *FLAGS, "--init", export, "--block-size", "6",
             "--export", tmp_path / "draft6"]
    code, stdout, _ = _main(again, capsys)
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["step"] == 3
    assert lingjax.load(draft=tmp_path / "draft6").draft.cfg.block_size == 6
    record = json.loads(next((tmp_path / "again" / "checkpoint").glob("*/record.json")).read_text())
    assert record["run"]["init_sha"] == train_dspark.weights_sha(export)
    code, _, err = _main(["--out", tmp_path / "other", "--roots", f"stdlib={roots}", *FLAGS, "--init", export,
                          "--layers", "2"], capsys)
    assert code == 2 and "another shape" in err


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--anchors", "40", "--seq-len", "32"], "does not fit"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--block-size", "16"], "give --block-size <= 15"),
    (["--target", "no/such/dir"], "needs config.json"),
    (["--roots", "nolabel"], "LABEL=PATH"),
])
def test_bad_options_are_one_line(argv, says, tmp_path, capsys):
    code, out, err = _main(["--out", tmp_path / "run", *argv], capsys)
    assert code == 2 and out == "" and err.startswith("lingjax.train.dspark: error: ") and says in err


def test_a_corpus_without_held_out_source_is_one_line(tmp_path, capsys):
    root = tmp_path / "corpus"
    root.mkdir()
    shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py", root / "textwrap.py")
    code, _, err = _main(["--out", tmp_path / "run", "--roots", f"stdlib={root}", *FLAGS], capsys)
    assert code == 2 and "the held-out stream holds 0 tokens" in err and "json" in err
