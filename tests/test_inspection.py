"""lingjax.inspection on the shipped model: a token-by-token walk's routing, KDA state and MLA attention have the
shapes and invariants the model implies (softmax rows, causality, group-limited routing) and its greedy next
tokens are the engine's; speculation round by round gives the greedy tokens."""

import numpy as np
import pytest

import lingjax
from lingjax import engine, inspection


@pytest.fixture(scope="module")
def shipped():
    return lingjax.load()


def test_walk_invariants(shipped):
    cfg = shipped.cfg
    ids = shipped.tokenizer.encode("def add(a, b):")
    walk = inspection.walk(shipped, ids)
    t, k = len(ids), cfg.num_experts_per_tok
    assert walk.hidden.shape == (t, len(cfg.layer_types), cfg.hidden_size) and np.isfinite(walk.hidden).all()
    assert sorted(walk.experts) == [i for i, m in enumerate(cfg.mlp_types) if m == "moe"]
    load = walk.expert_load()
    assert load.shape == (len(walk.experts), cfg.num_experts) and (load.sum(1) == t * k).all()
    per_group = cfg.num_experts // cfg.n_group
    for layer, chosen in walk.experts.items():
        assert chosen.shape == (t, k) and all(len(set(row)) == k for row in chosen.tolist())
        assert (walk.groups[layer] == chosen // per_group).all()
        assert max(len(set(row)) for row in walk.groups[layer].tolist()) <= cfg.topk_group
    for layer, norms in walk.kda_state_norm.items():
        assert cfg.layer_types[layer] == "kda" and norms.shape == (t, cfg.kda_num_heads)
        assert np.isfinite(norms).all() and (norms > 0).all()
    for layer, weights in walk.mla_attention.items():
        assert cfg.layer_types[layer] == "mla" and weights.shape == (t, cfg.num_heads, t)
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
        assert (weights[np.triu_indices(t, 1)[0], :, np.triu_indices(t, 1)[1]] == 0).all()  # no look ahead
    first = engine.generate(shipped, np.array(ids), max_new_tokens=1).tokens[0]
    assert walk.predicted[-1] == first


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["nextn", "dspark"])
def test_speculation_rounds_are_greedy(shipped, spec):
    ids = shipped.tokenizer.encode("def add(a, b):")
    first, rounds = inspection.speculate(shipped, ids, spec, rounds=3)
    tokens = [first] + [t for r in rounds for t in r.tokens]
    greedy = engine.generate(shipped, np.array(ids), max_new_tokens=len(tokens), ignore_eos=True).tokens
    assert tokens == greedy
    for r in rounds:
        assert 0 <= len(r.accepted) <= r.drafted and r.drafts[: len(r.accepted)] == r.accepted
        assert r.rejected == r.drafts[len(r.accepted):] and (not r.rejected or r.rejected[0] != r.bonus)
        if spec == "dspark":
            assert r.survival.shape == (r.drafted,) and (np.diff(r.survival) <= 1e-6).all()  # a product of c_i
        else:
            assert r.survival is None


def test_speculate_refuses_an_unknown_method(shipped):
    with pytest.raises(ValueError, match="spec must be"):
        inspection.speculate(shipped, [1, 2], "medusa")
