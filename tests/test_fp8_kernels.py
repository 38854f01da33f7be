"""The kernels that read fp8 weights (lingjax.pallas.linear, the fp8 forms of lingjax.pallas.moe_experts) in
interpret mode against their plain-JAX references on fresh random inputs, and their supports() against the Triton
lowering for an H200 at Flash's shapes at TP 1, 2, 4 and 8 (where a shard cuts the 128 x 128 blocks)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REORDER_TOL, key_for, rel_err
from lingjax.config import VERIFY_ROWS, preset
from lingjax.model import fp8_layout
from lingjax.ops import fp8
from lingjax.ops import moe as moe_ops
from lingjax.ops.linear import linear
from lingjax.pallas import FP8_DOTS, X_ROW_MIN_BYTES, moe_experts, reads_one_row, x_row_mode
from lingjax.pallas.linear import ROWS, LinearTuning, plan, supports
from lingjax.pallas.linear import linear as pallas_linear

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct


def _weight(key, shape, block, scale_fmt="float32"):
    """A random fp8 weight: normal values at a few magnitudes per block (so the scales differ), quantized."""
    k1, k2 = jax.random.split(key)
    w = jax.random.normal(k1, shape, F32) * jnp.exp(jax.random.normal(k2, shape[:-2] + (1, shape[-1]), F32))
    return fp8.quantize_on_device(w * 0.05, block, scale_fmt)


def _exact(x, w: fp8.Fp8Array):
    """The kernel's semantics in f32: x (its own dtype's values) times the dequantized weight, unrounded."""
    return jnp.einsum("...k,nk->...n", x.astype(F32), w.dequantize(F32), precision="highest")


LINEAR_CASES = [  # (rows, N, K, block, tuning)
    (16, 256, 512, (128, 128), LinearTuning()),
    (1, 96, 320, (32, 64), LinearTuning(bk=128)),  # a K step over two scale blocks; one row (the drafter's)
    (5, 128, 1024, (64, 128), LinearTuning(k_splits=2)),  # K splits added after the launch
    (16, 64, 256, (16, 16), LinearTuning(bn=16, bk=64)),  # the finest blocks the GPU takes
    (16, 256, 512, (128, 128), LinearTuning(fp8_dots="x")),  # weight tiles to bf16 rows' dtype (the others: f16)
    (1, 96, 320, (32, 64), LinearTuning(bk=128, fp8_dots="x", x_row_split=True)),  # one row, split per K step
]


@pytest.mark.parametrize("rows,n,k,block,tuning", LINEAR_CASES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_fp8_linear_matches_reference(rows, n, k, block, tuning, dtype):
    """fp8_linear = x · (q·s)ᵀ with the dequantized weight unrounded (to f32 reassociation), and within bf16's
    rounding of the reference op (linear on the weight dequantized to x's dtype). Interpret mode fills outputs
    with NaN first: rel_err fails on any element left unwritten."""
    kx, kw = jax.random.split(key_for("linear", rows, n, k, block))
    w = _weight(kw, (n, k), block)
    x = jax.random.normal(kx, (rows, k), F32).astype(dtype)
    got = pallas_linear(x, w, F32, tuning=tuning, interpret=True)
    assert got.shape == (rows, n)
    assert rel_err(got, _exact(x, w)) < 1e-5
    assert rel_err(got, linear(x, w, F32)) < (1e-5 if dtype == F32 else 2e-2)


def test_fp8_linear_rounds_once_to_the_output_dtype():
    """The default output is x's dtype, rounded once from the f32 sums; leading dimensions are kept."""
    kx, kw = jax.random.split(key_for("fp8_linear_out"))
    w = _weight(kw, (128, 256), (128, 128))
    x = jax.random.normal(kx, (2, 3, 256), F32).astype(BF16)
    got = pallas_linear(x, w, interpret=True)
    assert got.shape == (2, 3, 128) and got.dtype == BF16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(pallas_linear(x, w, F32, interpret=True).astype(BF16), np.float32))


def test_fp8_linear_rows_are_independent():
    """A row's result does not depend on the other rows (a decode's row equals the same row of a verify)."""
    kx, kw = jax.random.split(key_for("fp8_linear_rows"))
    w = _weight(kw, (128, 512), (128, 128))
    x = jax.random.normal(kx, (VERIFY_ROWS, 512), F32).astype(BF16)
    whole = pallas_linear(x, w, F32, interpret=True)
    one = pallas_linear(x[:1], w, F32, interpret=True)
    np.testing.assert_array_equal(np.asarray(whole[:1]), np.asarray(one))


def test_fp8_linear_reads_the_real_rows_sums():
    """With tokens = T < the rows of x (a verify's padded rows), the K splits' partial sums of the T real rows alone
    are added after the launch: those rows equal the whole x's, the rows past them come out zero."""
    kx, kw = jax.random.split(key_for("fp8_linear_real_rows"))
    w = _weight(kw, (128, 1024), (64, 128))
    x = jax.random.normal(kx, (VERIFY_ROWS, 1024), F32).astype(BF16)
    tuning = LinearTuning(k_splits=4)
    got = pallas_linear(x, w, F32, tokens=3, tuning=tuning, interpret=True)
    assert got.shape == (VERIFY_ROWS, 128)
    assert rel_err(got[:3], pallas_linear(x, w, F32, tuning=tuning, interpret=True)[:3]) <= REORDER_TOL
    assert rel_err(got[:3], _exact(x[:3], w)) < 1e-5
    assert not np.asarray(got[3:]).any()


def test_x_row_loads_wide_enough_to_pipeline():
    """At T = 1 x's one row is read alone only where the load spans x_row_min_bytes per 4 warps (4 bytes a thread:
    Triton pipelines no narrower load); fp8 partial sums a scale block wide read the step's row once and split it
    (x_row_split), else the block's row, else 16 gathered copies; every T > 1 gathers."""
    assert reads_one_row(1, 256, BF16) and not reads_one_row(1, 128, BF16)
    assert not reads_one_row(1, 256, BF16, warps=8) and reads_one_row(1, 512, BF16, warps=8)
    assert not reads_one_row(2, 4096, BF16)
    assert x_row_mode(1, 256, 128, BF16, split=True) == "step"
    assert x_row_mode(1, 256, 128, BF16) == ""  # a block's row is 256 bytes: gathered
    assert x_row_mode(1, 256, 128, BF16, min_bytes=256) == "sum"
    assert x_row_mode(1, 256, 256, BF16, split=True) == "sum"  # no blocks to split into: bf16 weights
    assert x_row_mode(1, 256, 128, BF16, warps=8, split=True) == ""
    assert x_row_mode(4, 256, 128, BF16, split=True) == ""
    assert X_ROW_MIN_BYTES == 512


SINGLE_TOKEN_TUNINGS = [  # (tuning, how x's row is read at T = 1)
    (LinearTuning(), "gather"),  # a 128-column block's row: 256 bytes, 2 a thread
    (LinearTuning(x_row_min_bytes=256), "sum"),  # read per block all the same
    (LinearTuning(x_row_split=True), "step"),  # the step's 256 columns once, split in two
    (LinearTuning(bk=512, k_splits=1, x_row_split=True), "step"),  # split in four
    (LinearTuning(warps=8, x_row_split=True), "gather"),  # 512 bytes over 256 threads
    (LinearTuning(warps=8, bk=512, k_splits=1, x_row_split=True), "step"),
]


@pytest.mark.parametrize("tuning,mode", SINGLE_TOKEN_TUNINGS)
@pytest.mark.parametrize("x_rows", [VERIFY_ROWS, 1], ids=["padded", "one row"])
def test_fp8_linear_single_token_reads_of_x(tuning, mode, x_rows):
    """At tokens = 1 every way of reading x's row 0 (16 gathered copies, one row per scale block, one per K step
    split in registers) gives row 0 of x · (q·s)ᵀ, as the same rows at T = 16 do, from x's other rows as well
    (a read of the wrong row shows) and from x's one row alone (the drafter's)."""
    kx, kw = jax.random.split(key_for("fp8_linear_one_token", str(tuning)))
    n, k = 128, 1024
    w = _weight(kw, (n, k), (128, 128))
    x = jax.random.normal(kx, (VERIFY_ROWS, k), F32).astype(BF16)
    assert plan(BF16, w, tokens=1, tuning=tuning)["x_row"] == mode
    assert plan(BF16, w, tuning=tuning)["x_row"] == "gather"
    got = pallas_linear(x[:x_rows], w, F32, tokens=1, tuning=tuning, interpret=True)
    assert got.shape == (x_rows, n)
    assert rel_err(got[:1], _exact(x[:1], w)) < 1e-5
    assert not np.asarray(got[1:]).any()  # the rows past the real one come out zero
    verify = pallas_linear(x, w, F32, tuning=tuning, interpret=True)
    assert rel_err(got[:1], verify[:1]) <= REORDER_TOL  # separate programs: XLA:CPU may order sums differently


def test_fp8_linear_refusals_name_the_dimension():
    w = S((128, 256), fp8.FP8), S((1, 2), F32)
    assert supports(S((ROWS + 1, 256), BF16), fp8.Fp8Array(*w)) and "rows" in supports(
        S((ROWS + 1, 256), BF16), fp8.Fp8Array(*w))
    narrow = fp8.Fp8Array(S((32, 256), fp8.FP8), S((4, 2), F32))  # blocks of 8 rows
    assert "N tile of 8" in supports(S((16, 256), BF16), narrow)
    short = fp8.Fp8Array(S((128, 256), fp8.FP8), S((1, 32), F32))  # blocks of 8 columns
    assert "K step of 8" in supports(S((16, 256), BF16), short)
    with pytest.raises(ValueError, match="at most 16 rows"):
        pallas_linear(jnp.ones((17, 256), BF16), _weight(key_for("x"), (128, 256), (128, 128)), interpret=True)


# ---- the MoE kernels with fp8 experts ------------------------------------------------------------------------------
MOE_CASES = [  # (T, blocks of gate/up, blocks of down, shared expert)
    (1, (32, 128), (128, 32), True),  # the decode: routing inside the up kernel, the shared expert split
    (3, (32, 64), (64, 32), True),  # a verify: route, then align-free grouped blocks
    (20, (64, 128), (128, 64), False),  # a prefill chunk: moe_align's blocks
    (1, (16, 32), (32, 16), False),  # the finest blocks
]


@pytest.mark.parametrize("dots", FP8_DOTS)
@pytest.mark.parametrize("t,up_block,down_block,with_shared", MOE_CASES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_fp8_routed_experts_match_reference(t, up_block, down_block, with_shared, dtype, dots):
    """routed_experts with fp8 experts (and shared expert) = the reference on the weights dequantized to f32 (f32
    activations: to reassociation; bf16: within h's rounding to bf16, which a reassociated sum may flip), and
    within bf16's rounding of the reference op on the fp8 weights themselves (dequantized to x's dtype); with
    either form of the fp8 dots (f16: bf16 rows passed in f16, exact there, h rounded to bf16 first)."""
    if dots == "f16" and dtype == F32:
        pytest.skip("f16 dots take bf16 rows alone")
    e, i, d, k = 16, 64, 128, 4
    keys = jax.random.split(key_for("fp8_moe", t, up_block, down_block, with_shared), 9)
    wg, wu = _weight(keys[0], (e, i, d), up_block), _weight(keys[1], (e, i, d), up_block)
    wd = _weight(keys[2], (e, d, i), down_block)
    shared = ((_weight(keys[3], (i, d), up_block), _weight(keys[4], (i, d), up_block),
               _weight(keys[5], (d, i), down_block)) if with_shared else None)
    rows = max(t, VERIFY_ROWS) if t <= VERIFY_ROWS else t
    x = jax.random.normal(keys[6], (rows, d), F32).astype(dtype)
    router, bias = jax.random.normal(keys[7], (e, d), F32) * 0.1, jax.random.normal(keys[8], (e,), F32) * 0.1
    routing = dict(top_k=k, n_group=4, topk_group=2, scaling=2.5, renormalize=True)
    extra = dict(shared=shared, shared_limit=7.0) if with_shared else {}
    if dots != "x":
        extra["tuning"] = dataclasses.replace(moe_experts._resolve(None, t, wg, k), fp8_dots=dots)
    assert moe_experts.supports_routed_experts(x, router, bias, wg, wu, wd, 4.0, tokens=t, **routing, **extra) is None
    got = moe_experts.routed_experts(x, router, bias, wg, wu, wd, 4.0, tokens=t, **routing, **extra, interpret=True)
    assert got.shape == (t, d)
    f32 = lambda w: w.dequantize(F32)
    exact_extra = dict(shared=tuple(map(f32, shared)), shared_limit=7.0) if with_shared else {}
    exact = moe_ops.routed_experts(x, router, bias, f32(wg), f32(wu), f32(wd), 4.0, tokens=t, **routing,
                                   **exact_extra)
    assert rel_err(got, exact) < (1e-5 if dtype == F32 else 1e-2)
    extra.pop("tuning", None)
    assert rel_err(got, moe_ops.routed_experts(x, router, bias, wg, wu, wd, 4.0, tokens=t, **routing, **extra)) < (
        1e-5 if dtype == F32 else 3e-2)


EXPERT_ROW_TUNINGS = [  # T = 1 tunings: how the up kernel reads x's row with fp8 experts
    moe_experts.ExpertTuning(bk_up=256, x_row_min_bytes=1 << 30),  # 16 gathered copies
    moe_experts.ExpertTuning(bk_up=256, x_row_min_bytes=64),  # one row per scale block
    moe_experts.ExpertTuning(bk_up=256, x_row_min_bytes=64, x_row_split=True),  # per K step, split in registers
    moe_experts.ExpertTuning(bk_up=256, x_row_split=True, warps_up=8, warps_down=8),  # bf16: gathered; f32: split
]


@pytest.mark.parametrize("tuning", EXPERT_ROW_TUNINGS)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_fp8_single_token_expert_row_reads(tuning, dtype):
    """routed_experts at T = 1 with fp8 experts and the shared expert, x's row read by the up kernel gathered, per
    scale block or per K step split in registers (blocks of 64 columns: 4 parts a step): the reference's result on
    the fp8 weights dequantized to f32, with other tokens in x's padded rows (a read of the wrong row shows)."""
    e, i, d, k = 16, 128, 256, 4
    keys = jax.random.split(key_for("fp8_moe_rows", str(tuning), dtype.__name__), 9)
    up_block, down_block = (32, 64), (64, 32)
    wg, wu = _weight(keys[0], (e, i, d), up_block), _weight(keys[1], (e, i, d), up_block)
    wd = _weight(keys[2], (e, d, i), down_block)
    shared = (_weight(keys[3], (i, d), up_block), _weight(keys[4], (i, d), up_block),
              _weight(keys[5], (d, i), down_block))
    x = jax.random.normal(keys[6], (VERIFY_ROWS, d), F32).astype(dtype)
    router, bias = jax.random.normal(keys[7], (e, d), F32) * 0.1, jax.random.normal(keys[8], (e,), F32) * 0.1
    routing = dict(top_k=k, n_group=4, topk_group=2, scaling=2.5, renormalize=True)
    kw = dict(tokens=1, **routing, shared=shared, shared_limit=7.0)
    assert moe_experts.supports_routed_experts(x, router, bias, wg, wu, wd, 4.0, **kw, tuning=tuning) is None
    got = moe_experts.routed_experts(x, router, bias, wg, wu, wd, 4.0, **kw, tuning=tuning, interpret=True)
    f32 = lambda w: w.dequantize(F32)
    exact = moe_ops.routed_experts(x, router, bias, f32(wg), f32(wu), f32(wd), 4.0, tokens=1, **routing,
                                   shared=tuple(map(f32, shared)), shared_limit=7.0)
    assert got.shape == (1, d)
    assert rel_err(got, exact) < (1e-5 if dtype == F32 else 1e-2)
    gathered = moe_experts.routed_experts(x, router, bias, wg, wu, wd, 4.0, **kw, tuning=EXPERT_ROW_TUNINGS[0],
                                          interpret=True)
    assert rel_err(got, gathered) <= (REORDER_TOL if dtype == F32 else 1e-2)  # bf16: h's rounding may flip


def test_fp8_experts_refuse_mixed_weights():
    """The expert kernels take all expert weights in fp8 or none: a mixed call is refused with a reason (the GPU
    then runs the reference, which takes either)."""
    e, i, d = 8, 64, 128
    x = S((VERIFY_ROWS, d), BF16)
    q = fp8.Fp8Array(S((e, i, d), fp8.FP8), S((e, 1, 1), F32))
    plain = S((e, d, i), BF16)
    reason = moe_experts.supports_fused_experts(x, q, q, plain, S((16, 2), F32), S((16, 2), jnp.int32), tokens=1)
    assert "partly in fp8" in reason


# ---- supports() at Flash's shapes and the Triton lowering for an H200 ---------------------------------------------
def _flash_fp8_calls(tp: int):
    """(label, supports, kernel, args, kw) of the fp8 calls a Flash decode/verify makes on one device at `tp`: every
    projection the Pallas linear reads (per-device shapes and device blocks from lingjax.model.fp8_layout) and the
    routed experts with the fused shared expert."""
    cfg = preset("flash")
    layout = fp8_layout(cfg, tp)
    d, p, nh, e, k = cfg.hidden_size, cfg.kda_dim, cfg.num_heads, cfg.num_experts, cfg.num_experts_per_tok
    i = cfg.moe_intermediate_size

    def w(path, shape, axis):  # an fp8 weight of the full shape, as one device holds it (split on `axis`)
        gn, gk = layout.device_block(path, shape)
        local = list(shape)
        if axis is not None:
            local[axis] //= tp
        local = tuple(local)
        return fp8.Fp8Array(S(local, fp8.FP8), S(local[:-2] + (local[-2] // gn, local[-1] // gk), F32))

    kda, mla, moe = ("layers", 2, "attn"), ("layers", 5, "attn"), ("layers", 5, "mlp")
    projections = {
        "kda in_proj": w(kda + ("in_proj",), (5 * p, d), 0),
        "kda o_proj": w(kda + ("o_proj",), (d, p), 1),
        "mla q_proj": w(mla + ("q_proj",), (nh * cfg.qk_head_dim, d), 0),
        "mla kv_a_proj": w(mla + ("kv_a_proj",), (cfg.mla_cache_dim, d), None),
        "mla o_proj": w(mla + ("o_proj",), (d, nh * cfg.v_head_dim), 1),
        "dense gate_proj": w(("layers", 0, "mlp", "gate_proj"), (cfg.intermediate_size, d), 0),
        "dense down_proj": w(("layers", 0, "mlp", "down_proj"), (d, cfg.intermediate_size), 1),
        "mtp eh_proj": w(("mtp", "eh_proj"), (d, 2 * d), None),
    }
    for label, weight in projections.items():
        for rows in (VERIFY_ROWS, 1):
            yield f"{label} rows={rows}", supports, pallas_linear, (S((rows, weight.shape[1]), BF16), weight), {}
    experts = (w(moe + ("w_gate",), (e, i, d), 1), w(moe + ("w_up",), (e, i, d), 1),
               w(moe + ("w_down",), (e, d, i), 2))
    shared = (w(moe + ("shared", "gate_proj"), (i, d), 0), w(moe + ("shared", "up_proj"), (i, d), 0),
              w(moe + ("shared", "down_proj"), (d, i), 1))
    routing = dict(top_k=k, n_group=cfg.n_group, topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
                   renormalize=cfg.norm_topk_prob, precision="f32")
    router = (S((e, d), BF16), S((e,), F32))
    x = S((VERIFY_ROWS, d), BF16)
    fused = dict(shared=shared, shared_limit=7.0)
    yield ("routed_experts T=1", moe_experts.supports_routed_experts, moe_experts.routed_experts,
           (x, *router, *experts, 4.0), dict(tokens=1, **routing, **fused))
    yield ("fused_experts T=4", moe_experts.supports_fused_experts, moe_experts.fused_experts,
           (x, *experts, S((VERIFY_ROWS, k), F32), S((VERIFY_ROWS, k), jnp.int32), 4.0), dict(tokens=4, **fused))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_flash_fp8_calls_are_supported_and_lower_for_an_h200(tp, h200):
    """Every fp8 kernel call of a Flash decode and verify at TP 1, 2, 4 and 8 is supported (at TP4 and TP8 the
    expert width's shards of 192 and 96 cut the 128-row blocks: device blocks of 64 and 32) and lowers to Triton IR
    for an H200."""
    for label, check, kernel, args, kw in _flash_fp8_calls(tp):
        assert check(*args, **kw) is None, (label, check(*args, **kw))
        _lower_for_cuda(kernel, args, kw)


def _lower_for_cuda(kernel, args, kw) -> None:
    """kernel(*args, **kw) (abstract arrays; floats stay static, `shared` a tuple of arrays) lowered for CUDA."""
    shared = kw.get("shared")
    static = {key: v for key, v in kw.items() if key != "shared"}
    arrays = [j for j, a in enumerate(args) if not isinstance(a, float)]

    def fn(*a):
        full = list(args)
        for j, v in zip(arrays, a):
            full[j] = v
        extra = {} if shared is None else dict(shared=a[len(arrays):])
        return kernel(*full, **static, **extra, interpret=False)

    jax.jit(fn).trace(*(args[j] for j in arrays), *(shared or ())).lower(lowering_platforms=("cuda",))


DECODE_VARIANTS = [  # the decode's (T = 1) other ways of reading x, at Flash's TP1 shapes
    ("linear", LinearTuning(x_row_split=True)),
    ("linear", LinearTuning(x_row_min_bytes=256)),
    ("linear", LinearTuning(warps=8, bk=512, k_splits=1, x_row_split=True)),  # four blocks a step
    ("routed_experts", moe_experts.ExpertTuning(bk_up=256, stages_up=3, bn_up=64, x_row_split=True)),
    ("routed_experts", moe_experts.ExpertTuning(bk_up=512, stages_up=3, bn_up=64, warps_up=8, x_row_split=True)),
    ("routed_experts", moe_experts.ExpertTuning(bk_up=256, stages_up=3, bn_up=64, x_row_min_bytes=256)),
]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("op,tuning", DECODE_VARIANTS)
def test_flash_fp8_decode_row_reads_lower_for_an_h200(op, tuning, h200):
    """The decode's x-row variants (one row per K step split in registers, one per scale block, 8 warps) at Flash's
    TP1 shapes lower to Triton IR for an H200, and supports() takes them."""
    calls = {label: (check, kernel, args, kw) for label, check, kernel, args, kw in _flash_fp8_calls(1)}
    if op == "linear":
        check, kernel, args, kw = calls["kda in_proj rows=1"]  # [20480, 2560]: K splits of 1280 columns
        kw = dict(kw, tokens=1)
    else:
        check, kernel, args, kw = calls["routed_experts T=1"]
    kw = dict(kw, tuning=tuning)
    assert check(*args, **kw) is None
    _lower_for_cuda(kernel, args, kw)
