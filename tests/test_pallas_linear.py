"""lingjax.pallas.linear on plain weights (the fp8 path: test_fp8_kernels.py) in interpret mode against the reference
on fresh random inputs, its launch as a function of the shape alone, and its lowering for an H200 at every dense
projection of Flash's decode and verify."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REORDER_TOL, key_for, rel_err
from lingjax.config import VERIFY_ROWS, preset
from lingjax.ops.linear import linear
from lingjax.pallas.linear import ROWS, LinearTuning, plan, supports
from lingjax.pallas.linear import linear as pallas_linear

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct


def _exact(x, w):
    return jnp.einsum("...k,nk->...n", x.astype(F32), w.astype(F32), precision="highest")


CASES = [  # (rows, N, K, tuning)
    (16, 256, 512, LinearTuning()),  # one split, written in the output's dtype
    (1, 96, 320, LinearTuning(bn=32, bk=64)),  # one row (the drafter's), tiles that divide odd sizes
    (5, 128, 1024, LinearTuning(k_splits=4)),  # K splits added after the launch
    (16, 64, 2048, LinearTuning(bn=16)),  # automatic splits: few N tiles
]


@pytest.mark.parametrize("rows,n,k,tuning", CASES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("out", [None, F32], ids=["x dtype out", "f32 out"])
def test_linear_matches_reference(rows, n, k, tuning, dtype, out):
    """The kernel's sums are x · Wᵀ in f32 (to reassociation), rounded once to the output dtype; interpret mode
    fills outputs with NaN first, so rel_err fails on any element left unwritten."""
    kx, kw = jax.random.split(key_for("pallas_linear", rows, n, k, str(tuning), str(dtype)))
    x = jax.random.normal(kx, (rows, k), F32).astype(dtype)
    w = (jax.random.normal(kw, (n, k), F32) * k**-0.5).astype(dtype)
    got = pallas_linear(x, w, out, tuning=tuning, interpret=True)
    want_dtype = out or dtype
    assert got.shape == (rows, n) and got.dtype == want_dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()
    tol = 1e-5 if want_dtype == F32 else 1e-2  # bf16 output: one rounding of each element
    assert rel_err(got, _exact(x, w)) < tol
    assert rel_err(got, linear(x, w, out)) < tol


def test_linear_leading_dims_and_split_sums():
    """Leading dimensions are kept; K splits and one split give the same sums (to reassociation)."""
    kx, kw = jax.random.split(key_for("pallas_linear_lead"))
    x = jax.random.normal(kx, (2, 3, 512), F32).astype(BF16)
    w = (jax.random.normal(kw, (128, 512), F32) * 0.05).astype(BF16)
    one = pallas_linear(x, w, F32, tuning=LinearTuning(k_splits=1), interpret=True)
    four = pallas_linear(x, w, F32, tuning=LinearTuning(k_splits=4), interpret=True)
    assert one.shape == (2, 3, 128)
    assert rel_err(four, one) <= REORDER_TOL


@pytest.mark.parametrize("tuning", [LinearTuning(), LinearTuning(k_splits=4), LinearTuning(bk=256)],
                         ids=["one split", "four splits", "row read once"])
def test_linear_decode_row_and_real_rows(tuning):
    """tokens = 1 reads x's row 0 alone (from the padded rows, and from a one-row x) and gives the verify's row 0;
    tokens = T < the rows of x gives the real rows and zeros past them."""
    kx, kw = jax.random.split(key_for("pallas_linear_tokens", str(tuning)))
    n, k = 128, 1024
    x = jax.random.normal(kx, (VERIFY_ROWS, k), F32).astype(BF16)
    w = (jax.random.normal(kw, (n, k), F32) * k**-0.5).astype(BF16)
    verify = pallas_linear(x, w, F32, tuning=tuning, interpret=True)
    for x_rows in (VERIFY_ROWS, 1):
        decode = pallas_linear(x[:x_rows], w, F32, tokens=1, tuning=tuning, interpret=True)
        assert decode.shape == (x_rows, n)
        assert rel_err(decode[:1], _exact(x[:1], w)) < 1e-5
        assert rel_err(decode[:1], verify[:1]) <= REORDER_TOL
        assert not np.asarray(decode[1:]).any()
    three = pallas_linear(x, w, F32, tokens=3, tuning=tuning, interpret=True)
    assert rel_err(three[:3], _exact(x[:3], w)) < 1e-5
    assert not np.asarray(three[3:]).any()


def test_launch_follows_from_the_shape():
    """The tiles depend on the weight's shape and dtype alone: a decode and a verify of one weight launch the same
    programs (only how x's row is read differs), and a bf16 weight steps K by 256 bytes of its rows."""
    w = S((2560, 4096), BF16)
    decode, verify = plan(BF16, w, tokens=1), plan(BF16, w, tokens=4)
    assert {k: v for k, v in decode.items() if k != "x_row"} == {k: v for k, v in verify.items() if k != "x_row"}
    assert verify["bk"] == 128 and verify["bn"] == LinearTuning().bn == 64 and verify["splits"] > 1
    assert plan(BF16, S((157184, 2560), BF16))["splits"] == 1  # enough N tiles to stream the weight


def test_refusals_name_the_dimension():
    assert "rows" in supports(S((ROWS + 1, 256), BF16), S((128, 256), BF16))
    assert "N tile of 8" in supports(S((16, 256), BF16), S((24, 256), BF16))
    assert "K step of 8" in supports(S((16, 24), BF16), S((128, 24), BF16))
    assert "dimensions" in supports(S((16, 256), BF16), S((2, 128, 256), BF16))
    assert supports(S((16, 24), F32), S((128, 24), F32)) is None  # f32 dots take any K step
    with pytest.raises(ValueError, match="at most 16 rows"):
        pallas_linear(jnp.ones((17, 256), BF16), jnp.ones((128, 256), BF16), interpret=True)


def _dense_projections(cfg, tp):
    """[N, K] of every plain-weight projection a decode or verify of cfg runs at `tp`, one device's share."""
    d, p, nh = cfg.hidden_size, cfg.kda_dim, cfg.num_heads
    return {
        "kda in_proj": (5 * p // tp, d), "kda o_proj": (d, p // tp),
        "mla q_proj": (nh * cfg.qk_head_dim // tp, d), "mla kv_a_proj": (cfg.mla_cache_dim, d),
        "mla o_proj": (d, nh * cfg.v_head_dim // tp),
        "dense gate_proj": (cfg.intermediate_size // tp, d), "dense down_proj": (d, cfg.intermediate_size // tp),
        "mtp eh_proj": (d, 2 * d), "lm_head": (cfg.vocab_size // tp, d),
    }


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_flash_projections_are_supported_and_lower_for_an_h200(tp, h200):
    """Every dense projection of a Flash decode (one row read) and verify at TP 1, 2 and 8 is supported and lowers
    to Triton IR for an H200."""
    for label, (n, k) in _dense_projections(preset("flash"), tp).items():
        for tokens, out in ((1, BF16), (4, F32)):
            x, w = S((VERIFY_ROWS, k), BF16), S((n, k), BF16)
            assert supports(x, w, out, tokens=tokens) is None, (label, supports(x, w, out, tokens=tokens))
            fn = lambda x, w, tokens=tokens, out=out: pallas_linear(x, w, out, tokens=tokens, interpret=False)
            jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",))


def _pallas_inputs(jaxpr) -> list[tuple[int, ...]]:
    """The input shapes of every pallas_call in a jaxpr, nested jaxprs included."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            shapes += [tuple(v.aval.shape) for v in eqn.invars]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes += _pallas_inputs(sub)
    return shapes


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_linear_reads_a_stacked_weight_in_place(fp8):
    """One layer of a stack [L, N, K] (lingjax.stacked.layer_of), at a static layer or a traced one (a scan over the
    layers), gives what the kernel gives on the sliced weight, bit for bit (the same programs read the same values),
    plain and fp8 (the scales' stack read at the same layer). The launch takes the whole stack: no slice in the
    program."""
    from lingjax.ops.fp8 import quantize_on_device
    from lingjax.stacked import LayerOf, layer_of, materialize

    kx, kw = jax.random.split(key_for("pallas_linear_stacked", fp8))
    x = jax.random.normal(kx, (VERIFY_ROWS, 512), F32).astype(BF16)
    w = (jax.random.normal(kw, (3, 256, 512), F32) * 512**-0.5).astype(BF16)
    if fp8:
        w = quantize_on_device(w.astype(F32), (128, 128))
    tuning = LinearTuning(k_splits=2)
    run = lambda w: pallas_linear(x, w, F32, tuning=tuning, interpret=True)  # noqa: E731
    want = [run(w[j]) for j in range(3)]
    for j in range(3):
        got = run(layer_of(w, j))
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want[j]))
    _, scanned = jax.lax.scan(lambda c, j: (c, run(layer_of(w, j))), 0, jnp.arange(3))
    for j in range(3):
        np.testing.assert_array_equal(np.asarray(scanned[j]), np.asarray(want[j]))
    launched = _pallas_inputs(jax.make_jaxpr(lambda w: run(layer_of(w, 1)))(w).jaxpr)
    assert [tuple(plain_shape) for plain_shape in launched if len(plain_shape) == 3] == [(3, 256, 512)] + (
        [(3, 2, 4)] if fp8 else [])  # the stacks go to the launch whole, not a slice of them
    plain = w if not fp8 else w.q
    np.testing.assert_array_equal(np.asarray(materialize(LayerOf(plain, 2))), np.asarray(plain[2]))
    with pytest.raises(IndexError, match="layer 3 of a stack of 3"):
        LayerOf(plain, 3)


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_a_stacked_weight_lowers_for_an_h200(fp8, h200):
    """One layer of a stack, static and traced (a scan), lowers to Triton IR for an H200: the kernel's reads of a
    LayerRef are one indexer each (the lowering refuses an indexer on an `.at[layer]` view)."""
    from lingjax.ops.fp8 import Fp8Array
    from lingjax.stacked import layer_of

    x = S((VERIFY_ROWS, 2560), BF16)
    w = (Fp8Array(S((4, 2560, 2560), jnp.float8_e4m3fn), S((4, 20, 20), F32)) if fp8
         else S((4, 2560, 2560), BF16))
    static = lambda x, w: pallas_linear(x, layer_of(w, 2), tokens=1, interpret=False)  # noqa: E731
    jax.jit(static).trace(x, w).lower(lowering_platforms=("cuda",))
    scanned = lambda x, w: jax.lax.scan(  # noqa: E731
        lambda x, i: (pallas_linear(x, layer_of(w, i), interpret=False), None), x, jnp.arange(4))[0]
    jax.jit(scanned).trace(x, w).lower(lowering_platforms=("cuda",))
