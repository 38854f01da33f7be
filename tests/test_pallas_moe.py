"""Pallas MoE kernels (router, pair-axis align, fused experts) in interpret mode against lingjax.ops.moe, their
supports() against the Triton lowering for an H200, plus the HF-fixture float32 parity with kernels="pallas"
(KDA entries pointed at their references).

Interpret mode fills every output with NaN before a kernel runs (jax 0.11.2: pallas' hlo_interpreter
initialises outputs with primitives.uninitialized_value; test_interpret_mode_fills_outputs_with_nan holds
it), so a row no kernel wrote reaches rel_err as NaN and fails it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import lingjax
from conftest import FIXTURES, REORDER_TOL, fixture_dirs, key_for, rel_err
from lingjax.config import VERIFY_ROWS, LingConfig, preset
from lingjax.engine import PREFILL_CHUNK
from lingjax.ops import moe
from lingjax.pallas import MIN_DOT_K, reads_one_row
from lingjax.pallas.moe_align import PAIR_LIMIT, align_reference, moe_align
from lingjax.pallas.moe_experts import (
    ExpertTuning,
    fused_experts,
    many_token_tiles,
    one_token_tiles,
    routed_experts,
    supports_fused_experts,
    supports_routed_experts,
)
from lingjax.pallas.moe_router import RouterTuning, partial_logits, route
from lingjax.pallas.moe_router import supports as supports_route

D, I, E = 64, 32, 16
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _distinct_experts(key, t, k, e):
    """Top-k-shaped routing: k distinct experts per token."""
    return jax.vmap(lambda kk: jax.random.permutation(kk, e)[:k])(jax.random.split(key, t)).astype(jnp.int32)


def _check_align_invariants(experts, block_m, ids, blk, pos, meta):
    flat = np.asarray(experts).reshape(-1)
    ids, blk, pos = np.asarray(ids), np.asarray(blk), np.asarray(pos)
    npairs = flat.size
    real = ids[ids < npairs]
    assert sorted(real.tolist()) == list(range(npairs))  # every pair placed exactly once
    assert (ids[pos] == np.arange(npairs)).all()  # pos is the inverse
    total = int(meta[0])
    assert total % block_m == 0 and int(meta[1]) == total // block_m and (ids[total:] == npairs).all()
    for b in range(len(blk)):
        rows = ids[b * block_m:(b + 1) * block_m]
        if b * block_m >= total:
            assert blk[b] == -1
        else:
            assert (flat[rows[rows < npairs]] == blk[b]).all() and rows[0] < npairs  # one expert, first row real
    assert (np.diff(blk[blk >= 0]) >= 0).all()  # buckets in expert order


def _align_cases():
    k = 8
    yield "random T=1", _distinct_experts(key_for("align", 1), 1, k, 512)
    yield "random T=6", _distinct_experts(key_for("align", 6), 6, k, 512)
    yield "random T=8 E=16", _distinct_experts(key_for("align", 8), 8, k, 16)
    yield "every pair to one expert", jnp.full((8, k), int(jax.random.randint(key_for("one"), (), 0, 512)), jnp.int32)
    yield "all distinct", jax.random.permutation(key_for("perm"), 512)[:64].reshape(8, k).astype(jnp.int32)
    yield "NP=1", jax.random.randint(key_for("np1"), (1, 1), 0, 512, jnp.int32)


@pytest.mark.parametrize("block_m", [16, 4])
def test_align_matches_sort_reference(block_m):
    for name, experts in _align_cases():
        got = moe_align(experts, block_m=block_m)
        want = align_reference(experts, block_m, got[1].shape[0])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=name)
        _check_align_invariants(experts, block_m, *got)


def test_align_fallback_past_pair_limit():
    experts = _distinct_experts(key_for("fallback"), 12, 8, 16)  # NP = 96 > 64: sort-based path
    assert experts.size > PAIR_LIMIT
    _check_align_invariants(experts, 16, *moe_align(experts, block_m=16))


ROUTER_CASES = [  # t, d, e, n_group, topk_group, k, renormalize, scaling
    (1, 64, 16, 4, 2, 4, True, 2.5), (6, 64, 16, 4, 2, 4, False, 1.75), (20, 48, 12, 4, 2, 3, True, 2.5),
    (6, 128, 64, 8, 4, 8, True, 2.5),
]


def _router_inputs(t, d, e):
    ks = jax.random.split(key_for("router", t, d, e), 3)
    return (jax.random.normal(ks[0], (t, d)), jax.random.normal(ks[1], (e, d)) / d**0.5,
            0.1 * jax.random.normal(ks[2], (e,)))


DEFAULT = {"default": {}}
# the router cases also run a non-default tuning: another K split (partials summed over 2) and select warps
VARIANTS = dict(DEFAULT, **{"ks=2 select 1 warp": dict(tuning=RouterTuning(k_splits=2, select_warps=1))})
FLASH_ROUTING = dict(top_k=8, n_group=8, topk_group=4, scaling=2.5, renormalize=True)


def _check_route(x, w, b, cfg, precision="f32", variants=DEFAULT):
    """The router (at each tuning of `variants`) equals the reference: the same ids in the same (lax.top_k) order,
    weights to 1e-5. precision="bf16" rounds x and W to bf16 (products then exact in f32): it equals the reference
    on the rounded inputs (against the f32 reference, logits move ~1e-2 relative and near-tied experts may swap)."""
    if precision == "bf16":
        rounded = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
        w_ref, e_ref = moe.route(rounded(x), rounded(w), b, **cfg)
    else:
        w_ref, e_ref = moe.route(x, w, b, **cfg)
    for name, kw in variants.items():
        weights, experts = route(x, w, b, precision=precision, **cfg, **kw)
        np.testing.assert_array_equal(experts, e_ref, err_msg=name)
        assert rel_err(weights, w_ref) <= 1e-5, name


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("t,d,e,g,tg,k,renorm,scaling", ROUTER_CASES)
def test_router_matches_reference(t, d, e, g, tg, k, renorm, scaling, precision):
    cfg = dict(top_k=k, n_group=g, topk_group=tg, scaling=scaling, renormalize=renorm)
    _check_route(*_router_inputs(t, d, e), cfg, precision, variants=VARIANTS)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 6, 16])
def test_router_flash_routing(t, precision):
    """Flash's routing shape (512 experts, 8 groups / top-4, top-8) on a short D."""
    _check_route(*_router_inputs(t, 128, 512), FLASH_ROUTING, precision)


@pytest.mark.parametrize("t", [1, 6, 8])
def test_router_ties_resolve_to_lower_index(t):
    """Experts in duplicated pairs (same weight row, same bias) tie exactly at every stage: group top-2 sums, the
    kept groups, the top-k; ids and order must still match lax.top_k's (lower index first)."""
    d, e = 64, 64
    ks = jax.random.split(key_for("ties", t), 3)
    w = jnp.repeat(jax.random.normal(ks[0], (e // 2, d)) / d**0.5, 2, axis=0)  # experts 2i and 2i+1 identical
    b = jnp.repeat(0.1 * jax.random.normal(ks[1], (e // 2,)), 2)
    _check_route(jax.random.normal(ks[2], (t, d)), w, b, FLASH_ROUTING)


@pytest.mark.parametrize("t", [6, 16])
def test_router_every_token_same_experts(t):
    """Identical tokens choose identical experts; a zero router ties every expert (all scores 0.5), so the bias
    alone decides, then the lower index."""
    x, w, b = _router_inputs(t, 128, 512)
    same = jnp.broadcast_to(x[:1], x.shape)
    _check_route(same, w, b, FLASH_ROUTING)
    _check_route(same, jnp.zeros_like(w), jnp.zeros_like(b), FLASH_ROUTING)


@pytest.mark.parametrize("top_k", [8, 1])
def test_router_top_k_inside_one_group(top_k):
    """The select code takes the top k from each kept group's k largest (moe_router.select_token): with one
    group's bias far above the rest, every chosen expert comes from that group, the case that needs all k of
    its heads; top_k = 1 still needs each group's two largest for the group scores."""
    x, w, b = _router_inputs(6, 128, 512)
    b = b.at[128:192].add(5.0)  # group 2 of 8
    cfg = dict(FLASH_ROUTING, top_k=top_k)
    _check_route(x, w, b, cfg)
    _, experts = route(x, w, b, **cfg)
    assert bool(((experts >= 128) & (experts < 192)).all())


def test_router_f32_on_bf16_operands_is_exact():
    """precision="f32" with a bf16 x and weight runs on the tensor cores (exact products, f32 sums): the routing
    equals the f32 reference on the same bf16 values."""
    x, w, b = _router_inputs(6, 256, 512)
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    _check_route(x, w, b, FLASH_ROUTING)


def _expert_inputs(t, k, dtype, tag=""):
    ks = jax.random.split(key_for("experts", t, k, str(dtype), tag), 9)
    normal = lambda kk, shape, fan_in: (jax.random.normal(kk, shape) * fan_in**-0.5).astype(dtype)
    x = jax.random.normal(ks[0], (t, D)).astype(dtype)
    wg, wu, wd = normal(ks[1], (E, I, D), D), normal(ks[2], (E, I, D), D), normal(ks[3], (E, D, I), I)
    weights = jax.random.uniform(ks[4], (t, k), minval=0.1, maxval=1.0)
    shared = (normal(ks[6], (I, D), D), normal(ks[7], (I, D), D), normal(ks[8], (D, I), I))
    return x, wg, wu, wd, weights, _distinct_experts(ks[5], t, k, E), shared


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [1, 6, 16, 24])  # NP = 4, 24, 64 on the pair kernel; 96 takes the fallback
def test_fused_experts_match_gathered(t, dtype):
    k = 4
    x, wg, wu, wd, weights, experts, shared = _expert_inputs(t, k, dtype)
    for limit in (0.0, 0.5):
        want = moe.experts_gathered(x, wg, wu, wd, weights, experts, limit)
        got = fused_experts(x, wg, wu, wd, weights, experts, limit)  # a row no kernel wrote stays NaN
        assert got.dtype == jnp.float32 and got.shape == (t, D)
        assert rel_err(got, want) <= TOL[dtype]  # rel_err also fails on any NaN


def test_prefill_blocks_follow_the_pairs_per_expert_and_keep_every_row():
    """A chunk averaging 16 pairs an expert takes 32-row blocks (Flash at 1024 tokens, not at 512), and a block's
    size changes no row: the same bits at 16 and 32 rows, every row written (no NaN), against the reference."""
    assert many_token_tiles(1024, 8, 512).block_m == 32 and many_token_tiles(512, 8, 512).block_m == 16
    assert many_token_tiles(16, 4, 4).block_m == 32 and many_token_tiles(15, 4, 4) == ExpertTuning()
    k, t = 4, 24
    x, wg, wu, wd, weights, experts, shared = _expert_inputs(t, k, jnp.bfloat16, "blocks")
    got16, got32 = (np.asarray(fused_experts(x, wg, wu, wd, weights, experts, 0.5, shared=shared, shared_limit=0.7,
                                             tuning=ExpertTuning(block_m=m))) for m in (16, 32))
    assert np.array_equal(got16.view(np.uint32), got32.view(np.uint32))
    want = moe.experts_gathered(x, wg, wu, wd, weights, experts, 0.5) + moe.mlp(x, *shared, 0.7)
    assert rel_err(got32, want) <= TOL[jnp.bfloat16]


def test_fused_experts_without_tuning_take_the_chunks_tiles(monkeypatch):
    """The model's prefill calls fused_experts with no tuning: the tiles come from many_token_tiles (32-row
    blocks for a chunk this full), in the kernel and in its supports()."""
    from lingjax.pallas import moe_experts
    asked = []
    real = moe_experts.many_token_tiles
    monkeypatch.setattr(moe_experts, "many_token_tiles", lambda *a: asked.append(a) or real(*a))
    k, t = 4, 64  # 16 pairs an expert; a shape no other test traces, so the jitted call traces here
    x, wg, wu, wd, weights, experts, shared = _expert_inputs(t, k, jnp.bfloat16, "untuned")
    assert supports_fused_experts(x, wg, wu, wd, weights, experts, 0.5) is None
    got = np.asarray(fused_experts(x, wg, wu, wd, weights, experts, 0.5))
    assert asked == [(t, k, E), (t, k, E)] and real(t, k, E).block_m == 32
    want = np.asarray(fused_experts(x, wg, wu, wd, weights, experts, 0.5, tuning=ExpertTuning(block_m=32)))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fused_experts_single_token_plan_with_repeated_experts():
    """T = 1 takes the align-free plan; a token routed to one expert k times (not what routing
    produces, but the kernel must not assume distinct ids for correctness) still sums correctly."""
    k = 4
    x, wg, wu, wd, weights, experts, _ = _expert_inputs(1, k, jnp.float32, "repeat")
    for ex in (experts, jnp.full_like(experts, experts[0, 0]), experts.at[0, 2].set(experts[0, 1])):
        want = moe.experts_gathered(x, wg, wu, wd, weights, ex, 0.5)
        assert rel_err(fused_experts(x, wg, wu, wd, weights, ex, 0.5), want) <= 1e-5


@pytest.mark.parametrize("t", [1, 6])
def test_fused_experts_with_shared_expert(t):
    k = 4
    x, wg, wu, wd, weights, experts, shared = _expert_inputs(t, k, jnp.float32, "shared")
    want = moe.experts_gathered(x, wg, wu, wd, weights, experts, 0.5) + moe.mlp(x, *shared, 0.7)
    got = fused_experts(x, wg, wu, wd, weights, experts, 0.5, shared=shared, shared_limit=0.7)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [1, 4, 7])
def test_fused_experts_read_the_real_rows_in_place(t, dtype):
    """tokens=T on 16-row inputs whose padded rows hold garbage (a verify's zero-padded rows routed like
    any other): the same bits as the T-row call, so no row is read past T and no slicing is needed;
    with and without the fused shared expert. The align reads the first T·k ids in place too."""
    k, rows = 4, 16
    x, wg, wu, wd, weights, experts, shared = _expert_inputs(rows, k, dtype, "padded")
    assert not (experts[t:] == experts[:1]).all()  # the padded rows route elsewhere
    for extra in ({}, dict(shared=shared, shared_limit=0.7)):
        want = fused_experts(x[:t], wg, wu, wd, weights[:t], experts[:t], 0.5, **extra)
        got = fused_experts(x, wg, wu, wd, weights, experts, 0.5, tokens=t, **extra)
        assert got.shape == (t, D)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        ref = moe.experts_gathered(x[:t], wg, wu, wd, weights[:t], experts[:t], 0.5)
        ref = ref + moe.mlp(x[:t], *shared, 0.7) if extra else ref
        assert rel_err(got, ref) <= TOL[dtype]
    aligned = moe_align(experts, block_m=16, tokens=t)
    for g, w in zip(aligned, moe_align(experts[:t], block_m=16)):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match="tokens"):
        fused_experts(x, wg, wu, wd, weights, experts, tokens=rows + 1)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("rows,t,d", [(1, 1, 64), (16, 1, 64), (16, 1, 128), (16, 6, 64)])
def test_routed_experts_match_reference(rows, t, d, shared, ties):
    """routed_experts (at T = 1 the up kernel routes the token itself) equals the reference route +
    experts_gathered (+ shared) on x's first T rows, and to a few ulp the Pallas route + fused_experts (the
    same selection code and expert kernels: a decode's row equals a verify's). The padded rows hold other
    tokens, so routing (or, at d = 128, broadcasting) the wrong row shows; with ties, experts 2i and 2i+1
    share router row and bias but not weights, so a tie broken to the higher index shows."""
    e = 64
    ks = jax.random.split(key_for("routed", rows, t, shared, ties), 8)
    normal = lambda kk, shape, fan_in: jax.random.normal(kk, shape) * fan_in**-0.5
    router, bias = normal(ks[0], (e, d), d), 0.1 * jax.random.normal(ks[1], (e,))
    if ties:
        router, bias = jnp.repeat(router[::2], 2, axis=0), jnp.repeat(bias[::2], 2)
    w = (normal(ks[2], (e, I, d), d), normal(ks[3], (e, I, d), d), normal(ks[4], (e, d, I), I))
    sh = (normal(ks[5], (I, d), d), normal(ks[6], (I, d), d), normal(ks[7], (d, I), I)) if shared else None
    x = jax.random.normal(key_for("routed x", rows, t), (rows, d))
    with jax.default_matmul_precision("highest"):
        want = moe.routed_experts(x, router, bias, *w, 0.5, **FLASH_ROUTING, tokens=t, shared=sh, shared_limit=0.7)
    got = routed_experts(x, router, bias, *w, 0.5, **FLASH_ROUTING, tokens=t, shared=sh, shared_limit=0.7)
    assert got.shape == (t, d) and rel_err(got, want) <= 1e-5
    weights, experts = route(x, router, bias, **FLASH_ROUTING)
    # the decode's own tiles: the CPU's dots sum in an order that changes with the tile (the H200's tensor cores
    # do not; bench/moe_bench.py checks the decode's rows against the verify's default tiles on the GPU)
    tiles = one_token_tiles(I) if t == 1 else ExpertTuning()
    two_launches = fused_experts(x, *w, weights, experts, 0.5, tokens=t, shared=sh, shared_limit=0.7, tuning=tiles)
    assert rel_err(got, two_launches) <= REORDER_TOL  # two programs: XLA:CPU may order the sums differently


def test_routing_arguments_checked_on_both_paths():
    """route and routed_experts (whose T = 1 path skips route) reject a bad precision and a routing whose kept
    groups hold fewer than top_k experts."""
    d, e = 64, 16
    x, router, bias = jnp.ones((1, d)), jnp.ones((e, d)), jnp.zeros((e,))
    w = (jnp.ones((e, I, d)), jnp.ones((e, I, d)), jnp.ones((e, d, I)))
    cfg = dict(n_group=4, topk_group=1, scaling=1.0, renormalize=True)  # 4 experts kept
    for call in (lambda **kw: route(x, router, bias, **kw), lambda **kw: routed_experts(x, router, bias, *w, **kw)):
        with pytest.raises(ValueError, match="kept groups"):
            call(top_k=8, **cfg)
        with pytest.raises(ValueError, match="precision"):
            call(top_k=2, precision="f16", **cfg)


# the fixtures with MTP tensors and the official layout; every fixture runs the MoE kernels (with the KDA
# ones) in tests/test_pallas_kda.py::test_model_logits_with_pallas_kda
@pytest.mark.parametrize("fixture", [p for p in fixture_dirs() if p.name in ("tiny_c", "tiny_official")],
                         ids=lambda p: p.name)
def test_hf_parity_with_pallas_moe(fixture, monkeypatch):
    """float32 logits within 1e-4 × max|logit| of HF with the MoE kernels in interpret mode (the KDA
    entries pointed at their references, so this test isolates the MoE kernels)."""
    import lingjax.pallas.moe_experts as experts_mod
    import lingjax.pallas.moe_router as router_mod

    calls = []

    def spy(name, fn):
        def wrapped(*args, **kw):
            calls.append(name)
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(experts_mod, "fused_experts", spy("experts", fused_experts))
    monkeypatch.setattr(router_mod, "route", spy("route", route))
    ref = np.load(fixture / "reference.npz")
    model = lingjax.load(fixture, dtype="float32", kernels="pallas").variant(xla_ops=("kda_chain", "kda_chunked"))
    logits = model.logits(ref["prompt_ids"])
    assert rel_err(logits, ref["logits"]) <= 1e-4
    assert "route" in calls and "experts" in calls  # the Pallas experts serve every T, prefill included


def test_kernel_options_reach_the_kernel(monkeypatch):
    """RunOptions.tuning (here through Model.variant) hands an op's Pallas kernel its tuning (the router's, as
    step_bench --kernel-option does) and the logits stay HF's."""
    import lingjax.pallas.moe_router as router_mod

    tunings, tuning = [], RouterTuning(k_splits=2)

    def spy(*args, **kw):
        tunings.append(kw.get("tuning"))
        return route(*args, **kw)

    monkeypatch.setattr(router_mod, "route", spy)
    fixture = fixture_dirs()[0]
    ref = np.load(fixture / "reference.npz")
    base = lingjax.load(fixture, dtype="float32", kernels="pallas").variant(xla_ops=("kda_chain", "kda_chunked"))
    model = base.variant(tuning={"moe_route": tuning})
    assert rel_err(model.logits(ref["prompt_ids"]), ref["logits"]) <= 1e-4
    assert tunings and set(tunings) == {tuning}
    with pytest.raises(ValueError, match="tuning names unknown ops"):
        base.variant(tuning={"no_such_op": tuning})


def test_router_gemv_single_token_reads_x_row_once():
    """At T = 1 the router's GEMV reads x's one row and broadcasts it when a K step's row spans the tuning's
    x_row_min_bytes (f32 at K step 128 here), else gathers 16 copies of it: the same partial logits either way,
    summing to x · router_wᵀ, with other tokens in the padded rows (a broadcast of the wrong row shows)."""
    x, w, _ = _router_inputs(16, 256, 64)
    broadcast = RouterTuning(k_splits=2, bk=128)
    gather = dataclasses.replace(broadcast, x_row_min_bytes=1 << 30)
    assert reads_one_row(1, 128, x.dtype, broadcast.x_row_min_bytes)
    assert not reads_one_row(1, 128, x.dtype, gather.x_row_min_bytes)
    row = partial_logits(x, w, tokens=1, tuning=broadcast)
    gathered = partial_logits(x, w, tokens=1, tuning=gather)
    assert row.shape == (2, 1, 64)
    assert rel_err(row, gathered) <= REORDER_TOL  # two programs: XLA:CPU may order the sums differently
    with jax.default_matmul_precision("highest"):
        want = x[:1] @ w.T
    assert rel_err(row.sum(0), want) <= 1e-5


def test_single_token_up_reads_x_row_once():
    """At T = 1 the up kernel reads x's one row and broadcasts it when a K step's row spans the tuning's
    x_row_min_bytes (f32 at K step 128 here), else gathers 16 copies of it: the same results either way (to a few
    ulp), equal to the reference, with other tokens in the padded rows (a broadcast of the wrong row shows)."""
    k, d = 4, 128
    ks = jax.random.split(key_for("x row"), 9)
    normal = lambda kk, shape, fan_in: jax.random.normal(kk, shape) * fan_in**-0.5
    x = jax.random.normal(ks[0], (16, d))
    wg, wu, wd = normal(ks[1], (E, I, d), d), normal(ks[2], (E, I, d), d), normal(ks[3], (E, d, I), I)
    shared = (normal(ks[4], (I, d), d), normal(ks[5], (I, d), d), normal(ks[6], (d, I), I))
    weights = jax.random.uniform(ks[7], (16, k), minval=0.1, maxval=1.0)
    experts = _distinct_experts(ks[8], 16, k, E)
    broadcast = ExpertTuning(bk_up=128)
    gather = dataclasses.replace(broadcast, x_row_min_bytes=1 << 30)
    assert reads_one_row(1, 128, x.dtype, broadcast.x_row_min_bytes)
    assert not reads_one_row(1, 128, x.dtype, gather.x_row_min_bytes)
    kw = dict(tokens=1, shared=shared, shared_limit=0.7)
    row = fused_experts(x, wg, wu, wd, weights, experts, 0.5, tuning=broadcast, **kw)
    gathered = fused_experts(x, wg, wu, wd, weights, experts, 0.5, tuning=gather, **kw)
    assert rel_err(row, gathered) <= REORDER_TOL  # two programs: XLA:CPU may order the sums differently
    want = moe.experts_gathered(x[:1], wg, wu, wd, weights[:1], experts[:1], 0.5) + moe.mlp(x[:1], *shared, 0.7)
    assert rel_err(row, want) <= 1e-5


def test_single_token_shared_expert_split():
    """At T = 1 the shared expert's block runs on shared_split times the up programs, each bn_up / shared_split
    wide (when that is at least MIN_DOT_ROWS: a 32-wide up tile here, so the CPU's small dims split): the same
    result as one program per tile, every h column written (a missed half shows), equal to the reference."""
    import lingjax.pallas.moe_experts as me

    d, e = 64, 64
    ks = jax.random.split(key_for("shared split"), 6)
    normal = lambda kk, shape, fan_in: jax.random.normal(kk, shape) * fan_in**-0.5
    router, bias = normal(ks[0], (e, d), d), 0.1 * jax.random.normal(ks[1], (e,))
    w = (normal(ks[2], (e, I, d), d), normal(ks[3], (e, I, d), d), normal(ks[4], (e, d, I), I))
    sh = tuple(normal(kk, shape, fan) for kk, shape, fan in zip(jax.random.split(ks[5], 3), [(I, d), (I, d), (d, I)],
                                                                   [d, d, I]))
    x = jax.random.normal(key_for("shared split x"), (16, d))
    kw = dict(**FLASH_ROUTING, tokens=1, shared=sh, shared_limit=0.7)
    split_tiles = dataclasses.replace(one_token_tiles(I), bn_up=32)
    whole_tiles = dataclasses.replace(split_tiles, shared_split=1)
    assert me._shared_split(split_tiles, 32, True, True) == 2 and me._shared_split(whole_tiles, 32, True, True) == 1
    whole = routed_experts(x, router, bias, *w, 0.5, **kw, tuning=whole_tiles)
    split = routed_experts(x, router, bias, *w, 0.5, **kw, tuning=split_tiles)
    assert rel_err(split, whole) <= REORDER_TOL  # two programs: XLA:CPU may order the sums differently
    with jax.default_matmul_precision("highest"):
        want = moe.routed_experts(x, router, bias, *w, 0.5, **kw)
    assert rel_err(split, want) <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_expert_pipelines_fit_shared_memory(dtype):
    """The default tiles' pipelines stay inside the shared-memory budget for bf16 and f32 operands (f32 at
    5 stages asked an H200 for 288 KB of its 227): Triton holds num_stages - 1 K steps of both operands."""
    from lingjax.pallas.moe_experts import SHARED_MEMORY_BUDGET, _stages_within

    item = jnp.dtype(dtype).itemsize
    for tile in (ExpertTuning(), one_token_tiles(768), one_token_tiles(384)):
        up = (tile.block_m + 2 * tile.bn_up) * tile.bk_up * item  # x rows, gate and up tiles
        down = (tile.block_m + tile.bn_down) * tile.bk_down * item  # h rows, down tile
        for per_stage, want in ((up, tile.stages_up), (down, tile.stages_down)):
            stages = _stages_within(want, per_stage)
            assert stages >= 2 and (stages - 1) * per_stage <= SHARED_MEMORY_BUDGET, (dtype, per_stage, stages)


def test_interpret_mode_fills_outputs_with_nan():
    """What the tests above rely on to see an unwritten row: interpret mode fills a float output with NaN before
    the kernel runs (an int32 output with its minimum)."""
    def kernel(o_ref, i_ref):
        o_ref[pl.ds(0, 8)] = jnp.zeros((8,), jnp.float32)  # the first half only

    out, ints = pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((16,), jnp.float32),
                                                  jax.ShapeDtypeStruct((4,), jnp.int32)), interpret=True)()
    assert (np.asarray(out[:8]) == 0).all() and np.isnan(np.asarray(out[8:])).all()
    assert (np.asarray(ints) == np.iinfo(np.int32).min).all()


# ---- supports() and the Triton lowering for an H200 ------------------------------------------------------------

S = jax.ShapeDtypeStruct
_FIXTURE_NAMES = [p.parent.name for p in sorted(FIXTURES.glob("*/config.json"))]
# (config, tp, dtype): the fixtures and tiny in bf16 (the GPU's default) and f32 (their parity runs); mid and
# flash in bf16 only (their tiles depend on the dims alone)
MOE_CASES = ([(n, 1, d) for n in _FIXTURE_NAMES for d in ("bf16", "f32")]
             + [("tiny", tp, d) for tp in (1, 2) for d in ("bf16", "f32")]
             + [("flash", tp, "bf16") for tp in (1, 2, 4, 8)] + [("mid", 1, "bf16"), ("mid", 2, "bf16")])
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
WIDTHS = [(VERIFY_ROWS, 1), (VERIFY_ROWS, 4), (1, 1), (PREFILL_CHUNK, PREFILL_CHUNK)]  # (x rows, T)


def _config(name: str) -> LingConfig:
    return preset(name) if name in ("tiny", "mid", "flash") else LingConfig.from_file(FIXTURES / name / "config.json")


def _moe_calls(cfg: LingConfig, tp: int, dtype):
    """(label, supports, kernel, arguments, keywords) of every MoE op call the model makes (lingjax/model.py, MoE):
    the router on all x rows, the experts on the first T, the decode's routed experts at T = 1; at decode,
    verify, the drafter's unpadded T = 1 and a prefill chunk; per-device widths under TP (lingjax/sharding.py:
    experts and shared expert split on their intermediate dim, the router replicated). The shared expert is
    passed where the model fuses it (the same width as an expert's)."""
    d, e, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    i, si = cfg.moe_intermediate_size // tp, cfg.shared_intermediate_size // tp
    layer = cfg.num_hidden_layers - 1
    routing = dict(top_k=k, n_group=cfg.n_group, topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
                   renormalize=cfg.norm_topk_prob, precision="f32")
    router = (S((e, d), dtype), S((e,), jnp.float32))
    w = (S((e, i, d), dtype), S((e, i, d), dtype), S((e, d, i), dtype))
    limit = cfg.swiglu_limit(layer, shared=False)
    fused = dict(shared=(S((i, d), dtype), S((i, d), dtype), S((d, i), dtype)),
                 shared_limit=cfg.swiglu_limit(layer, shared=True)) if si == i else {}
    for rows, t in WIDTHS:
        x = S((rows, d), dtype)
        yield f"route rows={rows}", supports_route, route, (x, *router), routing
        routed = (S((rows, k), jnp.float32), S((rows, k), jnp.int32))
        yield (f"fused_experts rows={rows} T={t}", supports_fused_experts, fused_experts, (x, *w, *routed, limit),
               dict(tokens=t, **fused))
        if t == 1:
            yield (f"routed_experts rows={rows}", supports_routed_experts, routed_experts, (x, *router, *w, limit),
                   dict(tokens=1, **routing, **fused))


def _call_key(kernel, args, kw):
    """What a lowering depends on: the kernel, the arrays' shapes and dtypes, the static values."""
    spec = lambda a: (a.shape, str(a.dtype)) if isinstance(a, S) else tuple(map(spec, a)) if isinstance(a, tuple) else a
    return kernel.__name__, tuple(map(spec, args)), tuple(sorted((k, spec(v)) for k, v in kw.items()))


_LOWERED = set()  # calls lowered already in this session (a verify's router call is the decode's; mid's are flash's)


def _lower(kernel, args, kw):
    """kernel(*args, **kw) lowered for an H200 (Triton IR, no compile): the ShapeDtypeStructs among args and
    shared's traced, the rest (the SwiGLU limit) static as the model passes them."""
    shared = kw.get("shared", ())
    kw = {**{key: v for key, v in kw.items() if key != "shared"}, "interpret": False}
    traced = [j for j, a in enumerate(args) if isinstance(a, S)]

    def fn(*a):
        full = list(args)
        for j, v in zip(traced, a):
            full[j] = v
        return kernel(*full, **kw, **(dict(shared=a[len(traced):]) if shared else {}))

    return jax.jit(fn).trace(*(args[j] for j in traced), *shared).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", ["mid", "flash"])
def test_presets_run_every_moe_kernel(name, dtype):
    """Every MoE op call of mid and flash at TP 1, 2, 4 and 8 is supported: the GPU runs the Pallas kernels."""
    for tp in (1, 2, 4, 8):
        for label, supports, _, args, kw in _moe_calls(preset(name), tp, dtype):
            assert supports(*args, **kw) is None, (tp, label, supports(*args, **kw))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("name,tp,dtype", MOE_CASES, ids=[f"{n}-tp{tp}-{d}" for n, tp, d in MOE_CASES])
def test_moe_supports_matches_the_triton_lowering(name, tp, dtype, h200):
    """supports() of route, fused_experts and routed_experts over the model's calls in every fixture config and
    preset: where it accepts a call, the call lowers to Triton IR for an H200; a refusal is a reason naming the
    dimension, and either the call does not lower (a block that is no power of 2) or it is a 16-bit dot's K step
    under MIN_DOT_K, which lowers but which the H200 computes wrong (docs/kernels/moe.md). The Flash presets'
    shapes are all supported (test_presets_run_every_moe_kernel)."""
    for label, supports, kernel, args, kw in _moe_calls(_config(name), tp, DTYPES[dtype]):
        reason = supports(*args, **kw)
        if _call_key(kernel, args, kw) in _LOWERED:
            continue
        _LOWERED.add(_call_key(kernel, args, kw))
        if reason is None:
            _lower(kernel, args, kw)
        elif "power of 2" in reason:
            with pytest.raises(ValueError, match="power of 2"):
                _lower(kernel, args, kw)
        else:
            assert f"under the {MIN_DOT_K} a 16-bit Triton dot needs" in reason, (label, reason)
            _lower(kernel, args, kw)


def test_supports_names_the_dimension():
    """The refusals of the fixtures' tiny dims say which dimension; a tuning's tiles count too."""
    bf, f32 = jnp.bfloat16, jnp.float32
    routing = dict(top_k=2, n_group=4, topk_group=2, scaling=1.0, renormalize=True)
    x, w, b = S((16, 48), bf), S((8, 48), bf), S((8,), f32)
    assert "K step of 6" in supports_route(x, w, b, **routing)  # hidden 48 in 8 K splits (tiny_a)
    assert supports_route(x, w, b, **routing, tuning=RouterTuning(k_splits=3)) is None  # K steps of 16
    x, w = S((16, 32), bf), S((8, 32), bf)  # tiny_b: K steps of 4
    assert "K step of 4 (hidden size 32 in 8 K splits) on bf16" in supports_route(x, w, b, **routing)
    assert "K step of 4" in supports_route(S((16, 32), f32), S((8, 32), f32), b, **routing, precision="bf16")
    assert supports_route(S((16, 32), f32), S((8, 32), f32), b, **routing) is None  # f32 dots take any K
    x, w, b = S((16, 64), f32), S((12, 64), f32), S((12,), f32)  # tiny_c's 12 experts
    assert "expert tile of 12" in supports_route(x, w, b, **dict(routing, top_k=3))
    assert "12 experts" in supports_route(x, w, b, **dict(routing, top_k=3), tuning=RouterTuning(be=4))
    assert "top_k 3" in supports_route(S((16, 64), f32), S((16, 64), f32), S((16,), f32), **dict(routing, top_k=3))
    x = S((16, 40), bf)  # tiny_c's experts: K steps of 8 in bf16
    w = (S((8, 24, 40), bf),) * 2 + (S((8, 40, 24), bf),)
    routed = (S((16, 2), f32), S((16, 2), jnp.int32))
    assert "up kernel's K step of 8 (hidden size 40)" in supports_fused_experts(x, *w, *routed, tokens=4)
    x = S((16, 64), bf)
    w = (S((8, 16, 64), bf),) * 2 + (S((8, 64, 16), bf),)
    assert supports_fused_experts(x, *w, *routed, tokens=4) is None
    assert "down kernel's K step of 8" in supports_fused_experts(x, *w, *routed, tokens=4,
                                                                 tuning=ExpertTuning(bk_down=8))
    assert "blocks of 24 rows" in supports_fused_experts(x, *w, *routed, tokens=4, tuning=ExpertTuning(block_m=24))
    shared = (S((32, 64), bf), S((32, 64), bf), S((64, 32), bf))
    assert "width 16" in supports_fused_experts(x, *w, *routed, tokens=4, shared=shared)
