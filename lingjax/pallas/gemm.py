"""y = x·Wᵀ for a prefill chunk's rows (more than lingjax.pallas.linear's ROWS): the Pallas form of
lingjax.ops.linear.linear, for a plain weight and for an fp8 one (lingjax.ops.fp8.Fp8Array, read as fp8).

Why: the step programs compile with XLA's GEMM autotuning off (lingjax.execution.step_compiler_options: an
algorithm must follow from the shape alone), and XLA's untuned GEMMs are far from the tensor cores' speed at
prefill shapes; here the tiles follow from the shape alone (`plan`), and an fp8 weight is never dequantized in HBM.

A classic tiled GEMM, one launch, grid (M / bm, N / bn), the M tiles fastest (the programs that run together read
one [bn, K] strip of the weight, so it comes from HBM about once and x's tiles from L2). Each program loops over K
in steps of bk (lax.fori_loop, software-pipelined over `stages` buffers by Triton), multiplying x's [bm, bk] tile
by the weight's [bn, bk] tile on the tensor cores with f32 accumulation, and writes its [bm, bn] tile of the
output rounded once to the output dtype. An fp8 tile is converted to x's dtype in registers (with fp8_dots "f16", the
default, bf16 rows are passed in f16 first; e4m3 values are exact in either) and each scale block's partial sum is
scaled before it is added (lingjax.pallas.scaled_k_loop), so the product is Σ x·q·s with q·s exact in f32: the reference
rounds q·s to x's dtype first, the kernel does not.

x's rows are padded with zeros to a multiple of bm where bm does not divide them (no copy at the engine's
power-of-2 chunks), and the padded rows are dropped after the launch. With `live_rows` (a traced row count) the
programs whose M tile starts at or past it return at once: a caller that reads only a prefix whose length is known
on the device alone (MLA's prefill expands the cache up to the chunk's position) pays only for that prefix.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import (
    MIN_DOT_K,
    dot_nt,
    fp8_dots_dtype,
    fp8_dots_reason,
    fp8_dots_rows,
    is_pow2,
    pallas_call,
    pow2_tile,
    resolve_interpret,
    scaled_k_loop,
    weight_layout,
)
from lingjax.stacked import materialize

F32 = jnp.float32
MIN_TILE = 16  # a Triton dot's smallest M and N
SHARED_BYTES = 232448  # shared memory one Hopper program may take (227 KiB); Triton refuses a launch past it
CONVERT_ROWS = 2048  # GemmTuning.convert_rows: a prefill chunk's rows, where the conversion first was measured faster


@dataclasses.dataclass(frozen=True)
class GemmTuning:
    """The launch's static choices, from the shape alone. bm: the M tile (x's rows padded to a multiple of it; fewer
    rows take the smallest power of 2 of at least 16 holding them); bn: the N tile, the largest power of 2 up to it
    dividing N (an fp8 weight: dividing its scale block's rows, so one scale covers a tile's rows: 128 at Flash's
    blocks); bk: the K step, a power of 2 dividing K (0: 128 bytes of a weight row, 64 bf16 columns, 128 fp8 ones,
    an fp8 step one 128-column scale block and one partial sum); a step wider than an fp8 scale block takes one
    partial sum per block.

    The defaults are Triton's Hopper matmul configuration: 8 warps are two warpgroups, each multiplying 64 of the
    128 rows (wgmma's 64-row unit) by the N tile, an f32 accumulator of 64 (bn 128) or 128 (bn 256) registers a
    thread; 3 stages of 48 KiB (x's 16 KiB, 32 KiB of a 256-row bf16 tile; 32 + 16 KiB at fp8) fit the SM's 227 KiB
    of shared memory with loads enough in flight to hide HBM. On an H100 at 2048 rows bn 256 beat 128 by 10-15% on
    bf16 weights; 4 warps, 4 stages, bm 64 or bk 64 at fp8 were no faster or slower (bench/gemm_bench.py).
    swap: compute the tile transposed, W·xᵀ, so the weight tile is the dot's first operand, which Hopper's wgmma
    reads from registers (an fp8 tile is converted there) while x's tile stays in shared memory; None: for fp8
    weights only (8-10% faster there, about 5% slower on bf16 weights). fp8_dots: how an fp8 weight meets bf16
    rows (lingjax.pallas.FP8_DOTS; "f16": x passed in f16, converted once before the launch). convert_rows: at
    this many rows of x and more (0: never) an fp8 weight's values are converted to the dots' dtype by one XLA
    pass before the launch, with the same scales and tiles (the same sums), so the kernel converts nothing: in
    registers each weight tile is converted once per M tile, 16 times at 2048 rows, which on an H100 cost more
    than the pass (docs/kernels/gemm.md)."""

    bm: int = 128
    bn: int = 256
    bk: int = 0
    warps: int = 8
    stages: int = 3
    swap: bool | None = None
    fp8_dots: str = "f16"
    convert_rows: int = CONVERT_ROWS


def _row_tile(m: int, want: int) -> int:
    """The M tile for m rows: want, or the smallest power of 2 of at least MIN_TILE holding m rows if that is less."""
    t = MIN_TILE
    while t < want and t < m:
        t *= 2
    return t


def _tiles(m: int, n: int, k: int, itemsize: int, block, tuning: GemmTuning) -> tuple[int, int, int, int]:
    """(bm, bn, bk, sub): sub is the columns of one partial sum (a K step's part inside one scale block; a plain
    weight's whole step)."""
    want_bk = tuning.bk or 128 // itemsize
    bm = _row_tile(m, tuning.bm)
    if block is None:
        bn = pow2_tile(n, tuning.bn)
        bk = pow2_tile(k, want_bk)
        return bm, bn, bk, bk
    gn, gk = block
    bn = pow2_tile(gn, tuning.bn)
    bk = pow2_tile(k, want_bk)
    return bm, bn, bk, min(bk, gk)


def _rows(x) -> int:
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return rows


def plan(x, w, tuning: GemmTuning = GemmTuning()) -> dict:
    """The launch `gemm` makes for x and the weight w (arrays, Fp8Array or their ShapeDtypeStructs): its tiles,
    partial-sum width, padded rows, grid, whether the tile is computed transposed (GemmTuning.swap) and whether an
    fp8 weight is converted before the launch (GemmTuning.convert_rows)."""
    m = _rows(x)
    n, k, itemsize, block = weight_layout(w)
    bm, bn, bk, sub = _tiles(m, n, k, itemsize, block, tuning)
    padded = -(-m // bm) * bm
    return dict(bm=bm, bn=bn, bk=bk, sub=sub, rows=padded, grid=(padded // bm, n // bn),
                swap=_swap(block, tuning), convert=_converts(m, block, tuning))


def _swap(block, tuning: GemmTuning) -> bool:
    return block is not None if tuning.swap is None else tuning.swap


def _converts(m: int, block, tuning: GemmTuning) -> bool:
    """Whether an fp8 weight's values are converted before the launch (GemmTuning.convert_rows)."""
    return block is not None and tuning.convert_rows > 0 and m >= tuning.convert_rows


def supports(x, w, out_dtype=None, *, tuning: GemmTuning = GemmTuning(), interpret=None) -> str | None:
    """None when `gemm` with these arguments (arrays or ShapeDtypeStructs) lowers to Triton and computes right on
    the GPU, else why not: a 2-D weight; scale blocks powers of 2; power-of-2 tiles of at least 16 along M and N
    and of at least MIN_DOT_K along K on 16-bit operands (N and K tiles divide N and K; an fp8 weight's scale
    blocks bound them)."""
    del out_dtype, interpret
    if reason := fp8_dots_reason(tuning.fp8_dots):
        return reason
    if len(w.shape) != 2:
        return f"a weight of {len(w.shape)} dimensions, not a matrix"
    if not is_pow2(tuning.bm) or tuning.bm < MIN_TILE:
        return f"an M tile of {tuning.bm}, not a power of 2 of at least {MIN_TILE}"
    n, k, itemsize, block = weight_layout(w)
    where = ""
    if block is not None:
        gn, gk = block
        if not is_pow2(gn) or not is_pow2(gk):
            return f"scale blocks of {gn} x {gk}, not powers of 2"
        where = f" (scale blocks of {gn} x {gk})"
    m = _rows(x)
    bm, bn, bk, sub = _tiles(m, n, k, itemsize, block, tuning)
    if bn < MIN_TILE:
        return f"an N tile of {bn} for N = {n}{where}, under the {MIN_TILE} of a Triton dot"
    if jnp.dtype(x.dtype).itemsize < 4 and sub < MIN_DOT_K:
        return f"a K step of {sub} for K = {k}{where} on {jnp.dtype(x.dtype).name} operands, under {MIN_DOT_K}"
    w_bytes = fp8_dots_dtype(x.dtype, tuning.fp8_dots).itemsize if _converts(m, block, tuning) else itemsize
    shared = tuning.stages * bk * (bm * jnp.dtype(x.dtype).itemsize + bn * w_bytes)
    if shared > SHARED_BYTES:
        return (f"{tuning.stages} stages of {bm} x {bk} and {bn} x {bk} tiles: {shared} bytes of shared memory, "
                f"over {SHARED_BYTES}")
    return None


def _kernel(*refs, live, **tiles):
    # live: live_ref [1] int32 first; x_ref [Mp, K]; w_ref [N, K], plain or fp8; scaled: s_ref [N / gn, K / gk] f32;
    # y_ref [Mp, N].
    live_ref, refs = (refs[0], refs[1:]) if live else (None, refs)
    x_ref, w_ref, *refs = refs
    s_ref, y_ref = refs if tiles["scaled"] else (None, refs[0])
    m, n = pl.program_id(0), pl.program_id(1)
    tile = functools.partial(_tile, x_ref, w_ref, s_ref, y_ref, m, n, **tiles)
    if live:
        pl.when(m * tiles["bm"] < live_ref[0])(tile)
    else:
        tile()


def _tile(x_ref, w_ref, s_ref, y_ref, m, n, *, bm, bn, bk, sub, gn, gk, k, scaled, swap):
    """Program (m, n)'s [bm, bn] tile of y."""
    rows, cols = pl.ds(pl.multiple_of(m * bm, bm), bm), pl.ds(pl.multiple_of(n * bn, bn), bn)

    def terms(start, ks, scale, part):  # one partial sum per scale block a K step spans (a plain weight: one)
        del part
        xs = x_ref[rows, ks]
        w = w_ref[cols, ks].astype(xs.dtype)
        product = dot_nt(w, xs) if swap else dot_nt(xs, w)
        return (product * scale[0] if scaled else product,)

    scales = None
    if scaled:
        scales = lambda kb: (s_ref[n * bn // gn, kb],)  # noqa: E731
    zero = jnp.zeros((bn, bm) if swap else (bm, bn), F32)
    (acc,) = scaled_k_loop(k // bk, bk, sub, (zero,), terms, scales, gk)
    y_ref[rows, cols] = (acc.T if swap else acc).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tuning", "interpret"))
def gemm(x, w, out_dtype=None, *, live_rows=None, tuning: GemmTuning = GemmTuning(), interpret=None):
    """x [..., K], w [N, K] (an array, or an Fp8Array read as fp8) -> [..., N] in out_dtype (default x's dtype),
    from f32 sums rounded once: lingjax.ops.linear.linear (for an fp8 weight without rounding the dequantized
    weight). w may be one layer of a stack (lingjax.stacked.LayerOf, or an Fp8Array of two), read in place (the
    values of an fp8 one converted first at GemmTuning.convert_rows rows are sliced into the conversion). Under
    tensor parallelism it takes the device's shards. live_rows (an int32 scalar, may be traced; x 2-D): only the
    first live_rows rows of the result are computed, the rest hold unspecified values. Shapes it lowers for:
    supports."""
    interpret = resolve_interpret(interpret)
    lead, k = x.shape[:-1], x.shape[-1]
    if len(w.shape) != 2 or w.shape[1] != k:
        raise ValueError(f"gemm takes x [..., {k}] and a weight [N, {k}], got weight {list(w.shape)}")
    n, _, itemsize, block = weight_layout(w)
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    bm, bn, bk, sub = _tiles(m, n, k, itemsize, block, tuning)
    padded = -(-m // bm) * bm
    if padded != m:
        flat = jnp.pad(flat, ((0, padded - m), (0, 0)))
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if block is None:
        operands = (flat, w)
    else:  # converted first: the kernel's tiles are then already of the rows' dtype
        flat = fp8_dots_rows(flat, tuning.fp8_dots)
        operands = (flat, materialize(w.q).astype(flat.dtype) if _converts(m, block, tuning) else w.q, w.scale)
    if live_rows is not None:
        assert x.ndim == 2, "live_rows counts the rows of a 2-D x"
        operands = (jnp.reshape(live_rows, (1,)).astype(jnp.int32), *operands)
    params = None if interpret else pltriton.CompilerParams(num_warps=tuning.warps, num_stages=tuning.stages)
    y = pallas_call(
        functools.partial(_kernel, bm=bm, bn=bn, bk=bk, sub=sub, gn=block[0] if block else bn,
                          gk=block[1] if block else bk, k=k, scaled=block is not None,
                          swap=_swap(block, tuning), live=live_rows is not None),
        out_shape=jax.ShapeDtypeStruct((padded, n), out_dtype),
        grid=(padded // bm, n // bn),
        compiler_params=params,
        interpret=interpret,
        name="gemm",
    )(*operands)
    if padded != m:
        y = y[:m]
    return y.reshape(*lead, n)
