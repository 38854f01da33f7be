"""The shipped model (checkpoints/ling-code-tiny) against HF transformers' logits for it
(tests/fixtures/shipped_reference, made by tests/make_shipped_reference.py), and its MTP layer drafting
tokens the target accepts."""

import json
from pathlib import Path

import numpy as np
from make_shipped_reference import weights_sha256

import lingjax
from conftest import rel_err
from lingjax.shipped import DEFAULT_CHECKPOINT

REFERENCE = Path(__file__).parent / "fixtures" / "shipped_reference"
HF_F32_TOL = 1e-4  # × max |HF logit|, as tests/test_parity.py: f32 against torch's f32


def test_shipped_checkpoint_matches_hf():
    meta = json.loads((REFERENCE / "reference.json").read_text())
    assert meta["weights_sha256"] == weights_sha256(DEFAULT_CHECKPOINT), (
        "checkpoints/ling-code-tiny changed: remake its reference with tests/make_shipped_reference.py")
    ref = np.load(REFERENCE / "hf_logits.npz")
    model = lingjax.load(dtype="float32")
    logits = model.logits(ref["prompt_ids"])
    assert logits.shape[0] == ref["argmax"].shape[0] == meta["prompt_tokens"]
    assert rel_err(logits[-ref["logits"].shape[0]:], ref["logits"]) <= HF_F32_TOL
    assert (logits.argmax(-1) == ref["argmax"]).all()


def test_shipped_mtp_drafts_are_accepted_and_lossless():
    """Greedy NEXTN on a held-out-style prompt: the trained MTP layer's drafts are mostly right (random ones
    accept about 1.0 tokens a round), and the tokens are plain greedy's."""
    model = lingjax.load(dtype="float32")
    prompt = "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n"
    plain = lingjax.generate(model, prompt, 48, ignore_eos=True)
    spec = lingjax.generate(model, prompt, 48, ignore_eos=True, spec="nextn", steps=3)
    assert spec.tokens == plain.tokens
    assert spec.mean_accept_len > 1.8, spec.accept_lens


def test_shipped_dspark_drafts_are_accepted_and_lossless():
    """Greedy DSpark with the shipped drafter (load's draft="auto", the shipped model named by its path) on the same
    prompt: its blocks are mostly right (a random drafter accepts about 1.0 tokens a round), and the tokens are
    plain greedy's."""
    model = lingjax.load(DEFAULT_CHECKPOINT, dtype="float32")
    assert model.draft is not None and model.draft.cfg.block_size == 15
    prompt = "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n"
    plain = lingjax.generate(model, prompt, 48, ignore_eos=True)
    spec = lingjax.generate(model, prompt, 48, ignore_eos=True, spec="dspark")
    assert spec.tokens == plain.tokens
    assert spec.mean_accept_len > 2.0, spec.accept_lens
