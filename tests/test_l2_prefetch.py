"""lingjax.pallas.l2_prefetch: which lines each program prefetches, and that a kernel computes the same with the
prefetch as without it (interpret mode: the prefetch does nothing there). That the instruction reaches the
decode's up kernel is checked in test_pallas_lowering.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from conftest import key_for
from lingjax.pallas.l2_prefetch import LINE_BYTES, lines_per_program, prefetch_share, share_lines


@pytest.mark.parametrize("shape,dtype,parts", [((768, 2560), jnp.bfloat16, 96), ((384, 2560), jnp.bfloat16, 96),
                                               ((32, 64), jnp.bfloat16, 16), ((7, 9), jnp.float32, 5),
                                               ((1, 1), jnp.bfloat16, 3)])
def test_shares_cover_every_line_of_each_array(shape, dtype, parts):
    arr = jax.ShapeDtypeStruct(shape, dtype)
    lines = lines_per_program([arr], parts)
    total = -(-np.prod(shape) * jnp.dtype(dtype).itemsize // LINE_BYTES)
    assert lines & (lines - 1) == 0 and lines * parts >= total  # a power of 2 (a Triton tensor) that covers
    issued = [np.asarray(share_lines(p, lines, total)) for p in range(parts) if p * lines < total]
    got = np.concatenate(issued)
    assert set(got.tolist()) == set(range(total))  # every line, none past the end
    assert len(got) - total < lines  # only the last run repeats a line


def test_lines_per_program_covers_the_largest_array():
    small, large = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 64), jnp.float32)
    lines = lines_per_program([small, large], 8)
    assert lines * 8 >= 64 * 64 * 4 // LINE_BYTES and lines // 2 * 8 < 64 * 64 * 4 // LINE_BYTES


def test_a_kernel_computes_the_same_with_prefetches():
    x = jax.random.normal(key_for("prefetch x"), (16, 128), jnp.float32)
    w = jax.random.normal(key_for("prefetch w"), (32, 64), jnp.bfloat16)
    lines = lines_per_program([w], 4)

    def kernel(x_ref, w_ref, o_ref):
        prefetch_share(w_ref, pl.program_id(0), lines)
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,), interpret=True)(x, w)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x * 2.0 + 1.0))
