"""The MLA prefill kernel (lingjax.pallas.mla_prefill) in interpret mode against lingjax.ops.mla.mla_expanded:
fresh random inputs, every output element written (interpret mode NaN-fills outputs first, and rel_err fails on
NaN), zeros past `tokens`, slots past every row's position never needed. Then its supports() over the presets'
prefill shapes: what it accepts lowers to Triton IR for an H200."""

import functools

import jax
import jax.experimental.pallas.fuser  # noqa: F401 (registers a config keying jit's cache: see test_pallas_mla.py)
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import key_for, rel_err
from lingjax.config import preset
from lingjax.engine import PREFILL_CHUNK, cache_capacity
from lingjax.ops import mla
from lingjax.pallas.mla_prefill import MLAPrefillTuning, mla_prefill_attention, supports

N, R, V, RANK = 16, 8, 16, 32  # nope, rope, value head dims and the latent rank (small; Flash: 128/64/128/512)
# f32: the same products, summed in another order. bf16: the expanded keys and values and the softmax weights
# rounded to bf16 (2^-9 relative each), which the f32 reference keeps exact
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
SMALL = MLAPrefillTuning(block_q=8, block_k=16)  # several query blocks, several key tiles a block
reference = jax.jit(mla.mla_expanded, static_argnames=("tokens",))


def _inputs(seed, rows, h, capacity, dtype):
    ks = jax.random.split(key_for("mla_prefill", seed, rows, h, capacity), 4)
    return (jax.random.normal(ks[0], (rows, h, N)).astype(dtype), jax.random.normal(ks[1], (rows, h, R)).astype(dtype),
            jax.random.normal(ks[2], (capacity, RANK + R)).astype(dtype),
            (jax.random.normal(ks[3], (h * (N + V), RANK)) * RANK**-0.5).astype(dtype))


def _checked(inputs, start, tokens, tol, tuning=SMALL) -> np.ndarray:
    """The kernel's o for rows at start, start + 1, ... against the reference's (within tol, zeros past tokens)."""
    positions = start + jnp.arange(inputs[0].shape[0])
    o = np.asarray(mla_prefill_attention(*inputs, positions, 0.3, tokens=tokens, tuning=tuning))
    want = reference(*inputs, positions, 0.3, tokens=tokens)
    assert o.shape == want.shape == (inputs[0].shape[0], inputs[0].shape[1], V)
    assert rel_err(o[:tokens], want[:tokens]) <= tol
    assert not np.any(o[tokens:])
    return o


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("start,tokens", [(0, 32), (0, 27), (45, 32), (96, 20)])
def test_matches_reference(dtype, start, tokens):
    """A chunk at the cache's start, with padding rows, and later in the cache (key tiles before its first row)."""
    _checked(_inputs(0, 32, 3, 128, dtype), start, tokens, TOL[dtype])


@pytest.mark.parametrize("tuning", [MLAPrefillTuning(block_q=32, block_k=128), MLAPrefillTuning(block_q=16, block_k=8),
                                    MLAPrefillTuning(block_q=64, block_k=64, num_warps=8, num_stages=3),
                                    MLAPrefillTuning(block_q=8, block_k=16, unmasked_head=False)])
def test_tiles(tuning):
    """Tiles change only the order of the sums (block_q above T: one block of every row); without the unmasked
    first loop every tile is masked."""
    _checked(_inputs(1, 32, 2, 128, jnp.float32), 30, 29, TOL[jnp.float32], tuning)


def test_slots_past_the_positions_are_never_needed():
    """Poisoning every slot past the chunk's last position with 1e30 changes nothing, bit for bit: those slots
    are masked, or their tiles never read (the kernel's work follows the chunk's position, not the capacity)."""
    q_nope, q_pe, cache, w_kvb = _inputs(2, 32, 3, 256, jnp.bfloat16)
    o = _checked((q_nope, q_pe, cache, w_kvb), 40, 32, TOL[jnp.bfloat16])
    poisoned = cache.at[40 + 32:].set(1e30)
    assert np.array_equal(_checked((q_nope, q_pe, poisoned, w_kvb), 40, 32, TOL[jnp.bfloat16]), o)


# supports() and the Triton lowering for an H200, over the shapes the model's prefill passes
# (lingjax.model.MLAAttention): this device's heads, a chunk of PREFILL_CHUNK rows or the smallest, and a cache
# from lingjax.engine.cache_capacity, in either model dtype.

S = jax.ShapeDtypeStruct


def _shapes(cfg, tp: int, rows: int, capacity: int, dtype) -> tuple:
    h, n, r, v = cfg.num_heads // tp, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return (S((rows, h, n), dtype), S((rows, h, r), dtype), S((capacity, cfg.kv_lora_rank + r), dtype),
            S((h * (n + v), cfg.kv_lora_rank), dtype), S((rows,), jnp.int32))


@functools.cache
def _triton_calls(args: tuple, tokens: int, tuning: MLAPrefillTuning) -> int:
    fn = functools.partial(mla_prefill_attention, scale=0.07, tokens=tokens, tuning=tuning, interpret=False)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("name,tp", [("tiny", 1), ("embedded", 1), ("mid", 1), ("flash", 1), ("flash", 8)])
def test_supported_shapes_lower(h200, name, tp):
    """embedded (the shipped model's shape), mid and flash (Flash's MLA) are supported, at a full chunk of an
    8192-token prompt and at the smallest chunk, so the GPU runs the kernel; tiny's rope head dim (8) is below a
    bf16 tensor-core dot's contraction, which supports() says in a line (an f32 dot takes 8)."""
    cfg = preset(name)
    for rows, capacity in ((PREFILL_CHUNK, cache_capacity(8192, 1024)), (32, cache_capacity(20, 32))):
        for dtype in (jnp.bfloat16, jnp.float32):
            args = _shapes(cfg, tp, rows, capacity, dtype)
            reason = supports(*args, 0.07, tokens=rows - 3)
            if name != "tiny" or dtype == jnp.float32:
                assert reason is None, (name, tp, reason)
                assert _triton_calls(args, rows - 3, MLAPrefillTuning()) == 2  # kv_b_proj's GEMM, attention
            else:
                assert isinstance(reason, str) and reason.strip()
