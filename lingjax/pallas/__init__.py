"""Pallas GPU kernels, each replacing a plain-JAX reference in lingjax/ops/ (lingjax/kernels.py maps the model's
ops onto them; docs/kernels/ explains how each is shaped and why).

Every kernel is launched through `pallas_call` below, which starts it with griddepcontrol.wait
(lingjax.pallas.grid_dependency: the step programs run with programmatic dependent launch).
"""


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lingjax import target
from lingjax.ops.fp8 import Fp8Array
from lingjax.pallas import instrument
from lingjax.pallas.dialect_lookup import install as _find_triton_dialect
from lingjax.stacked import unstack_operands

_find_triton_dialect()

_NT = (((1,), (1,)), ((), ()))  # contract a's and b's last dims: a [M, K] · b [N, K]ᵀ
_NN = (((1,), (0,)), ((), ()))  # a [M, K] · b [K, N]

# At T = 1 a kernel whose dot takes 16 copies of x's one row (moe_experts' up kernel, moe_router's GEMV,
# linear) reads the row once and broadcasts it when one load of it spans at least this many bytes per 4
# warps of the program: 4 bytes a thread, the smallest copy Triton's software pipeline issues (a narrower load is
# left in the loop, unpipelined, and its latency is paid at every K step: docs/kernels/moe.md). Below, the kernel
# gathers the 16 copies (one pipelined load). The default of the kernels' tuning field x_row_min_bytes.
X_ROW_MIN_BYTES = 512


def reads_one_row(tokens: int, width: int, dtype, min_bytes: int = X_ROW_MIN_BYTES, warps: int = 4) -> bool:
    """Whether a kernel gathering 16 x rows per load of `width` columns reads x's one row instead: T = 1 and the
    row's load spans at least min_bytes per 4 of the program's warps."""
    return tokens == 1 and width * jnp.dtype(dtype).itemsize * 4 >= min_bytes * warps


# How a kernel at T = 1 reads x's one row (x_row_mode): once per K step, split in registers into the step's
# partial sums; once per partial sum; or not at all (16 gathered copies, as at every T > 1).
ROW_PER_STEP, ROW_PER_SUM, GATHER = "step", "sum", ""


def x_row_mode(tokens: int, bk: int, sub: int, dtype, min_bytes: int = X_ROW_MIN_BYTES, warps: int = 4,
               split: bool = False) -> str:
    """How a kernel whose K steps of bk columns hold partial sums of sub columns (sub < bk: an fp8 weight's scale
    blocks, scaled_k_loop) reads x at T = 1: ROW_PER_STEP (split, and the step's row wide enough: one load a step,
    split in registers), ROW_PER_SUM (a partial sum's row wide enough), else GATHER (also at every T > 1)."""
    if split and sub < bk and reads_one_row(tokens, bk, dtype, min_bytes, warps):
        return ROW_PER_STEP
    return ROW_PER_SUM if reads_one_row(tokens, sub, dtype, min_bytes, warps) else GATHER


def x_rows(x_ref, rows, ks, one_row: bool):
    """x_ref[rows, ks] inside a kernel, [len(rows), ks.size]; with one_row (every row is row 0) row 0 read
    once and broadcast in registers."""
    if one_row:
        return jnp.broadcast_to(x_ref[pl.ds(0, 1), ks], (rows.shape[0], ks.size))
    return x_ref[rows, ks]


def row_reader(x_ref, mode: str, offset=0):
    """scaled_k_loop's step_x for ROW_PER_STEP (else None): (start, size) -> x_ref's row 0 over columns
    offset + start .. + size, [1, size]."""
    if mode != ROW_PER_STEP:
        return None
    return lambda start, size: x_ref[pl.ds(0, 1), pl.ds(offset + start, size)]


def resolve_interpret(interpret: bool | None) -> bool:
    """interpret=None means: interpret mode unless the backend is a GPU (chosen by backend, never by
    import failure; the CPU backend only runs Pallas in interpret mode)."""
    return target.platform() != "gpu" if interpret is None else interpret


# The smallest K step of a Triton dot on 16-bit operands: below it the H200 returns wrong sums without an error
# (Triton's own front end refuses such a dot, Pallas's lowering takes it); f32 operands, IEEE FMAs, take any K.
MIN_DOT_K = 16


def short_dot(k: int, dtype) -> bool:
    """Whether a dot on `dtype` operands stepping K by k is under MIN_DOT_K on the tensor cores."""
    return jnp.dtype(dtype).itemsize < 4 and k < MIN_DOT_K


def is_pow2(n: int) -> bool:
    """Whether n is a power of 2 (Triton's block shapes must be: supports() functions check tiles with it)."""
    return n >= 1 and n & (n - 1) == 0


def pow2_tile(n: int, want: int) -> int:
    """Largest power of 2 ≤ want dividing n (tiny test dims may get a tile under the GPU minimum)."""
    t = 1
    while t * 2 <= want and n % (t * 2) == 0:
        t *= 2
    return t


def weight_layout(w) -> tuple[int, int, int, tuple[int, int] | None]:
    """(N, K, bytes per element, scale block or None) of a plain or fp8 weight [N, K] (an array, an
    lingjax.ops.fp8.Fp8Array, or their ShapeDtypeStructs): what a GEMM kernel's tiles follow from."""
    n, k = w.shape[-2:]
    if isinstance(w, Fp8Array):
        return n, k, 1, w.block
    return n, k, jnp.dtype(w.dtype).itemsize, None


# How a kernel's dots take an fp8 weight (lingjax.ops.fp8) beside bf16 activations (the kernels' tuning field
# fp8_dots): "x", each weight tile converted to x's dtype in registers; "f16" (the default), the activations
# passed in f16 (f16_operand) and each weight tile converted to f16, for which Hopper has one instruction a pair of
# values where bf16 takes several. Both are exact: e4m3 values are exact in either, products and sums in f32
# (docs/fp8.md: what f16 rounds otherwise, and what it saves).
FP8_DOTS = ("x", "f16")
_BF16_IN_F16 = 65280.0  # the largest bf16 value that f16 holds


def f16_operand(x):
    """bf16 activations as an f16 dot operand: exact for |x| in [2^-14, 65280], held at ±65280 above (never an
    inf), f16's subnormals below (absolute precision 2^-24, the smallest terms of an f32 sum)."""
    return jnp.clip(x, -_BF16_IN_F16, _BF16_IN_F16).astype(jnp.float16)


def fp8_dots_dtype(x_dtype, fp8_dots: str):
    """The dtype an fp8 weight's tiles meet rows of x_dtype in: f16 for bf16 rows under fp8_dots "f16", else
    x_dtype (the kernels convert each weight tile to their rows' dtype)."""
    return jnp.dtype(jnp.float16 if fp8_dots == "f16" and x_dtype == jnp.bfloat16 else x_dtype)


def fp8_dots_rows(x, fp8_dots: str):
    """Rows as an fp8 weight's dots take them: in f16 (f16_operand) where fp8_dots_dtype says so, else x."""
    return f16_operand(x) if fp8_dots_dtype(x.dtype, fp8_dots) != x.dtype else x


def fp8_dots_reason(fp8_dots: str) -> str | None:
    """Why a tuning's fp8_dots is refused (None: one of FP8_DOTS)."""
    return None if fp8_dots in FP8_DOTS else f"fp8_dots {fp8_dots!r}, not one of {FP8_DOTS}"


def dot_nt(a, b):
    """a [M, K] · b [N, K]ᵀ -> [M, N] f32 inside a kernel: f32 operands at IEEE precision (no TF32),
    narrower ones on the tensor cores with f32 accumulation."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, _NT, precision=prec, preferred_element_type=jnp.float32)


class LayerRef:
    """A stack's ref [L, ...] read at one layer inside a kernel: ref[i] is stack_ref[(layer, *i)], one indexer (the
    Triton lowering refuses an indexer on an `.at[layer]` view). Shape and dtype are the layer's."""

    def __init__(self, ref, layer):
        self.ref, self.layer = ref, layer

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.ref.shape[1:])

    @property
    def dtype(self):
        return self.ref.dtype

    def _at(self, index) -> tuple:
        return (self.layer, *(index if isinstance(index, tuple) else (index,)))

    def __getitem__(self, index):
        return self.ref[self._at(index)]

    def __setitem__(self, index, value):
        self.ref[self._at(index)] = value


def pallas_call(kernel, **kwargs):
    """pl.pallas_call, its kernel first waiting for the kernels it depends on (lingjax.pallas.grid_dependency:
    safe under XLA's programmatic dependent launch). Every kernel of the package goes through here.

    An operand may be a lingjax.stacked.LayerOf (one layer of a stack of weights): the launch takes the whole stack
    and the kernel gets a LayerRef of it, so no slice is copied. Each distinct layer travels as one more int32 [1]
    input after the operands, read inside the kernel, even where it is a Python int: the kernel is then the same
    for every layer and compiles once for all of them (a layer baked into the kernel compiles one a layer). The
    kernel body reads each stacked operand as if its layer had been passed alone."""

    def call(*operands):
        flat, positions, layers = unstack_operands(operands)
        if not positions:
            return instrument.current().launch(kernel, **kwargs)(*operands)
        distinct, slots = [], []  # each layer once (an fp8 weight's values and scales share theirs)
        for layer in layers:
            slot = next((i for i, seen in enumerate(distinct)
                         if seen is layer or isinstance(seen, int) and seen == layer), None)
            if slot is None:
                slot = len(distinct)
                distinct.append(layer)
            slots.append(slot)
        # one [1] array each, not one array of them all: XLA makes a kernel to fill an array of equal constants
        index = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)) for layer in distinct]
        at_layers = _at_layers(kernel, len(operands), positions, tuple(slots), len(distinct))
        return instrument.current().launch(at_layers, **kwargs)(*flat, *index)

    return call


def _at_layers(kernel, n_in: int, positions: tuple[int, ...], slots: tuple[int, ...], n_layers: int):
    """kernel over refs where each stacked operand (at `positions` of the n_in operands) is a LayerRef at its layer,
    held by ref slots[j] of the n_layers [1] refs that follow the operands."""

    def at_layers(*refs, **kw):
        refs = list(refs)
        index = [refs.pop(n_in)[0] for _ in range(n_layers)]
        for pos, slot in zip(positions, slots):
            refs[pos] = LayerRef(refs[pos], index[slot])
        return kernel(*refs, **kw)

    return at_layers


def selected(expert):
    """The expert a decode's up program selected, as the instrument sees it (lingjax.pallas.instrument)."""
    return instrument.current().selected(expert)


def scaled_k_loop(n_steps: int, bk: int, sub: int, zero: tuple, terms, scales=None, block_k: int = 0,
                  step_x=None) -> tuple:
    """Σ over K of a kernel's partial sums -> accumulators shaped like the tuple `zero` (f32): n_steps K steps of
    bk, each in bk / sub partial sums `terms(start, ks, scale, xs)` of `sub` columns (start, pl.ds(start, sub)).

    fp8 weights (lingjax.ops.fp8): each partial sum lies in one scale block of block_k columns, `scales(kb)` loads
    the scales of K block kb (a tuple, one per weight the terms read) and `scale` is that tuple. The loop carries
    the next step's scales, loaded before the current step's dots, so a scale's load latency hides behind them
    (Triton pipelines the weight tiles a dot reads, not a scalar load). Plain weights: scales None, scale None.

    step_x (T = 1, x_row_mode ROW_PER_STEP): `step_x(start, bk)` reads x's one row for the whole K step, [1, bk],
    once (a load of the step's width, which Triton pipelines where a partial sum's would be too narrow); it is
    split in registers into the step's bk / sub parts, and `xs` is the part of each partial sum. Without it xs is
    None and terms reads x itself."""
    count = bk // sub

    def starts(kk):
        return [pl.multiple_of(kk * bk + j * sub, sub) for j in range(count)]

    def parts(kk):
        if step_x is None:
            return [None] * count
        row = step_x(pl.multiple_of(kk * bk, bk), bk)
        return jnp.split(row, count, axis=-1) if count > 1 else [row]

    def add(acc, start, scale, xs):
        return tuple(a + t for a, t in zip(acc, terms(start, pl.ds(start, sub), scale, xs)))

    if scales is None:
        def step(kk, acc):
            for start, xs in zip(starts(kk), parts(kk)):
                acc = add(acc, start, None, xs)
            return acc

        return jax.lax.fori_loop(0, n_steps, step, zero)

    def load(kk):
        kk = jnp.minimum(kk, n_steps - 1)
        return tuple(scales(start // block_k) for start in starts(kk))

    def scaled_step(kk, carry):
        acc, current = carry
        following = load(kk + 1)
        for start, scale, xs in zip(starts(kk), current, parts(kk)):
            acc = add(acc, start, scale, xs)
        return acc, following

    acc, _ = jax.lax.fori_loop(0, n_steps, scaled_step, (zero, load(0)))
    return acc
