"""Parity with the HF reference (transformers 5.23.0 BailingHybridForCausalLM) on the fixtures
made by tests/make_fixtures.py: logits in f32 and bf16, 32 greedy tokens, decode-step logits."""

import functools

import numpy as np
import pytest

import lingjax
from conftest import rel_err

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # × max |reference logit|


@functools.cache
def _model(directory, dtype):
    return lingjax.load(directory, dtype=dtype)


def _reference(directory):
    return np.load(directory / "reference.npz")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_hf(hf_fixture, dtype):
    ref = _reference(hf_fixture)
    logits = _model(hf_fixture, dtype).logits(ref["prompt_ids"])
    assert logits.shape == ref["logits"].shape and logits.dtype == np.float32
    assert rel_err(logits, ref["logits"]) <= TOLERANCE[dtype]


def test_greedy_tokens_match_hf(hf_fixture):
    ref = _reference(hf_fixture)
    result = lingjax.generate(_model(hf_fixture, "float32"), ref["prompt_ids"], 32, ignore_eos=True)
    assert result.tokens == ref["greedy_tokens"].tolist()
    assert result.stop_reason == "length"


def test_decode_step_logits_match_full_forward(hf_fixture):
    ref = _reference(hf_fixture)
    model = _model(hf_fixture, "float32")
    sequence = np.concatenate([ref["prompt_ids"], ref["greedy_tokens"][:-1]])
    prompt_len = ref["prompt_ids"].size
    stepped = model.incremental_logits(sequence, prompt_len)
    full = model.logits(sequence)[prompt_len - 1 :]
    assert rel_err(stepped, full) <= TOLERANCE["float32"]
    assert rel_err(stepped, ref["decode_logits"]) <= TOLERANCE["float32"]


def test_bf16_router_keeps_parity(hf_fixture):
    """The declared bf16 router: the fixtures' routing margins survive its rounding, so the logits stay
    within the bf16 tolerance and the greedy tokens are unchanged."""
    ref = _reference(hf_fixture)
    model = _model(hf_fixture, "float32").variant(router_precision="bf16")
    assert rel_err(model.logits(ref["prompt_ids"]), ref["logits"]) <= TOLERANCE["bfloat16"]
    assert lingjax.generate(model, ref["prompt_ids"], 32, ignore_eos=True).tokens == ref["greedy_tokens"].tolist()
