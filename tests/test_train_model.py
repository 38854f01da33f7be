"""lingjax.train's model side: the size budgets from shapes, the train forward against the inference model,
the objective decreasing, checkpoint round trips and resumes, the HF export, parity of an exported trained
checkpoint with the HF reference (tests/fixtures/train_small), and the `python -m lingjax.train` command end
to end on a tiny corpus.

Every train step here runs one RunConfig (RC), so each process compiles the train step once (step.train_step_fn
caches it per RunConfig) and the command's run reuses it."""

import json
import shutil
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lingjax
from conftest import FIXTURES, SALT, key_for, rel_err
from lingjax.checkpoint import INDEX_FILE, tensor_table
from lingjax.model import abstract_model, param_count
from lingjax.runtime import Model
from lingjax.train import checkpointing, data, export, forward, model_config, optim, run, step
from lingjax.train.checkpointing import CheckpointMismatch
from lingjax.train.options import parse_args
from lingjax.train.prepare import fingerprint, prepare_data
from lingjax.train.report import Reporter
from lingjax.train.trainer import run_identity

STEPS = 20
LR = 3e-3
RC = step.RunConfig(config="small", batch=2, seq_len=32, optim=optim.OptimConfig(lr=LR, warmup_steps=2,
                                                                                  total_steps=STEPS))
RC_FLAGS = ["--config", "small", "--batch", "2", "--seq-len", "32", "--lr", str(LR), "--warmup-steps", "2",
            "--steps", str(STEPS)]
F32_TOL = 1e-5  # × max |logit|: two f32 programs of the same math (dense vs gathered experts, ...)
HF_F32_TOL = 1e-4  # × max |HF logit|, as tests/test_parity.py: f32 against torch's f32
TRAIN_FIXTURE = FIXTURES / "train_small"
PROMPT_LEN = 146  # the train_small fixture's prompt: every small-config Model.logits here is then one program


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([SALT, *key])


def _host(tree) -> list[np.ndarray]:
    """Leaves as host arrays viewed as unsigned ints of their width: equality is bit equality."""
    leaves = jax.tree.leaves(jax.device_get(tree))
    return [np.asarray(a).view(f"u{np.asarray(a).dtype.itemsize}") for a in leaves]


def _bit_equal(a, b) -> bool:
    ha, hb = _host(a), _host(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(np.array_equal(x, y) for x, y in zip(ha, hb))


def _random_params(cfg, *key):
    """Fresh masters with nonzero selection biases (zero biases would hide a bias that steers nothing)."""
    params, biases = forward.init_params(cfg, int(_rng(*key).integers(1 << 30)), tied=model_config.TIE_EMBEDDINGS)
    return params, biases + 0.05 * jax.random.normal(key_for("biases", *key), biases.shape)


def _stream(n: int = 4000) -> np.ndarray:
    """A learnable synthetic token stream: a random 24-token motif over 32 ids, repeated, EOS after each."""
    motif = _rng(11).integers(8, 40, 24)
    return np.tile(np.append(motif, 0), n // 25 + 1)[:n].astype(np.uint16)


# ---- budgets from shapes ------------------------------------------------------------------------------
def test_embedded_budgets_from_shapes():
    rc = step.RunConfig(config="embedded")
    cfg = rc.cfg
    shipped = export.shipped_bytes(cfg)
    n = param_count(abstract_model(cfg, with_mtp=True))
    table = tensor_table(cfg, with_mtp=True)
    assert sum(int(np.prod(s.shape)) for s in table) == n  # the export writes every parameter once
    f32_leaves = sum(int(np.prod(s.shape)) for s in table if s.path[-1] in forward.f32_leaf_names(cfg))
    assert shipped == 2 * n + 2 * f32_leaves <= model_config.SHIPPED_BYTES_BUDGET
    state = step.abstract_state(rc)
    resume = optim.tree_bytes(state)
    assert resume <= model_config.RESUME_BYTES_BUDGET
    trained = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state["params"]))
    biases = int(np.prod(state["biases"].shape))  # one row per MoE layer, the MTP's included: not trained
    assert trained == n - cfg.vocab_size * cfg.hidden_size - biases  # and the head is the embedding
    assert optim.tree_bytes(state["opt"]) < 3 * trained  # bf16 m + factored v: not Adam's 8 bytes a parameter


def test_embedded_checkpoint_fits_on_disk(tmp_path):
    """A saved embedded resume state stays under the disk budget even with every leaf random bits (the worst
    case: orbax's compression gains nothing, where a trained state's f32 exponents would compress)."""
    rc = step.RunConfig(config="embedded")
    rng = _rng(1)

    def random_bits(s):
        n = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
        return jnp.asarray(rng.integers(0, 256, n, np.uint8).view(s.dtype).reshape(s.shape))

    state = jax.tree.map(random_bits, step.abstract_state(rc))
    path = checkpointing.save(tmp_path, 1, state, {"run": run_identity(rc)})
    assert optim.tree_bytes(state) <= checkpointing.dir_bytes(tmp_path) <= model_config.CHECKPOINT_DISK_BUDGET
    assert checkpointing.latest(tmp_path) == (1, path)


# ---- the train forward is the inference model ----------------------------------------------------------
def test_train_forward_equals_inference_model():
    """forward.forward on f32 masters equals lingjax's LingModel holding the same weights (Model.logits), at a
    length past VERIFY_ROWS (the chunked KDA path); forward.mtp_forward equals the model's MTP layer on the
    same hidden states (the drafter's input)."""
    cfg = model_config.small_test_config()
    params, biases = _random_params(cfg, 2)
    tokens = _rng(3).integers(0, cfg.vocab_size, PROMPT_LEN + 1).astype(np.int32)
    model = Model(forward.to_model(params, biases, cfg, jnp.float32))

    @jax.jit
    def train(params, biases, tokens):
        p = forward.cast_params(params, cfg, jnp.float32)
        hidden, _ = forward.forward(p, biases, tokens[None, :-1], cfg)
        z, _ = forward.mtp_forward(p, biases[-1], hidden, tokens[None, 1:], cfg)
        return forward.logits(p, hidden)[0], hidden[0], forward.logits(p, z)[0]

    @jax.jit
    def inference_mtp(weights, next_tokens, hidden):  # the drafter's call: row p reads (x_{p+1}, h_p)
        from lingjax.cache import init_mla_cache

        m, t = model._module(weights), next_tokens.shape[0]
        z, _ = m.mtp_forward(next_tokens, hidden, init_mla_cache(cfg, t, jnp.float32), 0, t)
        return m.lm_logits(z, pad_small=False)

    got, hidden, got_mtp = train(params, biases, tokens)
    assert rel_err(got, model.logits(tokens[:-1])) <= F32_TOL
    assert rel_err(got_mtp, inference_mtp(model.weights, tokens[1:], hidden)) <= F32_TOL


# ---- training -----------------------------------------------------------------------------------------
def _train(state, batches, steps: range):
    fn = step.train_step_fn(RC)
    metrics = []
    for k in steps:
        state, m = fn(state, batches.batch(k))
        metrics.append(m)
    return state, jax.device_get(metrics)


def test_loss_decreases():
    batches = data.PackedBatches(_stream(), RC.batch, RC.seq_len, RC.seed)
    _, metrics = _train(step.init_state(RC), batches, range(STEPS))
    main = [m["main_ce"] for m in metrics]
    mtp = [m["mtp_ce"] for m in metrics]
    assert np.isfinite([m["loss"] for m in metrics]).all()
    assert np.mean(main[-5:]) < main[0] - 1.0 and np.mean(mtp[-5:]) < mtp[0] - 1.0
    assert all(m["grad_norm"] > 0 for m in metrics)


def test_checkpoint_round_trip_and_resume_equal_uninterrupted(tmp_path):
    batches = data.PackedBatches(_stream(), RC.batch, RC.seq_len, RC.seed)
    straight, _ = _train(step.init_state(RC), batches, range(6))
    first, _ = _train(step.init_state(RC), batches, range(3))
    record = {"run": run_identity(RC), "data": {"fingerprint": "f"}}
    checkpointing.save(tmp_path, 3, first, record)
    saved = jax.device_get(first)
    at, restored, got_record = checkpointing.restore(tmp_path, step.abstract_state(RC), expect=record)
    assert at == 3 and got_record["run"] == record["run"] and got_record["step"] == 3
    assert _bit_equal(restored, saved)
    assert [a.dtype for a in jax.tree.leaves(restored)] == [a.dtype for a in jax.tree.leaves(saved)]
    resumed, _ = _train(restored, batches, range(3, 6))
    assert _bit_equal(resumed, straight)
    checkpointing.save(tmp_path, 6, resumed, record)
    assert [p.name for p in (tmp_path / checkpointing.CHECKPOINT_DIR).iterdir()] == ["step_00000006"]


def test_restore_refuses_another_run(tmp_path):
    import dataclasses

    state = step.init_state(RC)
    record = {"run": run_identity(RC), "data": {"fingerprint": "aaaa"}}
    checkpointing.save(tmp_path, 1, state, record)
    other = dataclasses.replace(RC, optim=dataclasses.replace(RC.optim, lr=LR / 2))
    with pytest.raises(CheckpointMismatch, match=r"optim\.lr") as e:
        checkpointing.restore(tmp_path, step.abstract_state(other), {**record, "run": run_identity(other)})
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointMismatch, match="data fingerprint"):
        checkpointing.restore(tmp_path, step.abstract_state(RC), {**record, "data": {"fingerprint": "bbbb"}})


# ---- export -------------------------------------------------------------------------------------------
def test_export_loads_as_the_rounded_model(tmp_path):
    """lingjax.load(dtype="float32") of an export holds exactly to_model(cast_params(params, bf16)) and gives
    its logits bit for bit."""
    cfg = model_config.small_test_config()
    params, biases = _random_params(cfg, 4)
    files = export.export(tmp_path, params, biases, model_config.config_dict("small"), max_shard_bytes=320_000)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and all((tmp_path / f).stat().st_size <= 320_000 for f in shards)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == export.shipped_bytes(cfg)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [0, 1]
    loaded = lingjax.load(tmp_path, dtype="float32")
    want = Model(forward.to_model(forward.cast_params(params, cfg, jnp.bfloat16), biases, cfg, jnp.float32))
    assert _bit_equal(nnx.to_pure_dict(loaded.params), nnx.to_pure_dict(want.params))
    tokens = _rng(5).integers(0, cfg.vocab_size, PROMPT_LEN)
    assert np.array_equal(loaded.logits(tokens), want.logits(tokens))


def test_exported_trained_checkpoint_matches_hf():
    """tests/fixtures/train_small (tests/make_train_fixture.py: a trained small state exported with its
    tokenizer) against HF's BailingHybridForCausalLM logits, f32. Not compared in bf16: the fixture's weights
    are trained, not conditioned against routing flips (tests/fixtures/README.md), so a bf16 run may pick
    other experts than f32 on a near tie and differ by a whole expert's output."""
    ref = np.load(TRAIN_FIXTURE / "hf_logits.npz")
    model = lingjax.load(TRAIN_FIXTURE, dtype="float32")
    logits = model.logits(ref["prompt_ids"])
    assert logits.shape == ref["logits"].shape
    assert rel_err(logits, ref["logits"]) <= HF_F32_TOL
    assert model.tokenizer is not None and model.tokenizer.stop_ids == {0, 1}


# ---- the command --------------------------------------------------------------------------------------
def _tiny_roots(root: Path) -> dict[str, Path]:
    """A few stdlib modules as training text and two json modules as the held-out package."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (root / "json").mkdir(parents=True)
    for name in ("textwrap.py", "string.py", "bisect.py", "heapq.py"):
        shutil.copy(stdlib / name, root / name)
    for name in ("scanner.py", "tool.py"):
        shutil.copy(stdlib / "json" / name, root / "json" / name)
    return {"stdlib": root}


def _main(argv, capsys) -> tuple[int, str, str]:
    code = run.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _summary(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _call(argv) -> tuple[int, str, str]:
    """run.main with stdout and stderr captured by hand (for a module-scoped fixture, which has no capsys)."""
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = run.main([str(a) for a in argv])
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def command_run(tmp_path_factory):
    """The command twice on one run directory: a first call stopped by its time limit after one step; then,
    the token cache deleted (as on another machine), a resume that rebuilds it from the corpus and the saved
    tokenizer, runs to the final step and exports. -> (run dir, roots dir, the common argv, (code, stdout,
    stderr) of each call, log.jsonl's text after them)."""
    base = tmp_path_factory.mktemp("train_run")
    roots = base / "corpus"
    _tiny_roots(roots)
    out = base / "run"
    argv = ["--out", out, "--roots", f"stdlib={roots}", *RC_FLAGS, "--eval-every", "10", "--log-every", "5"]
    calls = [_call(argv + ["--time-limit-s", "0"])]
    shutil.rmtree(out / "cache")
    calls.append(_call(argv))
    log = (out / "log.jsonl").read_text()  # as the two calls left it (later tests run the command again)
    return out, roots, argv, calls, log


def test_command_runs_resumes_and_exports(command_run):
    out, _, _, calls, log = command_run
    assert [code for code, _, _ in calls] == [0, 0], [err for _, _, err in calls]
    (_, out1, _), (_, out2, _) = calls
    first, second = _summary(out1), _summary(out2)
    assert first["step"] == first["steps_this_call"] == 1 and first["stopped"] == "time_limit"
    assert first["export"] is None and first["lzma_bpb"] > 0 and first["bpb"] > 0
    for phase in ("corpus:", "tokenizer: training", "encode train:", "encode held-out:", "lzma:",
                  "compile: the train step", "the first step ran", "saved step 1"):
        assert phase in out1, phase
    # the rebuilt cache: the corpus again, the saved tokenizer, the same data fingerprint, lzma's figure kept
    assert "resume: step 1" in out2 and "corpus:" in out2 and "tokenizer: training" not in out2
    assert "lzma:" not in out2 and second["lzma_bpb"] == first["lzma_bpb"]
    assert second["step"] == STEPS and second["steps_this_call"] == STEPS - 1 and second["stopped"] == "final_step"
    assert second["tokens_seen"] == STEPS * RC.batch * RC.seq_len and second["bpb"] < first["bpb"]
    assert f"smoke: lingjax.load({str(out / 'export')!r}) greedy 'def quicksort(xs):' ->" in out2
    assert second["export"] == str(out / "export") and isinstance(second["completion"], str)
    assert sorted(p.name for p in out.iterdir()) == ["cache", "checkpoint", "corpus_manifest.jsonl", "export",
                                                    "log.jsonl", "lzma_bpb.json", "tokenizer"]
    events = [json.loads(line) for line in log.splitlines()]
    train = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in train] == [1, 5, 10, 15, 20]
    assert all(k in train[-1] for k in ("loss", "mtp_ce", "lr", "grad_norm", "tokens_per_s", "elapsed_s"))
    assert [e["step"] for e in events if e["event"] == "eval"] == [1, 10, 20]
    assert [e["step"] for e in events if e["event"] == "summary"] == [1, 20]
    record = checkpointing.read_record(checkpointing.latest(out)[1])
    assert record["run"] == run_identity(RC) and record["data"]["position"] == STEPS
    assert record["progress"]["calls"] == 2 and record["progress"]["tokens_seen"] == second["tokens_seen"]


def test_command_data_comes_from_the_cache(command_run, capsys):
    """With cache/ in place the data is read from it, without the corpus: the same streams and fingerprint."""
    out, _, argv = command_run[:3]
    rep = Reporter(out, 0.0)
    cached = prepare_data(parse_args([str(a) for a in argv]), rep)
    assert "data: cached streams" in capsys.readouterr().out
    record = checkpointing.read_record(checkpointing.latest(out)[1])
    assert cached.fingerprint == record["data"]["fingerprint"]
    assert fingerprint(cached.train_tokens, cached.held_out_tokens, cached.held_out_bytes) == cached.fingerprint


def test_command_resume_equals_uninterrupted_steps(command_run):
    """The command's final state, reached over three calls, is the same steps run straight through."""
    out = command_run[0]
    batches = data.PackedBatches(np.load(out / "cache" / "train.npy"), RC.batch, RC.seq_len, RC.seed)
    straight, _ = _train(step.init_state(RC), batches, range(STEPS))
    _, saved, _ = checkpointing.restore(out, step.abstract_state(RC))
    assert _bit_equal(saved, straight)


def test_command_exports_a_finished_run(command_run, capsys, tmp_path):
    out, _, argv = command_run[:3]
    code, text, err = _main(argv + ["--export", tmp_path / "again"], capsys)
    assert code == 0, err
    assert "the run is at its final step" in text and _summary(text)["export"] == str(tmp_path / "again")
    for f in (out / "export").iterdir():  # the same state exported again: the same bytes
        assert (tmp_path / "again" / f.name).read_bytes() == f.read_bytes(), f.name


def test_command_refuses_other_options_and_corpus(command_run, capsys, tmp_path):
    out, roots, argv = command_run[:3]
    for flag, value, field in (("--lr", LR / 2, "optim.lr"), ("--steps", STEPS + 1, "optim.total_steps"),
                               ("--config", "embedded", "config")):
        code, _, err = _main(argv + [flag, value], capsys)
        assert code == 2 and err.count("\n") == 1 and err.startswith("lingjax.train: error: "), err
        assert field in err and "another --out" in err
    changed = tmp_path / "corpus"
    shutil.copytree(roots, changed)
    (changed / "bisect.py").write_text((changed / "bisect.py").read_text() + "\nX = 1\n")
    fresh = tmp_path / "fresh"  # the run directory without a state or a cache: the corpus is read again
    shutil.copytree(out, fresh, ignore=shutil.ignore_patterns("checkpoint", "cache", "export"))
    code, _, err = _main(["--out", fresh, "--roots", f"stdlib={changed}", *RC_FLAGS], capsys)
    assert code == 2 and err.count("\n") == 1 and "differs from" in err and "stdlib/bisect.py" in err


@pytest.mark.parametrize("argv, message", [
    (["--config", "huge"], "invalid choice"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--batch", "0"], "batch and seq_len must be >= 1"),
    (["--seq-len", "5000"], "does not fit"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--roots", "nolabel"], "LABEL=PATH"),
    (["--roots", "stdlib=/nonexistent/dir"], "not a directory"),
    (["--bogus"], "unrecognized arguments"),
])
def test_command_errors_are_one_line(argv, message, tmp_path, capsys):
    code, out, err = _main(["--out", tmp_path / "run", *argv], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("lingjax.train: error: ") and message in err
    assert not (tmp_path / "run").exists()  # nothing was made


def test_command_refuses_an_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code, _, err = _main(["--out", tmp_path / "f"], capsys)
    assert code == 2 and err == f"lingjax.train: error: --out {tmp_path / 'f'} is a file, not a directory\n"
    code, _, err = _main([], capsys)
    assert code == 2 and "--out" in err and err.count("\n") == 1
