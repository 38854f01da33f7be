"""The draft vocabulary (lingjax.spec.draft_vocab): sizes and tables, checks before any weight, lossless greedy
speculation (a small subset, one that holds none of the target's tokens, one that misses only an unused token),
sampled drafts over a subset keeping the target's distribution, the argmax under TP, and the drafters' state after
sampled rounds."""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import lingjax
from conftest import assert_frequencies, key_for, run_cli
from lingjax.config import preset
from lingjax.execution import Exec
from lingjax.sampling import SamplingParams
from lingjax.shipped import DEFAULT_CHECKPOINT
from lingjax.spec import draft_vocab as dv
from lingjax.spec.accept import rejection_accept
from lingjax.spec.dspark import default_config, markov_chain, random_dspark

VOCAB = 8192  # the shipped model's
NEW = 32


# ---- sizes and tables ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, n", [
    (None, None), ("full", None), ("100%", None), (8192, None), ("25%", 2048), ("12.5%", 1024), ("1000", 1000),
    (1, 1), ("0.01%", 256), ("90%", 7424), ("99%", None),
])
def test_resolve_size(spec, n):
    assert dv.resolve_size(spec, VOCAB) == n


def test_resolve_size_rounds_up_to_whole_rows_a_device():
    assert dv.resolve_size(1001, VOCAB, tp=4) == 1004
    assert dv.resolve_size("10%", 16384, tp=2) == 2048  # a percentage: whole power-of-2 tiles a device


@pytest.mark.parametrize("spec, message", [
    (0, "at least 1"), ("0", "at least 1"), ("-3", "token count"), ("abc", "token count"), ("0%", r"\(0, 100\]"),
    ("150%", r"\(0, 100\]"), (True, "token count"), (2.5, "token count"), (9000, "exceeds the vocabulary"),
])
def test_bad_sizes_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        dv.resolve_size(spec, VOCAB)


def test_top_ids_rank_by_count_ties_to_the_lower_id_and_come_back_ascending():
    counts = np.array([5, 9, 5, 0, 9, 1])
    assert dv.top_ids(counts, 3).tolist() == [0, 1, 4]
    assert dv.top_ids(counts, 4).tolist() == [0, 1, 2, 4]


def test_table_files_are_checked(tmp_path):
    good = tmp_path / "t.npy"
    np.save(good, np.arange(8))
    assert dv.read_table(good, 8).tolist() == list(range(8))
    for name, content, message in [("short.npy", np.ones(7), "vector of 8"), ("neg.npy", -np.ones(8), "non-negative"),
                                   ("text.npy", None, "not a .npy")]:
        path = tmp_path / name
        if content is None:
            path.write_text("1 2 3")
        else:
            np.save(path, content)
        with pytest.raises(ValueError, match=message):
            dv.read_table(path, 8)
    with pytest.raises(ValueError, match="no such file"):
        dv.read_table(tmp_path / "missing.npy", 8)


def test_the_shipped_table_covers_the_shipped_vocabulary():
    table = dv.read_table(DEFAULT_CHECKPOINT / dv.TABLE_NAME, VOCAB)
    assert table.sum() > 1e6 and (table > 0).mean() > 0.9


@pytest.mark.parametrize("kwargs, message", [
    (dict(draft_vocab="25%"), "needs a token frequency table"),
    (dict(draft_vocab="25"), None),  # a preset with a table given as an array: fine (checked below, not loaded)
    (dict(draft_vocab="ten"), "token count"),
    (dict(draft_vocab_table=np.ones(4)), "without a draft_vocab"),
    (dict(draft_vocab=10, draft_vocab_table=np.ones(4)), "counts"),
])
def test_load_checks_before_any_weight(kwargs, message, monkeypatch):
    """Each bad argument fails before a weight is drawn (random_model is never reached)."""
    from lingjax import loading

    def drawn(*a, **k):
        raise AssertionError("weights drawn")

    monkeypatch.setattr(loading, "random_model", drawn)
    if message is None:
        ids = loading.draft_vocab_ids("25", np.arange(preset("tiny").vocab_size), preset("tiny"), None)
        assert ids.size == 25 and ids[0] == preset("tiny").vocab_size - 25
        return
    with pytest.raises(ValueError, match=message):
        lingjax.load("tiny", **kwargs)


# ---- lossless greedy with the shipped pair ---------------------------------------------------------
@functools.cache
def _shipped(draft_vocab=None, table=None):
    return lingjax.load(dtype="float32", draft_vocab=draft_vocab,
                        draft_vocab_table=None if table is None else np.asarray(table))


def _prompt():
    return np.random.default_rng(7).integers(100, 4000, 24).tolist()


@functools.cache
def _plain():
    return lingjax.generate(_shipped(), _prompt(), NEW, ignore_eos=True).tokens


def _excluding(tokens):
    """(size, table) of the subset holding every token but `tokens`: no draft can be right."""
    counts = np.ones(VOCAB)
    counts[list(set(tokens))] = 0
    return VOCAB - len(set(tokens)), tuple(counts)


@pytest.mark.parametrize("spec", ["nextn", "dspark"])
def test_greedy_speculation_over_a_subset_equals_plain_greedy(spec):
    kw = dict(spec=spec, steps=3, ignore_eos=True)
    plain = _plain()
    small = lingjax.generate(_shipped("5%"), _prompt(), NEW, **kw)
    assert small.tokens == plain and len(small.accept_lens) < NEW  # some drafts are right, many fail
    # zero-accept: the subset misses every token the target emits, so every draft is rejected
    none = lingjax.generate(_shipped(*_excluding(plain)), _prompt(), NEW, **kw)
    assert none.tokens == plain and set(none.accept_lens) == {1}


@pytest.mark.slow
def test_a_subset_missing_an_unused_token_drafts_as_the_full_vocabulary():
    """The subset path itself (gathered rows, subset indices mapped back to ids, ties to the lower id) drafts
    exactly what the full head drafts when the argmax is always inside it: the same rounds, all-accept included."""
    kw = dict(spec="nextn", steps=3, ignore_eos=True)
    full = lingjax.generate(_shipped(), _prompt(), NEW, **kw)
    near = lingjax.generate(_shipped(VOCAB - 1), _prompt(), NEW, **kw)  # drops the shipped corpus's rarest id
    assert near.tokens == full.tokens == _plain() and near.accept_lens == full.accept_lens
    assert max(full.accept_lens) == 4  # all-accept rounds happen


@pytest.mark.slow
def test_sampled_rounds_leave_no_trace_in_the_drafter():
    """A greedy run after sampled runs on the same model equals a clean greedy run (the MTP cache and seed
    drafts of rejected rounds do not leak across requests)."""
    model, kw = _shipped("5%"), dict(spec="nextn", steps=3, ignore_eos=True)
    clean = lingjax.generate(model, _prompt(), NEW, **kw)
    for seed in (1, 2):
        lingjax.generate(model, _prompt()[::-1], NEW, temperature=0.9, seed=seed, **kw)
    again = lingjax.generate(model, _prompt(), NEW, **kw)
    assert again.tokens == clean.tokens == _plain() and again.accept_lens == clean.accept_lens


# ---- sampling ---------------------------------------------------------------------------------------
def test_sampled_drafts_over_a_subset_keep_the_target_distribution():
    """DSpark's sampled drafts from base logits over a subset (full_draft_logits: -inf outside it), then
    rejection sampling: the first emitted token follows the target's p_0, half of whose mass lies outside the
    subset; drafts come from the subset alone and their distributions are zero outside it."""
    vocab, draws, steps = 12, 40000, 2
    cfg = default_config(dataclasses_replace(preset("tiny"), vocab_size=vocab), block_size=steps + 1)
    net = random_dspark(cfg, "float32", seed=1).net
    d = cfg.hidden_size
    ids = np.array([1, 3, 4, 8, 10], np.int32)
    head = jax.random.normal(key_for("dv-head"), (vocab, d))
    vocab_dev = dv.DraftVocab(ids=jnp.asarray(ids), head=head[ids])
    module = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=vocab))
    h = jax.random.normal(key_for("dv-h"), (steps + 1, d)) * 0.3
    base = dv.full_draft_logits(module, vocab_dev, h, Exec())
    target = jnp.where(jnp.isin(jnp.arange(vocab), ids), 0.0, 0.6)[None].repeat(steps + 1, 0)
    target = target + jax.random.normal(key_for("dv-target"), (steps + 1, vocab)) * 0.7
    sampling = SamplingParams(temperature=0.8)

    def one(key):
        k_draft, k_accept = jax.random.split(key)
        drafts, probs, _ = markov_chain(net, base, h, jnp.int32(2), k_draft, sampling)
        _, tokens = rejection_accept(drafts[:steps], probs[:steps], target, k_accept, sampling)
        return drafts, probs, tokens[0]

    drafts, probs, first = jax.jit(jax.vmap(one))(jax.random.split(key_for("dv-draws"), draws))
    outside = ~np.isin(np.arange(vocab), ids)
    assert np.isin(np.asarray(drafts), ids).all() and float(np.abs(np.asarray(probs)[..., outside]).max()) == 0
    p0 = np.asarray(jax.nn.softmax(target[0] / 0.8))
    assert p0[outside].sum() > 0.4
    assert_frequencies(first, p0, vocab)


def dataclasses_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


# ---- tensor parallelism -----------------------------------------------------------------------------
def test_draft_argmax_under_tp_equals_one_device():
    """The subset's rows split like the lm_head: each device's argmax over its rows, reduced across devices,
    picks the one-device draft (subset indices map back to token ids)."""
    cfg = preset("tiny")
    counts = np.random.default_rng(0).random(cfg.vocab_size)
    model = lingjax.load("tiny", dtype="float32", seed=5, tp=2, draft_vocab=64, draft_vocab_table=counts)
    vocab = model.draft_vocab
    assert {s.data.shape for s in vocab.head.addressable_shards} == {(32, cfg.hidden_size)}
    hidden = jax.random.normal(key_for("dv-tp"), (5, cfg.hidden_size))
    fn = model.sharded(lambda w, v, x: dv.draft_argmax(model._module(w), v, x, model.ex),
                       (model.weight_specs, dv.SPECS, P()), P())
    got = np.asarray(jax.jit(fn)(model.weights, vocab, model.put(hidden)))
    head = np.asarray(model.module.lm_head[...])
    ids = dv.top_ids(counts, 64)
    want = ids[np.argmax(np.asarray(hidden) @ head[ids].T, -1)]
    assert got.tolist() == want.tolist()


# ---- the CLI flag -----------------------------------------------------------------------------------
_cli = run_cli


@pytest.mark.parametrize("flag, message", [
    ("ten", "token count"), ("0%", r"\(0, 100\]"), ("9000", "exceeds the vocabulary"),
    ("25%:/no/such.npy", "no such file"), (None, "no effect without --spec"),
])
def test_bad_draft_vocab_flag_is_one_line_before_model_work(flag, message, capsys, monkeypatch):
    from lingjax import checkpoint, loading

    def model_work(*args, **kwargs):
        raise AssertionError("model work started before the request was refused")

    for module, name in ((loading, "random_model"), (checkpoint, "load_safetensors")):
        monkeypatch.setattr(module, name, model_work)
    spec = [] if flag is None else ["--spec", "nextn"]
    code, _, err = _cli(["generate", "--prompt-ids", "1 2 3", "--draft-vocab", flag or "25%"] + spec, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lingjax: error: --draft-vocab")
    assert re.search(message, lines[0])


@pytest.mark.slow
def test_draft_vocab_flag_keeps_the_output(capsys):
    argv = ["generate", "--prompt-ids", " ".join(map(str, _prompt())), "--max-new-tokens", "24", "--ignore-eos",
            "--ids", "--spec", "nextn", "--steps", "3", "--dtype", "float32"]
    code, plain, _ = _cli(argv, capsys)
    code2, small, err = _cli(argv + ["--draft-vocab", "10%"], capsys)
    assert code == code2 == 0 and small == plain and "accept length" in err


@pytest.mark.slow
def test_speculation_over_a_subset_at_tp2_equals_tp1():
    """End to end at TP2 (the subset's rows split over two devices; DSpark with a random drafter; NEXTN's draft
    argmax at TP2: test_draft_argmax_under_tp_equals_one_device): the same tokens as plain greedy at TP1, and the
    same rounds as the same subset at TP1."""
    spec = "dspark"
    counts = np.random.default_rng(1).random(preset("tiny").vocab_size)
    kw = dict(draft="random", draft_vocab=128, draft_vocab_table=counts, dtype="float32", seed=5)
    one, two = lingjax.load("tiny", **kw), lingjax.load("tiny", tp=2, **kw)
    prompt = np.random.default_rng(3).integers(0, 500, 11).tolist()
    plain = lingjax.generate(one, prompt, 16, ignore_eos=True).tokens
    a = lingjax.generate(one, prompt, 16, ignore_eos=True, spec=spec, steps=3)
    b = lingjax.generate(two, prompt, 16, ignore_eos=True, spec=spec, steps=3)
    assert a.tokens == b.tokens == plain and a.accept_lens == b.accept_lens
