"""The split-L MLA decode kernel (lingjax.pallas.mla_decode) in interpret mode against
lingjax.ops.mla.mla_absorbed: fresh random inputs, every output element written (interpret mode NaN-fills
outputs first, and rel_err fails on NaN), zeros past `tokens`, row invariance bit for bit. Then its
supports() over every fixture config and preset: what it accepts lowers to Triton IR for an H200."""

import functools

import jax
import jax.experimental.pallas.fuser  # noqa: F401 (see below)
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, key_for, rel_err
from lingjax.config import DEFAULT_STEPS, VERIFY_ROWS, LingConfig, preset
from lingjax.engine import cache_capacity
from lingjax.ops import mla
from lingjax.pallas.mla_decode import MLATuning, mla_decode_attention, supports

N, R, V, RANK = 16, 8, 16, 32  # nope, rope, value head dims and the latent rank (small; Flash: 128/64/128/512)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-4}  # bf16: q and p in two bf16 halves each (~2^-16 per product)
SMALL = MLATuning(block_l=8, splits=4)  # a 128-slot cache: several tiles a split, splits without tiles
DRAW = 16384  # values per random draw: every input below fits in one
# The reference as one program per shape (tokens traced), not op by op. (The fuser import above registers a
# config that keys jit's cache; imported lazily by the first interpret-mode kernel, it would make that first
# program compile twice.)
reference = jax.jit(mla.mla_absorbed)


def _normal(key, shape, dtype=jnp.float32, scale=1.0) -> np.ndarray:
    """Standard normal values (times scale) in `shape`, the first of one DRAW-sized draw: one sampler program
    serves every shape (XLA:CPU compiles a sampler per shape slowly)."""
    values = np.asarray(jax.random.normal(key, (DRAW,)))[: int(np.prod(shape))]
    return (values.reshape(shape) * scale).astype(dtype)


def _inputs(seed, rows, h, cap, dtype):
    ks = jax.random.split(key_for("mla_decode", seed, rows, h, cap), 4)
    return (_normal(ks[0], (rows, h, N)), _normal(ks[1], (rows, h, R)), _normal(ks[2], (cap, RANK + R), dtype),
            _normal(ks[3], (h * (N + V), RANK), scale=RANK**-0.5))


def _kernel(q_nope, q_pe, cache, w_kvb, positions, tokens, tuning) -> np.ndarray:
    """mla_decode_attention on host arrays, as a numpy array."""
    args = [jnp.asarray(x) for x in (q_nope, q_pe, cache, w_kvb)] + [jnp.asarray(positions, jnp.int32)]
    return np.asarray(mla_decode_attention(*args, 0.3, tokens=tokens, tuning=tuning))


def _checked(inputs, positions, tokens, tol, tuning=MLATuning()):
    """The kernel's o against the reference's (within tol, zeros past `tokens`), as a numpy array."""
    o = _kernel(*inputs, positions, tokens, tuning)
    want = reference(*[jnp.asarray(x) for x in inputs], jnp.asarray(positions, jnp.int32), 0.3, tokens=tokens)
    assert o.shape == want.shape == (len(positions), inputs[0].shape[1], V)
    assert rel_err(o, want) <= tol
    assert not np.any(o[tokens:])
    return o


def _check(seed, rows, tokens, h, cap, start, tuning=MLATuning()):
    """f32 cache; rows at positions start, start+1, ... (a verify's consecutive tokens)."""
    _checked(_inputs(seed, rows, h, cap, jnp.float32), start + np.arange(rows), tokens, TOL[jnp.float32], tuning)


@pytest.mark.parametrize("tokens", [1, 4, 16])
@pytest.mark.parametrize("h", [16, 3])  # one token per block of 16 rows (Flash at TP2); blocks across tokens
def test_matches_reference(tokens, h):
    _check(0, 16, tokens, h, 64, 5)
    _check(1, tokens, tokens, h, 64, 64 - tokens)  # the last slot, no padding rows


@pytest.mark.parametrize("tuning", [MLATuning(block_l=4, splits=3), MLATuning(block_l=8, splits=1),
                                    MLATuning(block_l=16, splits=64), MLATuning(block_l=4, splits=4)])
def test_tiles_and_splits(tuning):
    """Tiles and splits change only the rounding order; more splits than tiles leave splits empty."""
    for start in (0, 17, 40):
        _check(2, 16, 5, 4, 64, start, tuning)


@pytest.mark.parametrize("h,dtype", [(16, jnp.bfloat16), (6, jnp.bfloat16), (6, jnp.float32)])
def test_row_invariance(h, dtype):
    """Row j's result is the same bit for bit whatever T and the padding rows hold (a verify equals
    plain decode): tokens 1, 4 and 7 over the same rows, and 4 tokens with other padding rows. h = 6:
    blocks of 16 rows mix tokens, so a row's block sees further at larger T. (Not the 4 real rows alone:
    the model always runs 16 rows here, and XLA's CPU dot in absorb_query rounds by its row count on some
    machines, 1 ulp apart between 4 and 16 rows, whatever the kernel does.)
    Every call also matches the reference: a bf16 cache's tile stays bf16 and q, then p, go in as two bf16
    halves (~2^-16 relative per product, where the f32 reference is exact on the bf16 values). And slots
    past every real row's position are never needed: poisoning them with 1e30 changes nothing (they are
    masked, or their tiles never read)."""
    q_nope, q_pe, cache, w_kvb = _inputs(4, 16, h, 128, dtype)
    positions = 50 + 3 * np.arange(16)
    out = {t: _checked((q_nope, q_pe, cache, w_kvb), positions, t, TOL[dtype], SMALL) for t in (1, 4, 7)}
    for t in (1, 4):
        assert np.array_equal(out[t][:t], out[7][:t])
    noise = _normal(key_for("mla_noise", h), (16, h, N + R))
    other = np.concatenate([q_nope[:4], noise[4:, :, :N]]), np.concatenate([q_pe[:4], noise[4:, :, N:]])
    assert np.array_equal(_kernel(*other, cache, w_kvb, positions, 4, SMALL)[:4], out[4][:4])
    poisoned = cache.copy()
    poisoned[positions[3] + 1:] = 1e30  # past the 4 real rows' last position
    assert np.array_equal(_kernel(q_nope, q_pe, poisoned, w_kvb, positions, 4, SMALL), out[4])


# supports() and the Triton lowering for an H200, over the shapes the model passes (lingjax.model.MLAAttention):
# this device's heads (q_proj and kv_b_proj split by head under TP, the latent cache replicated), a cache from
# lingjax.engine.cache_capacity, at decode and verify widths on VERIFY_ROWS padded rows and at the MTP drafter's
# unpadded widths (one row to propose, steps + 1 to extend), in either model dtype. Prefill takes mla_expanded.

S = jax.ShapeDtypeStruct
CONFIGS = ([(p.parent.name, 1) for p in sorted(FIXTURES.glob("*/config.json"))]
           + [("tiny", 1), ("tiny", 2)] + [(name, tp) for name in ("mid", "flash") for tp in (1, 2, 4, 8)])
WIDTHS = [(VERIFY_ROWS, 1), (VERIFY_ROWS, 4), (1, 1), (DEFAULT_STEPS + 1,) * 2]  # (rows, tokens)
CAPACITY = cache_capacity(prompt_len=8, max_new_tokens=32)


def _config(name: str) -> LingConfig:
    return LingConfig.from_file(FIXTURES / name / "config.json") if (FIXTURES / name).is_dir() else preset(name)


def _shapes(rows, h, n, r, v, rank, capacity, dtype) -> tuple:
    """q_nope, q_pe, the latent cache, kv_b_proj's weight, positions."""
    return (S((rows, h, n), dtype), S((rows, h, r), dtype), S((capacity, rank + r), dtype),
            S((h * (n + v), rank), dtype), S((rows,), jnp.int32))


def _args(cfg: LingConfig, tp: int, rows: int, dtype, capacity: int = CAPACITY) -> tuple:
    return _shapes(rows, cfg.num_heads // tp, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                   cfg.kv_lora_rank, capacity, dtype)


@functools.cache
def _triton_calls(args: tuple, tokens: int, tuning: MLATuning) -> int:
    """The op lowered for the H200 (once per distinct shapes): its Pallas (Triton) calls."""
    fn = functools.partial(mla_decode_attention, scale=0.07, tokens=tokens, tuning=tuning, interpret=False)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("rows,tokens", WIDTHS)
@pytest.mark.parametrize("name,tp", CONFIGS)
def test_supported_shapes_lower(h200, name, tp, rows, tokens):
    """Where supports() accepts the model's shapes the op lowers (split and combine); where it does not, it
    says why in a line. mid and flash (Flash's MLA) are supported at every TP, so the GPU runs the kernel."""
    cfg = _config(name)
    for dtype in (jnp.bfloat16, jnp.float32):
        args = _args(cfg, tp, rows, dtype)
        reason = supports(*args, 0.07, tokens=tokens)
        if name in ("mid", "flash"):
            assert reason is None, (name, tp, reason)
        if reason is None:
            assert _triton_calls(args, tokens, MLATuning()) == 2
        else:
            assert isinstance(reason, str) and reason.strip()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("tuning", [MLATuning(block_l=16, splits=16, num_warps=8), MLATuning(splits=64, num_stages=1),
                                    MLATuning(splits=128, num_stages=4, combine_partials=4096)])
def test_supported_tunings_lower(h200, tuning):
    """Other tunings at Flash's TP2 share and the long-context capacity."""
    args = _args(preset("flash"), 2, VERIFY_ROWS, jnp.bfloat16, cache_capacity(prompt_len=8192, max_new_tokens=1024))
    assert supports(*args, 0.07, tokens=4, tuning=tuning) is None
    assert _triton_calls(args, 4, tuning) == 2


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("rank,r,splits,dtype", [(48, 64, 32, jnp.bfloat16), (512, 24, 32, jnp.bfloat16),
                                                  (512, 64, 24, jnp.bfloat16), (512, 64, 32, jnp.float16)])
def test_rejected_shapes_do_not_lower(h200, rank, r, splits, dtype):
    """What supports() rejects for its block shapes or dtype does not lower either (Flash's TP2 share, one dim
    changed). Its other rule, dots contracting fewer than 16 bf16 or 8 f32 values, lowers but computes wrong
    on the H200 (docs/kernels/mla.md)."""
    args, tuning = _shapes(VERIFY_ROWS, 16, 128, r, 128, rank, CAPACITY, dtype), MLATuning(splits=splits)
    reason = supports(*args, 0.07, tokens=4, tuning=tuning)
    assert isinstance(reason, str) and reason.strip()
    with pytest.raises(ValueError):
        _triton_calls.__wrapped__(args, 4, tuning)
