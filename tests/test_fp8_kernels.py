"""The kernels that read fp8 weights (lingjax.pallas.fp8_linear, the fp8 forms of lingjax.pallas.moe_experts) in
interpret mode against their plain-JAX references on fresh random inputs, and their supports() against the Triton
lowering for an H200 at Flash's shapes at TP 1, 2, 4 and 8 (where a shard cuts the 128 x 128 blocks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import key_for, rel_err
from lingjax.config import VERIFY_ROWS, preset
from lingjax.model import fp8_layout
from lingjax.ops import fp8
from lingjax.ops import moe as moe_ops
from lingjax.ops.linear import linear
from lingjax.pallas import moe_experts
from lingjax.pallas.fp8_linear import ROWS, Fp8LinearTuning, fp8_linear, supports

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
    (16, 256, 512, (128, 128), Fp8LinearTuning()),
    (1, 96, 320, (32, 64), Fp8LinearTuning(bk=128)),  # a K step over two scale blocks; one row (the drafter's)
    (5, 128, 1024, (64, 128), Fp8LinearTuning(k_splits=2)),  # K splits added after the launch
    (16, 64, 256, (16, 16), Fp8LinearTuning(bn=16, bk=64)),  # the finest blocks the GPU takes
]


@pytest.mark.parametrize("rows,n,k,block,tuning", LINEAR_CASES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_fp8_linear_matches_reference(rows, n, k, block, tuning, dtype):
    """fp8_linear = x · (q·s)ᵀ with the dequantized weight unrounded (to f32 reassociation), and within bf16's
    rounding of the reference op (linear on the weight dequantized to x's dtype). Interpret mode fills outputs
    with NaN first: rel_err fails on any element left unwritten."""
    kx, kw = jax.random.split(key_for("fp8_linear", rows, n, k, block))
    w = _weight(kw, (n, k), block)
    x = jax.random.normal(kx, (rows, k), F32).astype(dtype)
    got = fp8_linear(x, w, F32, tuning=tuning, interpret=True)
    assert got.shape == (rows, n)
    assert rel_err(got, _exact(x, w)) < 1e-5
    assert rel_err(got, linear(x, w, F32)) < (1e-5 if dtype == F32 else 2e-2)


def test_fp8_linear_rounds_once_to_the_output_dtype():
    """The default output is x's dtype, rounded once from the f32 sums; leading dimensions are kept."""
    kx, kw = jax.random.split(key_for("fp8_linear_out"))
    w = _weight(kw, (128, 256), (128, 128))
    x = jax.random.normal(kx, (2, 3, 256), F32).astype(BF16)
    got = fp8_linear(x, w, interpret=True)
    assert got.shape == (2, 3, 128) and got.dtype == BF16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(fp8_linear(x, w, F32, interpret=True).astype(BF16), np.float32))


def test_fp8_linear_rows_are_independent():
    """A row's result does not depend on the other rows (a decode's row equals the same row of a verify)."""
    kx, kw = jax.random.split(key_for("fp8_linear_rows"))
    w = _weight(kw, (128, 512), (128, 128))
    x = jax.random.normal(kx, (VERIFY_ROWS, 512), F32).astype(BF16)
    whole = fp8_linear(x, w, F32, interpret=True)
    one = fp8_linear(x[:1], w, F32, interpret=True)
    np.testing.assert_array_equal(np.asarray(whole[:1]), np.asarray(one))


def test_fp8_linear_refusals_name_the_dimension():
    w = S((128, 256), fp8.FP8), S((1, 2), F32)
    assert supports(S((ROWS + 1, 256), BF16), fp8.Fp8Array(*w)) and "rows" in supports(
        S((ROWS + 1, 256), BF16), fp8.Fp8Array(*w))
    narrow = fp8.Fp8Array(S((32, 256), fp8.FP8), S((4, 2), F32))  # blocks of 8 rows
    assert "N tile of 8" in supports(S((16, 256), BF16), narrow)
    short = fp8.Fp8Array(S((128, 256), fp8.FP8), S((1, 32), F32))  # blocks of 8 columns
    assert "K step of 8" in supports(S((16, 256), BF16), short)
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8_linear(jnp.ones((17, 256), BF16), _weight(key_for("x"), (128, 256), (128, 128)), interpret=True)


# ---- the MoE kernels with fp8 experts ------------------------------------------------------------------------------
MOE_CASES = [  # (T, blocks of gate/up, blocks of down, shared expert)
    (1, (32, 128), (128, 32), True),  # the decode: routing inside the up kernel, the shared expert split
    (3, (32, 64), (64, 32), True),  # a verify: route, then align-free grouped blocks
    (20, (64, 128), (128, 64), False),  # a prefill chunk: moe_align's blocks
    (1, (16, 32), (32, 16), False),  # the finest blocks
]


@pytest.mark.parametrize("t,up_block,down_block,with_shared", MOE_CASES)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_fp8_routed_experts_match_reference(t, up_block, down_block, with_shared, dtype):
    """routed_experts with fp8 experts (and shared expert) = the reference on the weights dequantized to f32 (f32
    activations: to reassociation; bf16: within h's rounding to bf16, which a reassociated sum may flip), and
    within bf16's rounding of the reference op on the fp8 weights themselves (dequantized to x's dtype)."""
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
    assert moe_experts.supports_routed_experts(x, router, bias, wg, wu, wd, 4.0, tokens=t, **routing, **extra) is None
    got = moe_experts.routed_experts(x, router, bias, wg, wu, wd, 4.0, tokens=t, **routing, **extra, interpret=True)
    assert got.shape == (t, d)
    f32 = lambda w: w.dequantize(F32)
    exact_extra = dict(shared=tuple(map(f32, shared)), shared_limit=7.0) if with_shared else {}
    exact = moe_ops.routed_experts(x, router, bias, f32(wg), f32(wu), f32(wd), 4.0, tokens=t, **routing,
                                   **exact_extra)
    assert rel_err(got, exact) < (1e-5 if dtype == F32 else 1e-2)
    assert rel_err(got, moe_ops.routed_experts(x, router, bias, wg, wu, wd, 4.0, tokens=t, **routing, **extra)) < (
        1e-5 if dtype == F32 else 3e-2)


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
    projection fp8_linear reads (per-device shapes and device blocks from lingjax.model.fp8_layout) and the routed
    experts with the fused shared expert."""
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
            yield f"{label} rows={rows}", supports, fp8_linear, (S((rows, weight.shape[1]), BF16), weight), {}
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
def test_flash_fp8_calls_are_supported_and_lower_for_an_h200(tp, monkeypatch):
    """Every fp8 kernel call of a Flash decode and verify at TP 1, 2, 4 and 8 is supported (at TP4 and TP8 the
    expert width's shards of 192 and 96 cut the 128-row blocks: device blocks of 64 and 32) and lowers to Triton IR
    for an H200."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90))
    for label, check, kernel, args, kw in _flash_fp8_calls(tp):
        assert check(*args, **kw) is None, (label, check(*args, **kw))
        shared = kw.get("shared")
        static = {key: v for key, v in kw.items() if key != "shared"}
        arrays = [j for j, a in enumerate(args) if not isinstance(a, float)]

        def fn(*a, args=args, static=static, arrays=arrays, kernel=kernel, shared=shared):
            full = list(args)
            for j, v in zip(arrays, a):
                full[j] = v
            extra = {} if shared is None else dict(shared=a[len(arrays):])
            return kernel(*full, **static, **extra, interpret=False)

        jax.jit(fn).trace(*(args[j] for j in arrays), *(shared or ())).lower(lowering_platforms=("cuda",))
