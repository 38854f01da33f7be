"""Speculative decoding: lossless greedy output, acceptance rules, KDA staging/commit, the host loop."""

import collections
import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import lingjax
from conftest import FIXTURES, assert_frequencies, key_for, rel_err
from lingjax import engine
from lingjax.cache import commit, conv_ring_size
from lingjax.ops.kda import ring_slots, ring_window
from lingjax.sampling import SamplingParams
from lingjax.spec import step as spec_step
from lingjax.spec.accept import greedy_accept, target_only_accept
from lingjax.spec.drafters import ReplayDrafter
from lingjax.spec.step import SpecState


@functools.cache
def _tiny():
    return lingjax.load("tiny", dtype="float32", seed=3)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


# ---- lossless greedy ------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 7])  # S = 3: the bf16 test; 5: the HF fixture's
def test_nextn_greedy_equals_plain_greedy_128_tokens(steps):
    model = _tiny()
    # two prompts, one past VERIFY_ROWS; both pad to the smallest prefill bucket (32 rows): one prefill
    # program per drafter serves both
    for seed, length in [(0, 9), (1, 29)]:
        prompt = _prompt(length, seed)
        plain = lingjax.generate(model, prompt, 128, ignore_eos=True).tokens
        spec = lingjax.generate(model, prompt, 128, ignore_eos=True, spec="nextn", steps=steps)
        assert spec.tokens == plain
        assert len(spec.accept_lens) >= 1 and all(1 <= a <= steps + 1 for a in spec.accept_lens)
        # partly right drafts: accept lengths vary, every commit row gets used
        oracle = ReplayDrafter.replaying(model, prompt, plain, steps, corrupt_every=3)
        mixed = lingjax.generate(model, prompt, 128, ignore_eos=True, drafter=oracle)
        assert mixed.tokens == plain
        if steps > 1:
            assert len(set(mixed.accept_lens)) > 1


@functools.cache
def _tiny_bf16():
    return lingjax.load("tiny", dtype="bfloat16", seed=3)


_REDUCING = {"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin", "dot_general", "cumsum"}


def _layer_reductions(jaxpr, scope=""):
    """(primitive, operand shapes, scope from the layer on) of every reduction or GEMM of the model's layers
    outside the Pallas kernels (a kernel's arithmetic per row is its own test's business)."""
    out = collections.Counter()
    for eqn in jaxpr.eqns:
        here = f"{scope}/{eqn.source_info.name_stack}"
        if eqn.primitive.name == "pallas_call":
            continue
        if eqn.primitive.name in _REDUCING and "layer" in here and "draft" not in here:
            shapes = tuple(tuple(v.aval.shape) for v in eqn.invars)
            out[eqn.primitive.name, shapes, here[here.index("layer"):]] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _layer_reductions(sub, here)
    return out


def test_decode_and_verify_reduce_alike():
    """Row invariance needs every reduction and GEMM outside the Pallas kernels to see the same shapes in a T=1
    decode as in a verify: XLA picks a summation order by shape, and on the H200 a reduce over [T, k, D]
    (the experts' k-slot sum) summed a token's row differently at T = 1 and T = 4
    (bench/results/kernels/moe_h200_2026-12-01_run4.md). The CPU sums alike either way, so this compares the
    programs' shapes: the decode program's layers against the speculative round's verify (the MTP drafts
    need no invariance). The Pallas set only: the plain-JAX references run the recurrence and the experts
    on T-shaped einsums (lingjax/kernels.py: the Pallas set is the one measured lossless in bf16 on the GPU)."""
    model = lingjax.load("tiny", dtype="bfloat16", seed=3, kernels="pallas")
    cache = jax.eval_shape(lambda: model.new_cache(64))
    i32, key = jax.ShapeDtypeStruct((), jnp.int32), jax.eval_shape(lambda: jax.random.key(0))
    _, decode = model.step_programs(SamplingParams(), 1)
    drafter = engine.make_drafter(model, "nextn", 3)
    state = SpecState(cache=cache, draft=jax.eval_shape(lambda: drafter.init(model.module, 64)), s=i32, bonus=i32,
                      round=i32, key=key)
    program = spec_step.spec_program(model, drafter, SamplingParams(), 1)
    in_decode = _layer_reductions(jax.make_jaxpr(decode)(model.weights, cache, i32, i32, key).jaxpr)
    in_round = _layer_reductions(jax.make_jaxpr(program.round)(program.weights, state).jaxpr)
    assert in_decode, "no layer reductions found: the scope names changed?"
    assert in_decode == in_round, (in_decode - in_round, in_round - in_decode)


@pytest.mark.parametrize("steps", [3])
def test_bf16_greedy_spec_equals_plain_128_tokens(steps):
    """In bf16 a verify row rounds exactly as the T=1 decode of that token (row invariance, see
    lingjax/model.py): one M=1 GEMM against an M=4 one already changes the tokens. (S = 1, a verify of
    T = 2: in f32 above; every row-wise op runs on the same 16 rows at any T.)"""
    model = _tiny_bf16()
    for seed, length in [(0, 11), (1, 29)]:  # as above: one prefill bucket
        prompt = _prompt(length, seed)
        plain = lingjax.generate(model, prompt, 128, ignore_eos=True).tokens
        assert lingjax.generate(model, prompt, 128, ignore_eos=True, spec="nextn", steps=steps).tokens == plain
        # the MTP drafts of a random model are rarely right: the oracle's make the later rows count
        oracle = ReplayDrafter.replaying(model, prompt, plain, steps, corrupt_every=3)
        mixed = lingjax.generate(model, prompt, 128, ignore_eos=True, drafter=oracle)
        assert mixed.tokens == plain
        if steps > 1:
            assert len(set(mixed.accept_lens)) > 1 and max(mixed.accept_lens) > 2


@pytest.mark.parametrize("steps", [1, 5])  # S = 3 and 7 against plain greedy above
def test_nextn_greedy_matches_hf_fixture(steps):
    directory = FIXTURES / "tiny_c"  # the fixture that carries MTP tensors
    ref = np.load(directory / "reference.npz")
    model = lingjax.load(directory, dtype="float32")
    result = lingjax.generate(model, ref["prompt_ids"], 32, ignore_eos=True, spec="nextn", steps=steps)
    assert result.tokens == ref["greedy_tokens"].tolist()


def test_perfect_draft_accepts_everything():
    model, steps = _tiny(), 5
    prompt = _prompt(12, 2)
    plain = lingjax.generate(model, prompt, 64, ignore_eos=True).tokens
    replay = ReplayDrafter.replaying(model, prompt, plain, steps)
    result = lingjax.generate(model, prompt, 64, ignore_eos=True, drafter=replay)
    assert result.tokens == plain
    assert result.accept_lens[:-1] == [steps + 1] * (len(result.accept_lens) - 1)
    assert len(result.accept_lens) == 1 + -(-(64 - 1) // (steps + 1)) - 1 or result.accept_lens[-1] == steps + 1


def test_zero_accept_every_round():
    model, steps = _tiny(), 4
    prompt = _prompt(12, 3)
    plain = lingjax.generate(model, prompt, 40, ignore_eos=True).tokens
    wrong = ReplayDrafter.replaying(model, prompt, plain, steps, corrupt_every=1)
    result = lingjax.generate(model, prompt, 40, ignore_eos=True, drafter=wrong)
    assert result.tokens == plain and set(result.accept_lens) == {1}


def test_stop_token_inside_accepted_draft():
    model, steps = _tiny(), 5
    prompt = _prompt(8, 4)
    plain = lingjax.generate(model, prompt, 40, ignore_eos=True).tokens
    stop_at = 9  # 1 prefill token + one full round of 6 + 2 into the next round
    stop = plain[stop_at]
    first = plain.index(stop)
    result = lingjax.generate(model, prompt, 40, stop_ids=[stop], ignore_eos=True,
                              drafter=ReplayDrafter.replaying(model, prompt, plain, steps))
    assert result.tokens == plain[: first + 1] and result.stop_reason == "stop"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_new_tokens_inside_a_round(n):
    model = _tiny()
    prompt = _prompt(6, 5)
    plain = lingjax.generate(model, prompt, n, ignore_eos=True).tokens
    replay = ReplayDrafter.replaying(model, prompt, plain * 3, 5)
    spec = lingjax.generate(model, prompt, n, ignore_eos=True, drafter=replay)
    assert spec.tokens == plain and len(spec.tokens) == n


# ---- several rounds per device call ----------------------------------------------------------------
@pytest.mark.parametrize("rounds", [3])
def test_rounds_per_call_same_tokens_and_accept_lengths(rounds):
    """R rounds in one call (a lax.scan) give the tokens and per-round accept lengths of one round per
    call: with varying accept lengths, a stop inside the second round of a call, max_new_tokens
    inside a call, and sampling (keys fold in the round count, not the call)."""
    # S = 7 with corrupt_every=3: the oracle of test_nextn_greedy_equals_plain_greedy_128_tokens[7] (the same
    # cache capacity), whose one-round program this shares
    model, steps = _tiny(), 7
    prompt = _prompt(11, 8)
    plain = lingjax.generate(model, prompt, 60, ignore_eos=True).tokens
    oracle = ReplayDrafter.replaying(model, prompt, plain, steps, corrupt_every=3)
    one = lingjax.generate(model, prompt, 60, ignore_eos=True, drafter=oracle)
    many = lingjax.generate(model, prompt, 60, ignore_eos=True, drafter=oracle, rounds_per_call=rounds)
    assert many.tokens == one.tokens == plain
    assert many.accept_lens == one.accept_lens and len(set(one.accept_lens)) > 1
    # a stop in the second round of the first call: later rounds of that call ran but do not count
    stop_at = 1 + one.accept_lens[0] + 1
    first = plain.index(plain[stop_at])
    cut = [lingjax.generate(model, prompt, 60, stop_ids=[plain[stop_at]], ignore_eos=True, drafter=oracle,
                            rounds_per_call=r) for r in (1, rounds)]
    assert cut[0].tokens == cut[1].tokens == plain[: first + 1] and cut[1].stop_reason == "stop"
    assert cut[0].accept_lens == cut[1].accept_lens
    short = lingjax.generate(model, prompt, 7, ignore_eos=True, drafter=oracle, rounds_per_call=rounds)
    assert short.tokens == plain[:7] and sum(short.accept_lens) >= 6 > sum(short.accept_lens[:-1])
    # NEXTN sampling as test_greedy_then_sampled_then_greedy_is_unpolluted samples (its one-round program)
    sampled = [lingjax.generate(model, prompt, 40, temperature=1.3, top_p=0.9, seed=5, ignore_eos=True, spec="nextn",
                                steps=3, rounds_per_call=r).tokens for r in (1, rounds)]
    assert sampled[0] == sampled[1]


def test_greedy_then_sampled_then_greedy_is_unpolluted():
    model = _tiny()
    prompt = _prompt(10, 6)
    first = lingjax.generate(model, prompt, 48, ignore_eos=True, spec="nextn", steps=3).tokens
    sampled = [lingjax.generate(model, prompt, 48, temperature=1.3, top_p=0.9, seed=s, ignore_eos=True,
                                spec="nextn", steps=3).tokens for s in (1, 2)]
    again = lingjax.generate(model, prompt, 48, ignore_eos=True, spec="nextn", steps=3).tokens
    assert again == first and sampled[0] != sampled[1]
    repeat = lingjax.generate(model, prompt, 48, temperature=1.3, top_p=0.9, seed=1, ignore_eos=True,
                              spec="nextn", steps=3).tokens
    assert repeat == sampled[0]


def test_speculation_without_mtp_layer_fails_clearly():
    model = lingjax.load(FIXTURES / "tiny_a", dtype="float32")
    with pytest.raises(ValueError, match="MTP layer"):
        lingjax.generate(model, [1, 2, 3], 4, spec="nextn")


# ---- acceptance rules --------------------------------------------------------------------------
def _one_hot_logits(targets, vocab=8):
    return jnp.where(jnp.arange(vocab)[None, :] == jnp.asarray(targets)[:, None], 5.0, 0.0)


@pytest.mark.parametrize("drafts, targets, n, emitted", [
    ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all accepted, bonus from the last row
    ([5, 2, 3], [1, 2, 3, 4], 0, [1]),  # first rejected: the target's own token
    ([1, 2, 7], [1, 2, 3, 4], 2, [1, 2, 3]),  # last rejected
    ([1, 6, 3], [1, 2, 3, 4], 1, [1, 2]),  # a later match after a mismatch does not count
])
def test_greedy_accept_table(drafts, targets, n, emitted):
    got_n, tokens = greedy_accept(jnp.asarray(drafts, jnp.int32), _one_hot_logits(targets))
    assert int(got_n) == n and tokens[: n + 1].tolist() == emitted


def test_target_only_accept_is_lossless():
    """The first emitted token is distributed as the target's p_0 whatever the draft proposes."""
    vocab, draws = 6, 40000
    logits = jax.random.normal(key_for("accept-logits"), (3, vocab)) * 1.5
    params = SamplingParams(temperature=0.8)
    p0 = np.asarray(jax.nn.softmax(logits[0] / 0.8))
    for draft in (int(np.argmax(p0)), int(np.argmin(p0))):
        drafts = jnp.asarray([draft, 2], jnp.int32)
        keys = jax.random.split(key_for("accept-draws", draft), draws)
        _, tokens = jax.vmap(lambda k: target_only_accept(drafts, logits, k, params))(keys)
        assert_frequencies(tokens[:, 0], p0, vocab)


# ---- KDA staging and commit ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 2, 5])
def test_verify_then_commit_equals_sequential_decode(n):
    """Commit of row n after a verify over [b, d_1..d_5] leaves the caches exactly as decoding
    b, d_1..d_n one token at a time; staged rows past n are never read (poisoned with NaN), and neither
    are the conv ring slots of the rejected positions (poisoned too; the next forward must stay finite
    and match the sequential one)."""
    model = _tiny()
    module = model.module
    prompt = _prompt(20, 7)
    window = _prompt(6, 8)
    forward, verify = jax.jit(module.forward), jax.jit(module.verify)
    cache = model.new_cache(64)
    _, cache = forward(jnp.asarray(prompt, jnp.int32), cache, 0, len(prompt))
    hidden, verified, staging, _ = verify(jnp.asarray(window, jnp.int32), cache, len(prompt))
    end = len(prompt) + n + 1  # the committed length
    rejected = ring_slots(end, len(window) - n - 1, conv_ring_size(model.cfg))
    poisoned = tuple(None if st is None else dataclasses.replace(
        st, states=st.states.at[n + 1:].set(jnp.nan), conv=st.conv.at[rejected].set(jnp.nan))
        for st in staging)
    committed = commit(verified, poisoned, jnp.int32(n))
    seq = cache
    rows = []
    for i in range(n + 1):
        h, seq = forward(jnp.asarray(window[i : i + 1], jnp.int32), seq, len(prompt) + i, 1)
        rows.append(h[0])
    # f32: the verify's M=6 GEMMs and the decode's M=1 GEMMs round differently, and that compounds over
    # the layers and up to 6 recurrent steps (measured up to 1.5e-5); a wrong row or commit is O(1)
    for got, want in zip(committed.layers, seq.layers):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            if a.shape[0] == 64:  # MLA latent cache: compare the committed prefix
                a, b = a[: len(prompt) + n + 1], b[: len(prompt) + n + 1]
            elif a.ndim == 3 and a.shape[1] == 3:  # KDA conv ring: the window of the next position
                width = model.cfg.conv_size
                a, b = (ring_window(r.reshape(r.shape[0], -1), end, width) for r in (a, b))
            assert rel_err(a, b) < 5e-5
    assert rel_err(hidden[: n + 1], jnp.stack(rows)) < 5e-5
    token = jnp.asarray(_prompt(1, 9), jnp.int32)
    (h_got, _), (h_want, _) = forward(token, committed, end, 1), forward(token, seq, end, 1)
    assert rel_err(h_got, h_want) < 5e-5  # rel_err fails on NaN


# ---- the host loop ---------------------------------------------------------------------------------
def test_host_loop_reads_only_through_host_read_and_runs_ahead(monkeypatch):
    """Every device->host read in the steady-state loop goes through engine.host_read, once per
    round, and round k+1 is dispatched before round k's output is read. A read anywhere else (int(),
    np.asarray, .item() on a device array) raises here; on the CPU backend jax.transfer_guard cannot
    see such reads, so this test watches the array type itself."""
    from jax._src.array import ArrayImpl

    model = _tiny()
    prompt = _prompt(9, 9)
    lingjax.generate(model, prompt, 30, ignore_eos=True, spec="nextn", steps=3)  # compile first
    program = spec_step.spec_program(model, engine.make_drafter(model, "nextn", 3), SamplingParams())
    events, allowed = [], [False]

    def forbid(name):
        original = getattr(ArrayImpl, name)

        def guarded(self, *args, **kwargs):
            if not allowed[0]:
                raise AssertionError(f"blocking device->host read through ArrayImpl.{name} outside host_read")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(ArrayImpl, name, guarded)

    for name in ("__array__", "__int__", "__float__", "__bool__", "__index__", "item", "tolist"):
        forbid(name)
    real_read = engine.host_read

    def watched_read(x):
        events.append("read")
        allowed[0] = True
        try:
            return real_read(x)
        finally:
            allowed[0] = False

    real_round = program.round
    monkeypatch.setattr(engine, "host_read", watched_read)
    monkeypatch.setattr(program, "round", lambda *a: events.append("round") or real_round(*a))
    # the host builds the prompt chunks from numpy, never from device arrays
    result = lingjax.generate(model, prompt, 30, ignore_eos=True, spec="nextn", steps=3)
    rounds, reads = events.count("round"), events.count("read")
    assert reads in (rounds, rounds + 1)  # the first token, then one read per round (the last may be dropped)
    # round k+1 is launched before round k's output is read: every read but the last follows a launch
    assert all(events[i - 1] == "round" for i, e in enumerate(events[:-1]) if e == "read"), events
    assert len(result.tokens) == 30


@pytest.mark.parametrize("bad", [dict(spec="eagle"), dict(spec="nextn", steps=0), dict(spec="nextn", steps=16),
                                 dict(spec="nextn", rounds_per_call=0), dict(rounds_per_call=0)])
def test_bad_spec_arguments(bad):
    with pytest.raises(ValueError):
        lingjax.generate(_tiny(), [1, 2], 4, **bad)
