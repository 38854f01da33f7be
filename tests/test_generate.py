"""The generation loop and the command line."""

import functools

import numpy as np
import pytest

import lingjax
from conftest import rel_err
from lingjax import engine as engine
from lingjax.config import VERIFY_ROWS
from lingjax.spec import step as spec_step


@functools.cache
def _tiny(dtype="float32"):
    return lingjax.load("tiny", dtype=dtype, seed=3)


def _full_forward_argmax(model, prompt, tokens):
    """The argmax after each prefix of prompt + tokens, from one full forward of prompt + tokens[:-1]
    (teacher forcing): equal to `tokens` exactly when `tokens` are the greedy continuation (one compile,
    where a forward per generated token compiled each length)."""
    logits = np.asarray(model.logits(list(prompt) + list(tokens[:-1])))
    return np.argmax(logits[len(prompt) - 1:], axis=-1).tolist()


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


def test_greedy_equals_full_forward_argmax():
    model = _tiny()
    prompt = _prompt(11)
    result = lingjax.generate(model, prompt, 12, ignore_eos=True)
    assert len(result.tokens) == 12 and result.tokens == _full_forward_argmax(model, prompt, result.tokens)
    assert len(result.token_times_s) == 12 and result.ttft_s > 0 and result.tpot_mean_s > 0


def test_prompt_longer_than_one_prefill_chunk():
    model = _tiny()
    prompt = _prompt(3 * 64 + 37, seed=1)
    result = lingjax.generate(model, prompt, 3, ignore_eos=True, prefill_chunk=64)  # three chunk boundaries
    assert len(result.tokens) == 3 and result.tokens == _full_forward_argmax(model, prompt, result.tokens)


@pytest.mark.parametrize("rounds", [2, 3])
def test_decode_steps_per_call_same_tokens(rounds):
    """rounds_per_call decode steps in one call (a lax.scan) give one step per call's tokens: greedy,
    sampled (keys fold in the position), a stop inside a call, max_new_tokens inside a call."""
    model = _tiny()
    prompt = _prompt(13, seed=4)
    one = lingjax.generate(model, prompt, 20, ignore_eos=True).tokens
    assert lingjax.generate(model, prompt, 20, ignore_eos=True, rounds_per_call=rounds).tokens == one
    sampled = [lingjax.generate(model, prompt, 20, temperature=1.2, seed=7, ignore_eos=True, rounds_per_call=r).tokens
               for r in (1, rounds)]
    assert sampled[0] == sampled[1]
    stop = one[rounds + 2]  # inside the second call
    cut = lingjax.generate(model, prompt, 20, stop_ids=[stop], ignore_eos=True, rounds_per_call=rounds)
    assert cut.tokens == one[: one.index(stop) + 1] and cut.stop_reason == "stop"
    short = lingjax.generate(model, prompt, rounds + 2, ignore_eos=True, rounds_per_call=rounds)
    assert short.tokens == one[: rounds + 2] and short.stop_reason == "length"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_new_tokens(n):
    result = lingjax.generate(_tiny(), _prompt(5), n, ignore_eos=True)
    assert len(result.tokens) == n and result.stop_reason == "length"


def test_stop_ids_cut_generation():
    model = _tiny()
    prompt = _prompt(6, seed=2)
    full = lingjax.generate(model, prompt, 10, ignore_eos=True).tokens
    stop = full[4]
    cut = full.index(stop) + 1  # the first occurrence
    result = lingjax.generate(model, prompt, 10, stop_ids=[stop], ignore_eos=True)
    assert result.tokens == full[:cut] and result.stop_reason == "stop"


def test_eos_stops_unless_ignored():
    """The tokenizer's stop ids end generation (the config's EOS ids for a model without a tokenizer),
    unless ignore_eos."""
    import dataclasses

    from lingjax.tokenizer import Tokenizer

    model = _tiny()
    prompt = _prompt(6, seed=2)
    full = lingjax.generate(model, prompt, 10, ignore_eos=True).tokens
    cut = full[: full.index(full[2]) + 1]
    with_tokenizer = model.variant()
    with_tokenizer.tokenizer = Tokenizer.byte_level(dataclasses.replace(model.cfg, eos_token_ids=(full[2],)))
    without = model.variant()
    without.cfg, without.tokenizer = dataclasses.replace(model.cfg, eos_token_ids=(full[2],)), None
    for eos_model in (with_tokenizer, without):
        result = lingjax.generate(eos_model, prompt, 10)
        assert result.tokens == cut and result.stop_reason == "stop"
        assert lingjax.generate(eos_model, prompt, 10, ignore_eos=True).tokens == full


def test_sampling_is_seeded_and_respects_top_k():
    model = _tiny()
    prompt = _prompt(7, seed=4)
    a = lingjax.generate(model, prompt, 16, temperature=1.5, seed=11, ignore_eos=True).tokens
    b = lingjax.generate(model, prompt, 16, temperature=1.5, seed=11, ignore_eos=True).tokens
    c = lingjax.generate(model, prompt, 16, temperature=1.5, seed=12, ignore_eos=True).tokens
    assert a == b and a != c
    greedy = lingjax.generate(model, prompt, 16, ignore_eos=True).tokens
    assert lingjax.generate(model, prompt, 16, temperature=0.7, top_k=1, seed=5, ignore_eos=True).tokens == greedy
    top3 = lingjax.generate(model, prompt, 1, temperature=5.0, top_k=3, seed=9, ignore_eos=True).tokens[0]
    assert top3 in np.argsort(-model.logits(prompt)[-1])[:3]


def test_host_reads_go_through_host_read(monkeypatch):
    reads = []
    original = engine.host_read
    monkeypatch.setattr(engine, "host_read", lambda x: reads.append(1) or original(x))
    result = lingjax.generate(_tiny(), _prompt(5), 6, ignore_eos=True)
    assert len(reads) == len(result.tokens) == 6  # one read per token, nothing else


@pytest.mark.parametrize("kwargs, error", [
    (dict(prompt=[], max_new_tokens=3), "empty"),
    (dict(prompt=[1, 512], max_new_tokens=3), "outside the vocabulary"),
    (dict(prompt=[1], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt=[1], max_new_tokens=2, rounds_per_call=0), "rounds_per_call must be an integer >= 1"),
    (dict(prompt=[1], max_new_tokens=2, spec="nextn", rounds_per_call=0), "rounds_per_call must be an integer"),
    (dict(prompt=[1], max_new_tokens=2, temperature=-1.0), "temperature"),
    (dict(prompt=[1], max_new_tokens="10"), "max_new_tokens must be an integer >= 1, got '10'"),
    (dict(prompt=[1], max_new_tokens=2, seed=2**70), r"seed must be an integer in \[0, 2\*\*63\)"),
    (dict(prompt=[1], max_new_tokens=2, seed=-1), "seed"),
    (dict(prompt=[1], max_new_tokens=2, temperature=1.0, top_k=10**9), "top_k .* at most the vocabulary's 512"),
    (dict(prompt=[1], max_new_tokens=2, on_text="x"), "on_text must be a callable"),
    (dict(prompt=[1], max_new_tokens=2, on_token=3), "on_token must be a callable"),
    (dict(prompt="a\udcff", max_new_tokens=2), "not valid UTF-8"),
])
def test_bad_requests(kwargs, error, monkeypatch):
    """Refused before any program is built or run."""
    model = _tiny()
    monkeypatch.setattr(model, "step_programs", lambda *a, **k: pytest.fail("a program was built"))
    monkeypatch.setattr(spec_step, "SpecProgram", lambda *a, **k: pytest.fail("a program was built"))
    with pytest.raises(ValueError, match=error):
        lingjax.generate(model, **kwargs)


def test_chat_roles_are_checked():
    from lingjax.chat_template import ChatError

    with pytest.raises(ChatError, match="role must be one of system, user, assistant, tool, got 'bogus'"):
        lingjax.chat(_tiny(), [{"role": "bogus", "content": "hi"}], 2)


def _poisoned(model, leaf: str):
    """model's weights with the leaf whose path ends in `leaf` (the target's, not the MTP layer's) all NaN."""
    import jax

    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(model.params)]
    (index,) = [i for i, p in enumerate(paths) if p.endswith(leaf) and "mtp" not in p]
    model.weights = tuple(w * np.nan if i == index else w for i, w in enumerate(model.weights))
    return model


@pytest.mark.parametrize("kwargs", [dict(), dict(spec="nextn", steps=2), dict(temperature=1.0),
                                    dict(spec="nextn", steps=2, temperature=1.0)],
                         ids=["greedy", "nextn", "sampled", "nextn sampled"])
def test_nonfinite_logits_stop_generation_with_an_error(kwargs):
    """NaN logits are flagged on the device with the tokens (lingjax.sampling.NONFINITE) and stop the generation
    with an error, in the plain and the speculative loop, greedy and sampled; no token is returned."""
    model = _poisoned(lingjax.load("tiny", dtype="float32", seed=3), "['final_norm'].value")
    tokens = []
    with pytest.raises(engine.NonFiniteLogits, match="NaN or infinite values at new token 1"):
        lingjax.generate(model, _prompt(4), 4, on_token=tokens.append, **kwargs)
    assert tokens == []


def test_compile_time_is_reported_only_when_spent():
    model = lingjax.load("tiny", dtype="float32", seed=5)
    first = lingjax.generate(model, _prompt(3), 3, ignore_eos=True)
    again = lingjax.generate(model, _prompt(3), 3, ignore_eos=True)
    assert 0 < first.compile_s <= first.total_s and again.compile_s == 0.0
    assert again.tokens == first.tokens


def test_pallas_kernels_give_the_same_model():
    """kernels="pallas" (interpret mode on the CPU) against the XLA references, decode and prefill."""
    xla = _tiny()
    pallas = xla.variant(kernels="pallas")
    prompt = _prompt(40, 8)  # > VERIFY_ROWS: the chunked-prefill kernel; then decode steps
    assert rel_err(pallas.logits(prompt), xla.logits(prompt)) < 1e-4
    assert rel_err(pallas.incremental_logits(prompt, 36), xla.incremental_logits(prompt, 36)) < 1e-4


def test_kernel_set_auto_and_bad_names():
    """"auto" is Pallas on a GPU and the XLA references elsewhere; a bad name lists the choices."""
    import jax

    from lingjax import kernels, target

    model = lingjax.load("tiny")
    assert model.kernels == "xla" and lingjax.Model(model.module).kernels == "xla"  # CPU here
    with target.compile_for("gpu", jax.devices()):
        assert kernels.resolve("auto") == "pallas" and kernels.resolve("xla") == "xla"
    with pytest.raises(ValueError, match="auto.*xla.*pallas"):
        lingjax.load("tiny", kernels="triton")


def test_xla_ops_override_one_kernel():
    """xla_ops puts single ops of the Pallas set back on their XLA references (step_bench --xla-ops)."""
    import dataclasses

    from lingjax import kernels
    from lingjax.ops import moe

    base = _tiny()
    mixed = base.variant(kernels="pallas", xla_ops=("moe_route",))
    assert mixed.ex.op("moe_route").__wrapped__ is moe.route  # the reference, any stacked weight sliced
    assert mixed.ex.runs_pallas("moe_experts") and not mixed.ex.runs_pallas("moe_route")
    prompt, prompt_len = _prompt(40, 8), 36  # test_pallas_kernels_give_the_same_model's: its XLA programs and logits
    want = base.incremental_logits(prompt, prompt_len)
    calls = []
    real_route = moe.route
    with pytest.MonkeyPatch.context() as mp:  # decode (T = 1) routes on the reference too, not in the up kernel
        spy = lambda x, *a, **kw: calls.append(x.shape[0]) or real_route(x, *a, **kw)  # noqa: E731
        mp.setitem(kernels.OPS, "moe_route", dataclasses.replace(kernels.OPS["moe_route"], reference=spy))
        assert rel_err(mixed.incremental_logits(prompt, prompt_len), want) < 1e-4
    assert VERIFY_ROWS in calls  # a T = 1 decode's padded rows, besides the 36-token extend
    experts_on_xla = base.variant(kernels="pallas", xla_ops=("moe_experts",))
    # no Pallas-only options reach it
    assert rel_err(experts_on_xla.incremental_logits(prompt, prompt_len), want) < 1e-4
    with pytest.raises(ValueError, match="unknown ops.*moe_route"):
        base.variant(kernels="pallas", xla_ops=("moe_rout",))
