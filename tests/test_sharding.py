"""Tensor parallelism on 8 fake CPU devices: TP2, TP4 and TP8 equal TP1, speculation included."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import lingjax
from conftest import FIXTURES, key_for, layer_shards, rel_err
from lingjax import sharding
from lingjax.checkpoint import save_safetensors
from lingjax.config import PRESETS, LingConfig
from lingjax.execution import Exec
from lingjax.random_weights import random_model
from lingjax.stacked import LayerOf


@functools.cache
def _tiny(tp):
    return lingjax.load("tiny", dtype="float32", seed=5, tp=tp)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """tiny widened to 8 heads (tiny's 4 do not split 8 ways), written once in the official layout -> tp -> that
    checkpoint loaded at TP `tp`, straight into its shards. One model per TP size for the module: the TP1
    reference that TP2, TP4 and TP8 are compared with compiles its programs once, for every test here."""
    cfg = LingConfig.from_hf({**PRESETS["tiny"], "num_attention_heads": 8, "num_key_value_heads": 8})
    directory = tmp_path_factory.mktemp("wide")
    save_safetensors(random_model(cfg, jax.numpy.float32, seed=3), directory)
    return functools.cache(lambda tp: lingjax.load(directory, dtype="float32", tp=tp))


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


def test_eight_fake_devices():
    assert len(jax.devices()) >= 8


def test_random_presets_are_drawn_in_shards_and_equal_at_every_tp():
    """Presets draw each weight on the devices, every device only its shard, and the same values at
    any TP (so benchmarks at several TP sizes compare one model)."""
    one, four = _tiny(1), _tiny(4)
    w_in = four.params["layers"][0]["attn"]["in_proj"][...]
    assert layer_shards(w_in) == {(5, w_in.shape[1] // 4, w_in.shape[2])}
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params)):
        assert a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("tp", [4])  # TP2: test_sampling_matches_tp1 and the fixture-loading tests
def test_logits_and_greedy_match_tp1(tp, wide):
    """TP4 (two of the 8 heads on each device) equals TP1: the chunked-prefill and decode logits, greedy and
    NEXTN greedy tokens."""
    one, many = wide(1), wide(tp)
    prompt = _prompt(37, tp)  # > VERIFY_ROWS: chunked prefill, then decode
    assert rel_err(many.logits(prompt), one.logits(prompt)) < 1e-4  # f32, partial sums all-reduced in another order
    assert rel_err(many.incremental_logits(prompt, 30), one.incremental_logits(prompt, 30)) < 1e-4
    want = lingjax.generate(one, prompt, 24, ignore_eos=True).tokens
    assert lingjax.generate(many, prompt, 24, ignore_eos=True).tokens == want
    spec = lingjax.generate(many, prompt, 24, ignore_eos=True, spec="nextn", steps=3)
    assert spec.tokens == want


def test_tp8_matches_tp1(wide):
    """TP8, the largest size Flash is meant to run at (one head on each device), loaded from the official layout
    straight into its 8 shards: logits, greedy and NEXTN greedy tokens equal TP1's."""
    one, eight = wide(1), wide(8)
    assert eight.cfg.kda_num_heads == 8
    in_proj = eight.params["layers"][0]["attn"]["in_proj"][...]
    assert layer_shards(in_proj) == {(5, in_proj.shape[1] // 8, in_proj.shape[2])}
    prompt = _prompt(37, 8)  # the shapes of the TP4 test's prompt: TP1 compiles nothing new
    assert rel_err(eight.logits(prompt), one.logits(prompt)) < 1e-4
    want = lingjax.generate(one, prompt, 24, ignore_eos=True).tokens
    assert lingjax.generate(eight, prompt, 24, ignore_eos=True).tokens == want
    assert lingjax.generate(eight, prompt, 24, ignore_eos=True, spec="nextn", steps=3).tokens == want


def test_sampling_matches_tp1(wide):
    """Sampling gathers the vocabulary and draws with the same key on every shard: same tokens as TP1, at
    TP2 (TP4's sharded forward: test_logits_and_greedy_match_tp1)."""
    tp = 2
    prompt = _prompt(9, 11)
    kwargs = dict(temperature=1.1, top_k=50, seed=4, ignore_eos=True)
    want = lingjax.generate(wide(1), prompt, 12, **kwargs).tokens
    assert lingjax.generate(wide(tp), prompt, 12, **kwargs).tokens == want
    want = lingjax.generate(wide(1), prompt, 12, spec="nextn", steps=2, **kwargs).tokens
    assert lingjax.generate(wide(tp), prompt, 12, spec="nextn", steps=2, **kwargs).tokens == want


def test_weights_are_sharded_and_loaded_straight_into_shards():
    """A checkpoint with MTP tensors (tiny_c) loaded at TP2: each weight split as sharding.param_spec says, every
    parameter (the MTP layer's included) bit for bit the TP1 load's, and the sharded forward gives the HF
    logits. (NEXTN at TP2: test_sampling_matches_tp1; on tiny_c against HF's greedy tokens at TP1: test_spec.)"""
    model = lingjax.load(FIXTURES / "tiny_c", dtype="float32", tp=2)
    kda = model.params["layers"][0]["attn"]
    w_in = kda["in_proj"][...]  # [5, P, D]: q|k|v|f|g, each split by channel
    assert isinstance(w_in, LayerOf)  # the KDA layers' in_proj travel as one stack, split behind the layer axis
    assert w_in.sharding.spec == P(None, *sharding.param_spec(("in_proj",)))
    assert layer_shards(w_in) == {(5, w_in.shape[1] // 2, w_in.shape[2])}
    w_gate = model.params["layers"][2]["mlp"]["w_gate"][...]
    assert layer_shards(w_gate) == {(w_gate.shape[0], w_gate.shape[1] // 2, w_gate.shape[2])}
    one = lingjax.load(FIXTURES / "tiny_c", dtype="float32")
    assert model.has_mtp and jax.tree.structure(one.params) == jax.tree.structure(model.params)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(model.params)):
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    ref = np.load(FIXTURES / "tiny_c" / "reference.npz")
    assert rel_err(model.logits(ref["prompt_ids"]), ref["logits"]) <= 1e-4


def test_distributed_argmax_ties_to_lowest_id():
    mesh = sharding.make_mesh(4)
    ex = Exec(tp_axis=sharding.AXIS)
    logits = np.zeros((5, 16), np.float32)
    logits[0, [5, 9]] = 2.0  # tie across shards 1 and 2
    logits[1, [13, 12]] = 1.0  # tie inside shard 3
    logits[2, :] = -1.0  # all equal
    logits[3:] = np.asarray(jax.random.normal(key_for("argmax"), (2, 16)))
    fn = jax.shard_map(ex.argmax_vocab, mesh=mesh, in_specs=jax.sharding.PartitionSpec(None, "tp"),
                       out_specs=jax.sharding.PartitionSpec(), check_vma=False)
    want = np.argmax(logits, axis=-1).tolist()
    assert np.asarray(fn(logits)).tolist() == want and want[:3] == [5, 12, 0]
    # one collective per argmax (it runs once per step and per draft)
    prims = [str(e.primitive) for e in jax.make_jaxpr(fn)(logits).jaxpr.eqns[0].params["jaxpr"].eqns]
    assert sum(p in ("all_gather", "pmax", "pmin", "psum", "all_reduce") for p in prims) == 1, prims


def test_indivisible_tp_is_rejected():
    with pytest.raises(ValueError, match="does not divide"):
        lingjax.load(FIXTURES / "tiny_official", dtype="float32", tp=2)  # 3 heads
    with pytest.raises(ValueError, match="devices"):
        lingjax.load("tiny", tp=64)


def test_orbax_restores_straight_into_shards(tmp_path):
    from lingjax.checkpoint import convert, load_orbax

    convert(FIXTURES / "tiny_c", tmp_path / "orbax", dtype=jax.numpy.float32)
    mesh = sharding.make_mesh(2)
    module = load_orbax(tmp_path / "orbax", lingjax.LingConfig.from_file(tmp_path / "orbax" / "config.json"),
                        jax.numpy.float32, sharding_for=lambda path: jax.sharding.NamedSharding(
                            mesh, sharding.param_spec(path)))
    w_in = module.layers[0].attn.in_proj[...]  # as restored, before any re-placement
    assert {s.data.shape for s in w_in.addressable_shards} == {(5, w_in.shape[1] // 2, w_in.shape[2])}
    model = lingjax.load(tmp_path / "orbax", dtype="float32", tp=2)
    ref = np.load(FIXTURES / "tiny_c" / "reference.npz")
    assert rel_err(model.logits(ref["prompt_ids"]), ref["logits"]) <= 1e-4
