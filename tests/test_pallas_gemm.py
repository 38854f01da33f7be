"""lingjax.pallas.gemm (the prefill projections) in interpret mode against the reference on fresh random inputs, plain
and fp8 weights, its refusals, and its lowering for an H200 at Flash's prefill projections."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import key_for, rel_err
from lingjax.config import preset
from lingjax.ops import fp8
from lingjax.ops.linear import linear
from lingjax.pallas.gemm import GemmTuning, gemm, plan, supports
from lingjax.pallas.grid_dependency import WAIT_ASM
from lingjax.stacked import layer_of

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct


def _fp8_weight(key, shape, block):
    """A random fp8 weight: normal values at a few magnitudes per column (so the scale blocks differ), quantized."""
    k1, k2 = jax.random.split(key)
    w = jax.random.normal(k1, shape, F32) * jnp.exp(jax.random.normal(k2, (1, shape[-1]), F32))
    return fp8.quantize_on_device(w * shape[-1] ** -0.5, block)


def _exact(x, w):
    dense = w.dequantize(F32) if isinstance(w, fp8.Fp8Array) else w.astype(F32)
    return jnp.einsum("...k,nk->...n", x.astype(F32), dense, precision="highest")


def _check(got, x, w, out):
    """Every element written and finite (interpret mode fills outputs with NaN first), the sums x · Wᵀ in f32 to
    the output's rounding, and the reference (which rounds an fp8 weight to x's dtype first) within bf16's."""
    want_dtype = jnp.dtype(out or x.dtype)
    assert got.shape == (*x.shape[:-1], w.shape[0]) and got.dtype == want_dtype
    values = np.asarray(got, np.float32)
    assert np.isfinite(values).all() and (values != 0).mean() > 0.99
    assert rel_err(got, _exact(x, w)) < (1e-5 if want_dtype == F32 and x.dtype == F32 else 1e-2)
    assert rel_err(got, linear(x, w, out)) < (2e-2 if isinstance(w, fp8.Fp8Array) or x.dtype != F32 else 1e-5)


PLAIN = [  # (rows, N, K, tuning): small shapes, interpret mode
    (64, 128, 256, GemmTuning(bm=32, bn=64, bk=64)),  # a 2 x 2 grid, four K steps
    (96, 192, 256, GemmTuning(bm=64, bn=128)),  # M not a multiple of bm (rows padded), N of bn (tile 64)
    (40, 64, 256, GemmTuning()),  # the defaults: one M tile of 64 (40 rows padded), K in 2 steps
    (64, 128, 256, GemmTuning(bm=32, bn=64, swap=True)),  # the tile computed transposed, W·xᵀ
]


@pytest.mark.parametrize("rows,n,k,tuning", PLAIN)
@pytest.mark.parametrize("dtype,out", [(BF16, None), (BF16, F32), (F32, F32)], ids=["bf16", "bf16 f32 out", "f32"])
def test_gemm_plain_matches_reference(rows, n, k, tuning, dtype, out):
    kx, kw = jax.random.split(key_for("pallas_gemm", rows, n, k, str(tuning), str(dtype)))
    x = jax.random.normal(kx, (rows, k), F32).astype(dtype)
    w = (jax.random.normal(kw, (n, k), F32) * k**-0.5).astype(dtype)
    _check(gemm(x, w, out, tuning=tuning, interpret=True), x, w, out)


FP8 = [  # (rows, N, K, block, tuning)
    (64, 128, 512, (64, 128), GemmTuning(bm=32, bn=128)),  # bn bounded by the scale block's 64 rows; 4 K blocks
    (48, 64, 256, (32, 32), GemmTuning(bm=16, bk=128)),  # a K step over 4 scale blocks: one partial sum each
    (64, 256, 256, (128, 128), GemmTuning(bm=64, bk=64)),  # K steps of half a scale block
    (32, 128, 256, (128, 128), GemmTuning(swap=False)),  # x·Wᵀ as written (fp8's default computes W·xᵀ)
]


@pytest.mark.parametrize("rows,n,k,block,tuning", FP8)
@pytest.mark.parametrize("out", [None, F32], ids=["x dtype out", "f32 out"])
def test_gemm_fp8_matches_reference(rows, n, k, block, tuning, out):
    """An fp8 weight read as fp8: Σ x·q·s with each scale block's partial sum scaled (q·s unrounded), and the
    reference's x · dequantized-to-bf16 within bf16's rounding."""
    kx, kw = jax.random.split(key_for("pallas_gemm_fp8", rows, n, k, block, str(tuning)))
    x = jax.random.normal(kx, (rows, k), F32).astype(BF16)
    w = _fp8_weight(kw, (n, k), block)
    got = gemm(x, w, out, tuning=tuning, interpret=True)
    _check(got, x, w, out)
    if out == F32:
        assert rel_err(got, _exact(x, w)) < 1e-5  # the f32 sums themselves, not rounded through bf16


def _normal_range_rows(key, shape):
    """bf16 values of random sign and magnitudes 2^-8..2^8: all inside f16's normal range (exact there)."""
    ks, km = jax.random.split(key)
    sign = jnp.where(jax.random.bernoulli(ks, 0.5, shape), 1.0, -1.0)
    return (sign * 2.0 ** jax.random.uniform(km, shape, F32, -8.0, 8.0)).astype(BF16)


@pytest.mark.parametrize("swap", [True, False])
def test_gemm_fp8_f16_dots_are_exact(swap):
    """fp8_dots "f16" (x passed in f16, each weight tile converted to f16) keeps every product exact, as the
    default (tiles in bf16) does: both are f32 sums of the exact products, for x inside f16's range; a value past it
    is held at ±65280 (a finite row, as if x were clipped there)."""
    kx, kw = jax.random.split(key_for("pallas_gemm_f16_dots", swap))
    x = _normal_range_rows(kx, (64, 256))
    w = _fp8_weight(kw, (128, 256), (64, 128))
    tunings = [GemmTuning(bm=32, bn=64, swap=swap, fp8_dots=dots) for dots in ("x", "f16")]
    as_x, as_f16 = (np.asarray(gemm(x, w, F32, tuning=t, interpret=True)) for t in tunings)
    exact = _exact(x, w)
    assert rel_err(as_x, exact) < 1e-5 and rel_err(as_f16, exact) < 1e-5  # rel_err also fails on any NaN
    big = x.at[3, 7].set(3e5).at[5, 9].set(-3e5)
    got = gemm(big, w, F32, tuning=tunings[1], interpret=True)
    assert rel_err(got, _exact(jnp.clip(big, -65280, 65280), w)) < 1e-5
    assert "fp8_dots 'f8'" in supports(x, w, tuning=GemmTuning(fp8_dots="f8"))


@pytest.mark.parametrize("dots", ["x", "f16"])
def test_gemm_fp8_converted_first_gives_the_same_sums(dots):
    """At GemmTuning.convert_rows rows and more the fp8 values are converted to the dots' dtype before the launch:
    the same tiles and scales, so the same bits as the tiles converted in registers; a layer of a stack (traced
    layer, as a scan reads it) is sliced into the conversion and gives its own layer's result."""
    kx, kw = jax.random.split(key_for("pallas_gemm_convert_first", dots))
    x = jax.random.normal(kx, (64, 256), F32).astype(BF16)
    stack = [_fp8_weight(k, (128, 256), (64, 128)) for k in jax.random.split(kw, 3)]
    stacked = fp8.Fp8Array(jnp.stack([w.q for w in stack]), jnp.stack([w.scale for w in stack]))
    in_registers, first = (GemmTuning(bm=32, bn=64, fp8_dots=dots, convert_rows=r) for r in (0, 64))
    assert plan(x, stack[1], first)["convert"] and not plan(x, stack[1], in_registers)["convert"]
    assert not plan(x[:32], stack[1], first)["convert"]  # fewer rows than convert_rows
    want = np.asarray(gemm(x, stack[1], tuning=in_registers, interpret=True), np.float32)
    _check(gemm(x, stack[1], tuning=first, interpret=True), x, stack[1], None)
    got = np.asarray(gemm(x, stack[1], tuning=first, interpret=True), np.float32)
    assert np.array_equal(got, want)
    of_stack = jax.jit(lambda x, s, i: gemm(x, layer_of(s, i), tuning=first, interpret=True))(x, stacked,
                                                                                             jnp.int32(1))
    assert np.array_equal(np.asarray(of_stack, np.float32), want)


@pytest.mark.parametrize("live", [1, 40, 64, 96])
def test_live_rows_compute_the_prefix(live):
    """With live_rows (traced) the M tiles starting before it equal the full product's bit for bit, fp8 weight or
    plain; the tiles from it on are never written (interpret mode leaves its NaN fill there)."""
    kx, kw = jax.random.split(key_for("pallas_gemm_live", live))
    x = jax.random.normal(kx, (96, 256), F32).astype(BF16)
    tuning = GemmTuning(bm=32, bn=64)
    for w in ((jax.random.normal(kw, (128, 256), F32) * 0.06).astype(BF16), _fp8_weight(kw, (128, 256), (64, 128))):
        full = np.asarray(gemm(x, w, F32, tuning=tuning, interpret=True))
        part = np.asarray(jax.jit(lambda x, w, n: gemm(x, w, F32, live_rows=n, tuning=tuning, interpret=True))(
            x, w, jnp.int32(live)))
        computed = -(-live // 32) * 32
        assert np.array_equal(part[:computed], full[:computed])
        assert np.isnan(part[computed:]).all()


def test_gemm_leading_dims_and_tiles_from_the_shape():
    """Leading dimensions are kept; the launch depends on the shapes alone (Flash's 2048-row chunk: 128 x 256
    tiles on a bf16 weight, 128 x 128 on an fp8 one of 128 x 128 blocks, K in 128-byte steps)."""
    kx, kw = jax.random.split(key_for("pallas_gemm_lead"))
    x = jax.random.normal(kx, (2, 24, 256), F32).astype(BF16)
    w = (jax.random.normal(kw, (64, 256), F32) * 0.06).astype(BF16)
    _check(gemm(x, w, interpret=True), x, w, None)
    x = S((2048, 2560), BF16)
    assert plan(x, S((157184, 2560), BF16)) == dict(bm=128, bn=256, bk=64, sub=64, rows=2048, grid=(16, 614),
                                                          swap=False, convert=False)
    in_proj = fp8.Fp8Array(S((20480, 2560), fp8.FP8), S((160, 20), F32))
    assert plan(x, in_proj) == dict(bm=128, bn=128, bk=128, sub=128, rows=2048, grid=(16, 160),
                                   swap=True, convert=True)  # a whole chunk: its values converted first
    assert not plan(S((1024, 2560), BF16), in_proj)["convert"]


def test_refusals_name_the_dimension():
    x = S((64, 256), BF16)
    assert "N tile of 8" in supports(x, S((24, 256), BF16))
    assert "K step of 8" in supports(S((64, 24), BF16), S((128, 24), BF16))
    assert "dimensions" in supports(x, S((2, 128, 256), BF16))
    assert "M tile of 8" in supports(x, S((128, 256), BF16), tuning=GemmTuning(bm=8))
    odd = fp8.Fp8Array(S((96, 256), fp8.FP8), S((2, 2), F32))  # blocks of 48 rows
    assert "scale blocks of 48 x 128" in supports(x, odd)
    narrow = fp8.Fp8Array(S((64, 256), fp8.FP8), S((8, 2), F32))  # blocks of 8 rows
    assert "N tile of 8" in supports(x, narrow)
    short = fp8.Fp8Array(S((64, 256), fp8.FP8), S((1, 32), F32))  # blocks of 8 columns
    assert "K step of 8" in supports(x, short)
    assert supports(S((64, 24), F32), S((128, 24), F32)) is None  # f32 dots take any K step
    big = supports(S((2048, 2560), BF16), S((2560, 2560), BF16), tuning=GemmTuning(bk=256))
    assert "589824 bytes of shared memory" in big  # 3 stages of 128 x 256 and 256 x 256 bf16 tiles
    with pytest.raises(ValueError, match="weight"):
        gemm(jnp.ones((32, 256), BF16), jnp.ones((128, 128), BF16), interpret=True)


def _prefill_projections(cfg, tp):
    """[N, K] and fp8 of every projection a Flash prefill runs through `project` at `tp`, one device's share."""
    d, p, nh = cfg.hidden_size, cfg.kda_dim, cfg.num_heads
    return {
        "kda in_proj": (5 * p // tp, d, True), "kda o_proj": (d, p // tp, True),
        "mla q_proj": (nh * cfg.qk_head_dim // tp, d, True), "mla kv_a_proj": (cfg.mla_cache_dim, d, True),
        "mla o_proj": (d, nh * cfg.v_head_dim // tp, True),
        "dense gate_proj": (cfg.intermediate_size // tp, d, True),
        "dense down_proj": (d, cfg.intermediate_size // tp, True),
        "mtp eh_proj": (d, 2 * d, True), "lm_head": (cfg.vocab_size // tp, d, False),
    }


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("tp", [1, 8])
def test_flash_prefill_projections_lower_for_an_h200(tp, h200):
    """Every projection of a Flash prefill chunk (2048 rows; fp8 weights in 128 x 128 blocks, the lm_head bf16) at
    TP 1 and 8 is supported and lowers to Triton IR for an H200, one kernel each, waiting for its producers."""
    for label, (n, k, is_fp8) in _prefill_projections(preset("flash"), tp).items():
        x = S((2048, k), BF16)
        gn, gk = fp8.device_block((n, k))  # the checkpoint's 128 x 128, finer where a dimension needs it
        w = fp8.Fp8Array(S((n, k), fp8.FP8), S((n // gn, k // gk), F32)) if is_fp8 else S((n, k), BF16)
        out = F32 if label == "lm_head" else None
        assert supports(x, w, out) is None, (label, supports(x, w, out))
        fn = lambda x, w, out=out: gemm(x, w, out, interpret=False)  # noqa: E731
        text = jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        calls = text.split("__gpu$xla.gpu.triton")[1:]
        assert len(calls) == 1 and WAIT_ASM in calls[0], label
