"""lingjax.pallas.residual_norm (a sub-layer's residual add and the next RMSNorm, one launch) in interpret mode against
its reference, lingjax.ops.norms.residual_rms_norm, on fresh random inputs; its lowering for an H200; the model's
decode and verify through it against the XLA model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.triton import gpu_info

from conftest import key_for, rel_err
from lingjax.ops.norms import residual_rms_norm, rms_norm
from lingjax.pallas.grid_dependency import WAIT_ASM
from lingjax.pallas.residual_norm import ResidualNormTuning, residual_norm, supports

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct


def _inputs(rows, splits, part_rows, d, parts_dtype=F32, salt=""):
    kx, kp, kw = jax.random.split(key_for("residual_norm", rows, splits, part_rows, d, str(parts_dtype), salt), 3)
    x = jax.random.normal(kx, (rows, d), F32).astype(BF16)
    parts = jax.random.normal(kp, (splits, part_rows, d), F32).astype(parts_dtype)
    weight = (1.0 + 0.2 * jax.random.normal(kw, (d,), F32)).astype(BF16)
    return x, parts, weight


@pytest.mark.parametrize("rows,splits,part_rows,d", [
    (16, 8, 16, 2560),  # a verify's rows and a split-K projection's partial sums, Flash's width (5 pieces of 512)
    (16, 10, 1, 2560),  # a decode: the expert terms of its one token, the padded rows adding zero
    (3, 1, 3, 96),  # the drafter's unpadded rows, one part, a width of 3 pieces of 32
    (16, 4, 7, 4096),  # 4 pieces of 1024
])
def test_residual_norm_matches_reference(rows, splits, part_rows, d):
    """h = x + Σ parts (in order, rounded once) is the reference's bitwise; the norm is the reference's to a bf16
    rounding of the mean's last place; interpret mode fills outputs with NaN first, so an unwritten element shows."""
    x, parts, weight = _inputs(rows, splits, part_rows, d)
    h, normed = residual_norm(x, parts, weight, 1e-6, interpret=True)
    want_h, want_normed = residual_rms_norm(x, parts, weight, 1e-6)
    assert h.shape == normed.shape == (rows, d) and h.dtype == normed.dtype == BF16
    assert np.isfinite(np.asarray(normed, np.float32)).all() and np.isfinite(np.asarray(h, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
    assert rel_err(normed, want_normed) < 1e-2
    # the norm of h itself, computed in f32 throughout: both are one bf16 rounding away
    exact = np.asarray(h, np.float64)
    exact = exact / np.sqrt((exact**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(weight, np.float64)
    assert rel_err(normed, exact.astype(np.float32)) < 1e-2
    if part_rows < rows:  # rows past the parts' add zero
        np.testing.assert_array_equal(np.asarray(h[part_rows:], np.float32), np.asarray(x[part_rows:], np.float32))


def test_residual_norm_of_one_bf16_part_is_the_old_add_then_norm():
    """One part in x's dtype (a sub-layer already rounded): h = x + part, then rms_norm(h), as the layer wrote them
    before the op existed."""
    x, parts, weight = _inputs(16, 1, 16, 2560, BF16)
    h, normed = residual_norm(x, parts, weight, 1e-5, interpret=True)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(x + parts[0], np.float32))
    assert rel_err(normed, rms_norm(x + parts[0], weight, 1e-5)) < 1e-2


def test_residual_norm_argument_errors():
    x, parts, weight = _inputs(4, 2, 4, 64)
    with pytest.raises(ValueError, match=r"parts \[S, T <= R, D\]"):
        residual_norm(x, parts[:, :, :32], weight, 1e-6, interpret=True)
    with pytest.raises(ValueError, match=r"parts \[S, T <= R, D\]"):
        residual_norm(x[:2], parts, weight, 1e-6, interpret=True)
    assert "pieces" in supports(S((16, 2560 * 9), BF16), S((1, 16, 2560 * 9), F32), S((2560 * 9,), BF16))
    assert "pieces" in supports(S((16, 24), BF16), S((1, 16, 24), F32), S((24,), BF16))
    assert supports(S((16, 2560), BF16), S((8, 16, 2560), F32), S((2560,), BF16)) is None
    assert "chunk of 384" in supports(S((16, 2560), BF16), S((8, 16, 2560), F32), S((2560,), BF16),
                                      tuning=ResidualNormTuning(chunk=384))


@pytest.mark.parametrize("tuning", [ResidualNormTuning(warps=16), ResidualNormTuning(chunk=128)])
def test_residual_norm_tunings_agree(tuning):
    """A tuning changes the launch, not h; the norm stays within one bf16 rounding of the default's."""
    x, parts, weight = _inputs(16, 4, 16, 2560, salt="tuning")
    h0, n0 = residual_norm(x, parts, weight, 1e-6, interpret=True)
    h1, n1 = residual_norm(x, parts, weight, 1e-6, tuning=tuning, interpret=True)
    np.testing.assert_array_equal(np.asarray(h0, np.float32), np.asarray(h1, np.float32))
    assert rel_err(n1, n0) < 1e-2


def test_residual_norm_lowers_for_an_h200(monkeypatch):
    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90))
    fn = jax.jit(lambda x, p, w: residual_norm(x, p, w, 1e-6, interpret=False))
    for parts in (S((8, 16, 2560), F32), S((10, 1, 2560), F32), S((1, 16, 2560), BF16)):
        text = fn.trace(S((16, 2560), BF16), parts, S((2560,), BF16)).lower(lowering_platforms=("cuda",)).as_text()
        calls = text.split("__gpu$xla.gpu.triton")[1:]
        assert len(calls) == 1 and WAIT_ASM in calls[0]
