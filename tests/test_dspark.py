"""DSpark block drafting: the network's pieces against references, the context cache against the target's own
features, lossless greedy (zero, partial and full acceptance), stops and limits inside a block, state pollution,
rejection sampling's distribution, and the draft checkpoint's layouts and errors."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lingjax
from conftest import assert_frequencies, key_for, rel_err
from lingjax import engine
from lingjax.checkpoint import CheckpointError
from lingjax.ops.rope import rope_half
from lingjax.sampling import SamplingParams
from lingjax.spec import dspark, dspark_io, width_schedule
from lingjax.spec import step as spec_step
from lingjax.spec.accept import rejection_accept
from lingjax.spec.dspark_model import DSparkConfig, DSparkConfigError, block_attention

BLOCK = 6


@functools.cache
def _target():
    return lingjax.load("tiny", dtype="float32", seed=3, draft=None)


def _config(**changes) -> DSparkConfig:
    cfg = dspark.default_config(_target().cfg, block_size=BLOCK, num_layers=2, markov_rank=16)
    return dataclasses.replace(cfg, **changes)


@functools.cache
def _random_model():
    return _target().with_draft(dspark.random_dspark(_config(), "float32", seed=4))


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


def _oracle(model, sequence, conf_bias=20.0, seed=5):
    """A DSpark drafter whose Markov head knows `sequence`'s successor of each token (the last one seen wins):
    W1 the identity over the vocabulary, W2 a large bias on the successor; the confidence head's bias
    conf_bias (large: every draft counts; very negative: none does). Its block network stays random."""
    v = model.cfg.vocab_size
    cfg = dataclasses.replace(_config(), markov_rank=v)
    net = dspark.random_dspark(cfg, "float32", seed).net
    w2 = np.zeros((v, v), np.float32)  # [next, prev]
    for prev, nxt in zip(sequence[:-1], sequence[1:]):
        w2[:, prev] = 0.0
        w2[nxt, prev] = 1000.0
    net.markov_w1[...] = jnp.eye(v, dtype=jnp.float32)
    net.markov_w2[...] = jnp.asarray(w2)
    net.confidence_w[...] = jnp.zeros(net.confidence_w.shape, jnp.float32)
    net.confidence_b[...] = jnp.full(net.confidence_b.shape, conf_bias, jnp.float32)
    return model.with_draft(dspark.DSpark(net, source="oracle"))


# ---- the network's pieces -------------------------------------------------------------------------------
def test_rope_half_rotates_halves_and_keeps_relative_positions():
    x = jax.random.normal(key_for("rope-x"), (5, 3, 8))
    pos = jnp.arange(5) * 7 + 3
    got = rope_half(x, pos, 100.0)
    angle = pos[:, None, None] * 100.0 ** (-jnp.arange(4) / 4.0)
    z = (x[..., :4] + 1j * x[..., 4:]) * jnp.exp(1j * angle)  # pairs (i, i + d/2) as complex numbers
    assert rel_err(got, jnp.concatenate([z.real, z.imag], -1)) < 1e-5
    q, k = jax.random.normal(key_for("rope-q"), (2, 1, 8))
    dot = lambda a, b: float(
        jnp.sum(rope_half(q[None], jnp.array([a]), 100.0) * rope_half(k[None], jnp.array([b]), 100.0))
    )  # noqa: E731
    assert abs(dot(9, 4) - dot(25, 20)) < 1e-4


def test_block_attention_against_a_masked_softmax_and_ignores_hidden_context():
    nb, g, h, kv, d, c = 3, 4, 4, 2, 8, 10
    keys = [key_for("attn", i) for i in range(5)]
    q = jax.random.normal(keys[0], (nb, g, h, d))
    k, v = jax.random.normal(keys[1], (2, nb, g, kv, d))
    k_ctx, v_ctx = jax.random.normal(keys[2], (2, c, kv, d))
    visible = jnp.arange(c)[None, :] < jnp.array([[0], [4], [10]])  # a block with no context, one with 4, all
    got = block_attention(q, k, v, k_ctx, v_ctx, visible)
    for b in range(nb):
        keys_b = jnp.concatenate([k_ctx[visible[b]], k[b]])  # [n, kv, d]
        vals_b = jnp.concatenate([v_ctx[visible[b]], v[b]])
        rep = h // kv
        s = jnp.einsum("qhd,nhd->hqn", q[b], jnp.repeat(keys_b, rep, axis=1)) * d**-0.5
        want = jnp.einsum("hqn,nhd->qhd", jax.nn.softmax(s, -1), jnp.repeat(vals_b, rep, axis=1))
        assert rel_err(got[b], want) < 1e-5
    hidden = ~visible[1]  # rows 4.. are hidden from blocks 0 and 1 (block 2 sees them)
    scrambled = block_attention(q, k, v, jnp.where(hidden[:, None, None], 1e6, k_ctx),
                                jnp.where(hidden[:, None, None], -1e6, v_ctx), visible)
    assert np.array_equal(np.asarray(scrambled[:2]), np.asarray(got[:2]))


def test_context_cache_holds_the_targets_features_of_committed_rows():
    """After prefill and rounds, the drafter's context rows 0..s-1 are its k/v projections of the target's own
    residual streams of the committed tokens (a forward over them all), whatever the rounds accepted."""
    model = _random_model()
    prompt = _prompt(37, 1)  # a chunked prefill (37 > VERIFY_ROWS), then rounds
    greedy = lingjax.generate(model, prompt, 40, ignore_eos=True).tokens
    oracle = _oracle(model, prompt + greedy)
    drafter = oracle.draft.drafter(oracle.draft.cfg.block_size)
    program = spec_step.spec_program(oracle, drafter, SamplingParams())
    _, state = engine.spec_prefill(oracle, program, drafter, np.asarray(prompt, np.int32), 40, jax.random.key(0))
    for _ in range(4):
        state, _ = program.round(program.weights, state)
    s = int(state.s)
    assert s > len(prompt) + 4  # some rounds accepted drafts
    seq = jnp.asarray(prompt + greedy[: s - len(prompt)], jnp.int32)
    module = oracle.module
    features_of = jax.jit(module.forward_features, static_argnums=(4, 5))
    _, _, features = features_of(seq, oracle.new_cache(s), 0, s, oracle.ex, drafter.feature_layers)
    k, v = oracle.draft.net.context_kv(features, jnp.arange(s))
    assert rel_err(state.draft.k[:, :s], k) < 1e-4 and rel_err(state.draft.v[:, :s], v) < 1e-4


# ---- lossless greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [2, BLOCK])
def test_greedy_equals_plain_greedy(steps):
    """A random drafter (almost nothing accepted) and the Markov oracle (most accepted, some rounds cut where
    its successor table is wrong), each verifying `steps` drafts of the block."""
    model = _random_model()
    prompt = _prompt(9, 2)
    plain = lingjax.generate(model, prompt, 64, ignore_eos=True).tokens
    random = lingjax.generate(model, prompt, 64, ignore_eos=True, spec="dspark", steps=steps)
    assert random.tokens == plain and all(1 <= a <= steps + 1 for a in random.accept_lens)
    oracle = _oracle(model, prompt + plain)
    result = lingjax.generate(oracle, prompt, 64, ignore_eos=True, spec="dspark", steps=steps)
    assert result.tokens == plain
    assert max(result.accept_lens) == steps + 1 and result.mean_accept_len > 2


def test_plain_greedy_does_not_depend_on_a_loaded_drafter():
    """The shipped model in bf16 with and without its drafter: the same plain greedy tokens, so `--spec dspark` is
    lossless against plain greedy from a model loaded without one. The prompt is one where a near-tie flipped
    while only the programs of a model with a drafter materialized its feature layers."""
    prompt = "import os\nclass Loader:\n    def __init__(self"
    with_draft, without = lingjax.load(), lingjax.load(draft=None)
    assert with_draft.draft is not None and without.draft is None
    plain = lingjax.generate(without, prompt, 48, ignore_eos=True).tokens
    assert lingjax.generate(with_draft, prompt, 48, ignore_eos=True).tokens == plain
    assert lingjax.generate(with_draft, prompt, 48, ignore_eos=True, spec="dspark").tokens == plain


def test_zero_accept_by_confidence_limit():
    """Survival below min_survival on every draft: the device-side limit counts none, whatever the drafts are
    (here the oracle's, right): every round emits the target's own token alone."""
    model = _random_model()
    prompt = _prompt(9, 3)
    plain = lingjax.generate(model, prompt, 30, ignore_eos=True).tokens
    doubtful = _oracle(model, prompt + plain, conf_bias=-30.0)
    result = lingjax.generate(doubtful, prompt, 30, ignore_eos=True, spec="dspark")
    assert result.tokens == plain and set(result.accept_lens) == {1}


def test_stop_inside_a_block_and_max_new_tokens_inside_a_round():
    model = _random_model()
    prompt = _prompt(8, 4)
    plain = lingjax.generate(model, prompt, 40, ignore_eos=True).tokens
    oracle = _oracle(model, prompt + plain)
    stop = plain[9]
    first = plain.index(stop)
    cut = lingjax.generate(oracle, prompt, 40, stop_ids=[stop], ignore_eos=True, spec="dspark")
    assert cut.tokens == plain[: first + 1] and cut.stop_reason == "stop"
    for n in (1, 2, 3):
        short = lingjax.generate(oracle, prompt, n, ignore_eos=True, spec="dspark")
        assert short.tokens == plain[:n]


def test_greedy_then_sampled_then_greedy_is_unpolluted():
    model = _random_model()
    prompt = _prompt(10, 6)
    first = lingjax.generate(model, prompt, 40, ignore_eos=True, spec="dspark").tokens
    sampled = [lingjax.generate(model, prompt, 40, temperature=1.2, top_k=40, seed=s, ignore_eos=True,
                                spec="dspark").tokens for s in (1, 2)]
    assert lingjax.generate(model, prompt, 40, ignore_eos=True, spec="dspark").tokens == first
    assert sampled[0] != sampled[1]
    assert lingjax.generate(model, prompt, 40, temperature=1.2, top_k=40, seed=1, ignore_eos=True,
                            spec="dspark").tokens == sampled[0]


def test_spec_dspark_needs_a_drafter_and_a_step_count_within_its_block():
    with pytest.raises(ValueError, match="DSpark drafter"):
        lingjax.generate(_target(), [1, 2, 3], 4, spec="dspark")
    with pytest.raises(ValueError, match="block size"):
        lingjax.generate(_random_model(), [1, 2, 3], 4, spec="dspark", steps=BLOCK + 1)


# ---- rejection sampling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [None, 1])
def test_rejection_sampling_keeps_the_targets_distribution(limit):
    """Drafts sampled from q: the first emitted token is distributed as p_0, and the second, given the first
    draft was accepted, as p_1; with limit 1 the second token is the bonus from p_1 itself."""
    vocab, draws = 5, 60000
    params = SamplingParams(temperature=0.9)
    logits = jax.random.normal(key_for("rs-target", limit), (3, vocab)) * 1.5
    q = jax.nn.softmax(jax.random.normal(key_for("rs-draft", limit), (2, vocab)) * 1.5, -1)
    p = np.asarray(jax.nn.softmax(logits / 0.9, -1))

    def one(key):
        k_draft, k_accept = jax.random.split(key)
        drafts = jax.random.categorical(k_draft, jnp.log(q), axis=-1).astype(jnp.int32)
        return rejection_accept(drafts, q, logits, k_accept, params, limit)

    n, tokens = jax.vmap(one)(jax.random.split(key_for("rs-draws", limit), draws))
    n, tokens = np.asarray(n), np.asarray(tokens)
    assert_frequencies(tokens[:, 0], p[0], vocab)
    assert_frequencies(tokens[n >= 1, 1], p[1], vocab)
    assert (n <= (2 if limit is None else limit)).all()


# ---- the checkpoint -------------------------------------------------------------------------------------
def test_save_load_round_trip_and_spellings(tmp_path):
    draft = _random_model().draft
    out = dspark_io.save_dspark(draft, tmp_path / "native")
    back = dspark_io.load_dspark(out, "float32", _target().cfg)
    assert back.cfg == draft.cfg
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(draft.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # the same tensors under a "model." prefix, with the shared matrices stored too, and the DSpark fields
    # nested the SpecForge way
    from safetensors.numpy import load_file, save_file

    tensors = {f"model.{k}": v for k, v in load_file(out / dspark_io.WEIGHTS_FILE).items()}
    tensors["embed_tokens.weight"] = tensors["lm_head.weight"] = np.zeros((4, 4), np.float32)
    nested = tmp_path / "nested"
    nested.mkdir()
    save_file(tensors, str(nested / "model.safetensors"))
    raw = draft.cfg.to_hf()
    inner = {k: raw.pop(k) for k in ("target_layer_ids", "mask_token_id", "markov_rank")}
    (nested / "config.json").write_text(json.dumps({**raw, "dflash_config": inner}))
    again = dspark_io.load_dspark(nested, "float32")
    assert again.cfg == draft.cfg
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(draft.params)))


def test_speculators_config():
    cfg = _config()
    raw = {"speculators_model_type": "dspark", "transformer_layer_config": {
        "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta},
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids], "mask_token_id": cfg.mask_token_id,
        "markov_rank": cfg.markov_rank, "block_size": cfg.block_size + 1, "sample_from_anchor": False}
    assert DSparkConfig.from_hf(raw) == cfg
    assert DSparkConfig.from_hf({**raw, "sample_from_anchor": True}).block_size == cfg.block_size + 1


@pytest.mark.parametrize("change, message", [
    (dict(markov_head_type="rnn"), "vanilla"),
    (dict(enable_confidence_head=False), "confidence head"),
    (dict(mask_token_id=None), "mask_token_id"),
    (dict(num_attention_heads=3, num_key_value_heads=2), "evenly"),
])
def test_config_errors(change, message):
    raw = {**_config().to_hf(), **change}
    with pytest.raises(DSparkConfigError, match=message):
        DSparkConfig.from_hf({k: v for k, v in raw.items() if v is not None})


def test_checkpoint_errors_name_the_tensor_and_file(tmp_path):
    from safetensors.numpy import load_file, save_file

    draft = _random_model().draft
    out = dspark_io.save_dspark(draft, tmp_path / "ok")
    tensors = load_file(out / dspark_io.WEIGHTS_FILE)

    def variant(name, tensors_):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((out / "config.json").read_text())
        save_file(tensors_, str(d / "model.safetensors"))
        return d

    missing = variant("missing", {k: v for k, v in tensors.items() if k != "fc.weight"})
    with pytest.raises(CheckpointError, match="fc.weight: missing"):
        dspark_io.load_dspark(missing)
    shaped = variant("shaped", {**tensors, "norm.weight": np.ones(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"norm.weight \(model.safetensors\)"):
        dspark_io.load_dspark(shaped)
    extra = variant("extra", {**tensors, "layers.9.mlp.up_proj.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(CheckpointError, match="layers.9.mlp.up_proj.weight"):
        dspark_io.load_dspark(extra)
    wider = dataclasses.replace(_target().cfg, hidden_size=_target().cfg.hidden_size * 2)
    with pytest.raises(DSparkConfigError, match="shared"):
        dspark_io.load_dspark(out, "float32", wider)


# ---- verify widths chosen on the host ------------------------------------------------------------------
def test_width_schedule_takes_the_best_expected_tokens_per_cost():
    schedule = width_schedule.WidthSchedule((2, 5, 9), (1.0, 1.5, 2.5))
    assert schedule.choose(None) == 9
    assert schedule.choose(np.full(8, 0.95)) == 9  # 8.6 / 2.5 beats 4.8 / 1.5 and 1.95
    assert schedule.choose(np.array([0.5, 0.1, 0.01, 0.001, 0, 0, 0, 0])) == 2
    assert schedule.choose(np.array([0.9, 0.8, 0.7, 0.05, 0.01, 0, 0, 0])) == 5
    flash = width_schedule.WidthSchedule.for_model(lingjax.config.preset("flash"), (2, 5, 9))
    assert flash.costs[0] < flash.costs[1] < flash.costs[2]  # more rows touch more experts
    with pytest.raises(ValueError, match="increasing"):
        width_schedule.WidthSchedule((5, 2), (1.0, 1.0))


def test_widths_switching_every_call_stay_lossless(monkeypatch):
    """Each call's width from the schedule (here cycling through all of them): the state passes between the
    widths' programs, greedy output stays plain greedy's, and each round's accept length fits its width."""
    model = _random_model()
    prompt = _prompt(9, 7)
    plain = lingjax.generate(model, prompt, 48, ignore_eos=True).tokens
    oracle = _oracle(model, prompt + plain)
    used = []

    def cycle(self, survival):
        used.append(self.widths[len(used) % len(self.widths)])
        return used[-1]

    monkeypatch.setattr(width_schedule.WidthSchedule, "choose", cycle)
    result = lingjax.generate(oracle, prompt, 48, ignore_eos=True, spec="dspark", widths=(3, BLOCK + 1))
    assert result.tokens == plain
    assert set(used) == {3, BLOCK + 1}
    assert all(a <= w for a, w in zip(result.accept_lens, used))
    with pytest.raises(ValueError, match="verify widths"):
        lingjax.generate(oracle, prompt, 4, spec="dspark", widths=(BLOCK + 2,))


def test_tensor_parallel_equals_one_device():
    """TP2: the drafter replicated beside the sharded target, its base logits gathered over the vocabulary
    shards: greedy DSpark gives plain greedy's tokens, and sampled DSpark TP1's tokens (one key on every shard)."""
    draft = _random_model().draft
    two = lingjax.load("tiny", dtype="float32", seed=3, tp=2, draft=None).with_draft(draft)
    prompt = _prompt(9, 8)
    plain = lingjax.generate(_random_model(), prompt, 24, ignore_eos=True).tokens
    assert lingjax.generate(two, prompt, 24, ignore_eos=True, spec="dspark").tokens == plain
    kwargs = dict(temperature=1.1, top_k=50, seed=3, ignore_eos=True, spec="dspark")
    assert (lingjax.generate(two, prompt, 24, **kwargs).tokens
            == lingjax.generate(_random_model(), prompt, 24, **kwargs).tokens)


def test_fp8_target_greedy_equals_plain_greedy():
    """The target's matrices in fp8 (load(weights="fp8")): the drafter reads its features, embeddings and lm_head
    alike, and greedy DSpark gives the fp8 model's own plain greedy tokens."""
    fp8 = lingjax.load("tiny", dtype="float32", seed=3, weights="fp8", draft=None).with_draft(_random_model().draft)
    assert fp8.fp8
    prompt = _prompt(9, 9)
    oracle = _oracle(fp8, prompt + lingjax.generate(fp8, prompt, 24, ignore_eos=True).tokens)
    plain = lingjax.generate(oracle, prompt, 24, ignore_eos=True).tokens
    result = lingjax.generate(oracle, prompt, 24, ignore_eos=True, spec="dspark")
    assert result.tokens == plain and result.mean_accept_len > 2


def test_markov_topk_over_the_whole_vocabulary_is_the_exact_head():
    """markov_topk = V takes every token as a candidate: the same drafts (greedy) and the same distributions
    (sampled) as the exact head; a small k keeps every draft among the base logits' top k."""
    net = _random_model().draft.net
    g, v = BLOCK, _config().vocab_size
    base = jax.random.normal(key_for("markov-base"), (g, v)) * 3
    h = jax.random.normal(key_for("markov-h"), (g, _config().hidden_size))
    first, key = jnp.int32(5), key_for("markov-key")
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.9, top_k=20)
    exact, _, conf = dspark.markov_chain(net, base, h, first, key, greedy)
    wide, _, conf_wide = dspark.markov_chain(net, base, h, first, key, greedy, topk=v)
    assert np.array_equal(np.asarray(exact), np.asarray(wide)) and np.array_equal(
        np.asarray(conf), np.asarray(conf_wide)
    )
    d_exact, q_exact, _ = dspark.markov_chain(net, base, h, first, key, sampled)
    d_wide, q_wide, _ = dspark.markov_chain(net, base, h, first, key, sampled, topk=v)
    assert np.array_equal(np.asarray(d_exact), np.asarray(d_wide)) and rel_err(q_wide, q_exact) < 1e-6
    narrow, q_narrow, _ = dspark.markov_chain(net, base, h, first, key, sampled, topk=4)
    top4 = np.asarray(jax.lax.top_k(base, 4)[1])
    assert all(int(d) in top4[k] for k, d in enumerate(np.asarray(narrow)))
    assert (np.asarray(q_narrow) > 0).sum(-1).max() <= 4 and np.allclose(np.asarray(q_narrow).sum(-1), 1, atol=1e-5)


@pytest.mark.parametrize("topk", [1, 5, dspark.TABLE_CANDIDATES])
def test_greedy_topk_table_follows_the_sequential_chain(topk):
    """Greedy drafts over the top k from the tabulated chain are the sequential argmax chain's: the two agree up
    to the first row whose choice is a tie within rounding (after it the chains legitimately part)."""
    net = _random_model().draft.net
    g, v = BLOCK, _config().vocab_size
    base = jax.random.normal(key_for("table-base"), (g, v)) * 3
    first = jnp.int32(11)
    table = np.asarray(dspark.greedy_topk_chain(net, base, first, topk))
    chain, _ = dspark._sequential_chain(net, base, first, key_for("table-key"), SamplingParams(), topk)
    chain = np.asarray(chain)
    assert table.shape == chain.shape == (g,) and table.dtype == chain.dtype == np.int32
    top = np.asarray(jax.lax.top_k(base, topk)[1])
    assert all(int(d) in top[k] for k, d in enumerate(table))
    differ = np.flatnonzero(table != chain)
    if differ.size:  # a tie: both choices score the same, in f64, after the shared previous token
        k = int(differ[0])
        prev = int(first) if k == 0 else int(chain[k - 1])
        w1, w2 = (np.asarray(x, np.float64) for x in (net.markov_w1[...], net.markov_w2[...]))
        score = lambda t: float(np.asarray(base, np.float64)[k, t] + w1[prev] @ w2[t])  # noqa: E731
        assert abs(score(table[k]) - score(chain[k])) <= 1e-4 * max(1.0, abs(score(chain[k])))
