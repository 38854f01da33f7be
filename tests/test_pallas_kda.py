"""Pallas KDA kernels (interpret mode on the CPU) against their plain-JAX references: chain-verify at
every T in 1..16 (and on padded rows), chunked prefill, their supports() against the Triton lowering for
every fixture and preset, and the model with kernels="pallas" for the KDA ops."""

import dataclasses
import functools
import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, REORDER_TOL, key_for, rel_err
from lingjax.cache import conv_ring_size
from lingjax.config import VERIFY_ROWS, LingConfig, preset
from lingjax.ops import kda
from lingjax.ops.norms import l2norm
from lingjax.pallas import kda_chain, kda_prefill
from lingjax.pallas.kda_chain import ChainTuning, kda_chain_verify
from lingjax.pallas.kda_prefill import PrefillTuning, kda_chunked_prefill, precision_for

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

# The plain-JAX references under jit: one compile per shape, where eagerly every op compiles on its own
# (kda_chain took ~3 s at each new shape eagerly, ~1 s jitted; the tests draw a dozen shapes)
_chain_ref = jax.jit(kda.kda_chain, static_argnames=("tokens", "num_heads", "safe_gate", "lower_bound"))
_chunked_ref = jax.jit(kda.kda_chunked, static_argnames="chunk")
_recurrent_ref = jax.jit(kda.kda_recurrent)


def _chain_inputs(seed, rows, h, d, dtype, w=4, dm=96, start=None):
    """The chain op's positional arguments on `rows` rows of random projections: the rows past the
    tokens a test passes are garbage the op must not read. dm: the model width x and b_proj have (96:
    the kernel sums beta's dot in 3 chunks of 32). The conv ring has the model's 16 + W - 1 slots, all
    random; start (default: from the seed, 0..18) sets which of them are the window, wrapping past slot 0
    at some seeds."""
    ks = jax.random.split(key_for("pallas-chain", seed, rows, h, d, str(dtype)), 8)
    p = h * d
    slots = 16 + w - 1
    return (jax.random.normal(ks[0], (rows, 5 * p)).astype(dtype),  # proj: q|k|v|f|g, as the model's in_proj
            jax.random.normal(ks[1], (rows, dm)).astype(dtype),  # x, the layer's input
            (jax.random.normal(ks[7], (h, dm)) / dm**0.5).astype(dtype),  # b_proj
            jax.random.normal(ks[2], (slots, 3 * p)).astype(dtype),  # the conv ring
            jnp.int32((7 * seed + 1) % slots if start is None else start),  # start: the first row's position
            0.5 * jax.random.normal(ks[3], (3 * p, w)),  # conv_w
            jnp.log(jax.random.uniform(ks[4], (h,), minval=1, maxval=16)),  # a_log
            jax.random.normal(ks[5], (p,)),  # dt_bias
            jax.random.normal(ks[6], (h, d, d)))  # state


def _real_rows(args, t):
    """The same arguments with proj and x cut to their first t rows (rows == T)."""
    return (args[0][:t], args[1][:t]) + args[2:]


def _unoptimised(fn):
    """fn compiled with LLVM's optimisations off. At -O2 XLA's CPU backend contracts a multiply and an add
    into one rounding, or not, by the fusion around them, and the kernel's stores (its conv ring rows) move
    those fusions: o then differed by 1 ulp between T = 1 and T = 7 in interpret mode. At -O0 each op rounds
    as written, so the bit-for-bit checks below see the kernel's own arithmetic; the H200's compile is
    checked end to end by bench/lossless_check.py (speculative output equal to plain decode's)."""
    static = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    return jax.jit(fn, static_argnames=static, compiler_options={"xla_backend_optimization_level": 0})


_verify_unoptimised = _unoptimised(kda_chain_verify)


BV8 = ChainTuning(block_v=8)  # the tests' default tile: several V tiles at head dim 16 and 32


def _verify(args, t, h, safe=True, tuning=BV8, fn=kda_chain_verify):
    """fn (kda_chain_verify, or _verify_unoptimised) on _chain_inputs' arguments with its keywords in one
    order: jit caches a compile by the keywords as passed, so the tests' calls of one configuration (in
    different tests too) share one compile."""
    return fn(*args, tokens=t, num_heads=h, safe_gate=safe, lower_bound=-5.0, tuning=tuning)


def _check_chain(t, h, d, dtype, seed, safe=True, tuning=BV8, rows=None, fn=kda_chain_verify):
    """T = t tokens of `rows` (default t) rows against the reference; rows past t must come out zero.
    fn: as _verify's."""
    rows = rows or t
    args = _chain_inputs(seed, rows, h, d, dtype)
    o, staged, ring = _verify(args, t, h, safe, tuning, fn)
    o_ref, staged_ref, ring_ref = _chain_ref(*args, tokens=t, num_heads=h, safe_gate=safe, lower_bound=-5.0)
    assert o.shape == o_ref.shape == (rows, h, d) and staged.shape == staged_ref.shape == (t, h, d, d)
    # the ring: the T rows' inputs at their slots, every other slot as it was (a copy: bit for bit)
    assert np.array_equal(np.asarray(ring, np.float32), np.asarray(ring_ref, np.float32))
    # interpret mode fills outputs with NaN before the kernel runs: rel_err fails on any unwritten element,
    # and so does the exact zero check of the padding rows
    assert rel_err(o, o_ref) <= TOL[dtype]
    assert rel_err(staged, staged_ref) <= TOL[dtype]
    assert np.array_equal(np.asarray(o[t:]), np.zeros((rows - t, h, d)))
    assert np.array_equal(np.asarray(o_ref[t:]), np.zeros((rows - t, h, d)))
    return args, o, staged


@pytest.mark.parametrize("t", range(1, 17))
def test_chain_verify_every_t(t):
    _check_chain(t, 3, 16, jnp.float32, 0)  # fresh inputs each run (the salt); two seeds: the bf16 test below


def test_chain_decode_in_place():
    """T = 1 writes the new state over the old (staged aliases the state): donated, the result is the
    reference's and the same bit for bit as the out-of-place call (in interpret mode the output starts
    as the old state, not NaN: every element of it must change, which the reference comparison sees)."""
    args = _chain_inputs(13, 16, 3, 16, jnp.float32)
    cfg = dict(tokens=1, num_heads=3, safe_gate=True, lower_bound=-5.0, tuning=BV8)
    want = _chain_ref(*args, tokens=1, num_heads=3, safe_gate=True, lower_bound=-5.0)
    apart = kda_chain_verify(*args, **cfg, in_place=False)
    fresh = args[:3] + (args[3] + 0.0,) + args[4:8] + (args[8] + 0.0,)  # donated copies of the ring and state
    donated = jax.jit(lambda *a: kda_chain_verify(*a, **cfg), donate_argnums=(3, 8))(*fresh)
    for got, ref in zip(donated, want):
        assert rel_err(got, ref) <= TOL[jnp.float32]
    for x, y in zip(donated, apart):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert not np.any(np.asarray(donated[1][0]) == np.asarray(args[8]))


@pytest.mark.parametrize("t", [2, 16])
def test_chain_verify_bf16_inputs(t):
    for seed in range(2):
        _check_chain(t, 3, 32, jnp.bfloat16, seed)


@pytest.mark.parametrize("t,h", [(1, 5), (6, 3)])
def test_chain_verify_heads_and_gate_forms(t, h):
    """Odd head counts at T = 1 and a middle T (T = 2 and 16 in bf16 above; one head in the tests below),
    the non-safe gate at the middle T (its rows' code is the same at T = 1)."""
    _check_chain(t, h, 32, jnp.float32, 3)
    if t > 1:
        _check_chain(t, h, 32, jnp.float32, 4, safe=False)


def test_chain_verify_tiles():
    """BV tiling (down to 4 columns) changes results only in rounding (on the GPU BV16 and BV32 differ in
    the last bits: two programs, so REORDER_TOL); the non-safe gate is fused too."""
    bv4 = ChainTuning(block_v=4)
    args, _, staged = _check_chain(3, 1, 32, jnp.float32, 7, tuning=bv4)
    _, staged_wide, _ = _verify(args, 3, 1, tuning=ChainTuning(block_v=32))
    assert rel_err(staged, staged_wide) <= REORDER_TOL
    _check_chain(3, 1, 32, jnp.float32, 8, safe=False, tuning=bv4)


@pytest.mark.parametrize("tiles", [2, 4])  # 4 x BV 8 = V: one program per head
def test_chain_verify_tiles_per_program(tiles):
    """Several V tiles per program (prologue once per program) give the one-tile results (two programs:
    REORDER_TOL). The one-tile kernels at T = 1 and 16 are those of test_chain_verify_heads_and_gate_forms
    and _bf16_inputs (their shapes: one compile each in a process); T = 7 on 16 rows interleaves the
    tiles' chains over several rows with padding rows present."""
    tuning = dataclasses.replace(BV8, tiles_per_program=tiles)
    for t, h, dtype, rows in [(1, 5, jnp.float32, None), (7, 5, jnp.float32, 16), (16, 3, jnp.bfloat16, None)]:
        args, o, staged = _check_chain(t, h, 32, dtype, 9, rows=rows, tuning=tuning)
        o1, staged1, _ = _verify(args, t, h)
        assert rel_err(o, o1) <= REORDER_TOL and rel_err(staged, staged1) <= REORDER_TOL


def test_chain_verify_head_dim_128():
    _check_chain(4, 1, 128, jnp.float32, 0, tuning=ChainTuning(block_v=64))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chain_verify_padded_rows(dtype):
    """T real rows of 16, as a decode/verify forward passes them, the padding rows random garbage:
    the reference's results, zero output rows past T (_check_chain), and row invariance bit for bit (one
    program at two input shapes): the same as the call on the real rows alone, and row j the same whatever
    T. All in an unoptimised compile (see _unoptimised), the reference check too (padded rows at -O2:
    test_chain_verify_tiles_per_program's one-tile calls at T = 7)."""
    h, d, rows = 3, 16, 16
    out = {}
    for t in (1, 4, 7):  # seed 12 throughout: the same 16 input rows, the first T real
        args, o, staged = _check_chain(t, h, d, dtype, 12, rows=rows, fn=_verify_unoptimised)
        o_real, staged_real, _ = _verify(_real_rows(args, t), t, h, fn=_verify_unoptimised)
        assert np.array_equal(np.asarray(o[:t]), np.asarray(o_real))
        assert np.array_equal(np.asarray(staged), np.asarray(staged_real))
        out[t] = np.asarray(o), np.asarray(staged)
    for t in (1, 4):
        assert np.array_equal(out[t][0][:t], out[7][0][:t]) and np.array_equal(out[t][1], out[7][1][:t])


def test_chain_verify_rows_equal_sequential_decode():
    """Verify row r's staged state = r+1 decode steps (T=1 calls) with the ring carried along, and the
    verify's ring = the ring after the decode steps, bit for bit; the verify wraps past the ring's last slot."""
    t, h, d = 5, 3, 16
    args = _chain_inputs(11, t, h, d, jnp.float32, start=17)
    proj, x, b_proj, ring, start, conv_w, a_log, dt_bias, state = args
    cfg = dict(num_heads=h, safe_gate=True, lower_bound=-5.0)
    o, staged, ring_verify = kda_chain_verify(*args, tokens=t, **cfg)
    s = state
    for r in range(t):
        o_r, st_r, ring = kda_chain_verify(proj[r:r + 1], x[r:r + 1], b_proj, ring, start + r, conv_w, a_log, dt_bias,
                                           s, tokens=1, **cfg)
        s = st_r[0]
        assert rel_err(staged[r], s) <= 1e-5 and rel_err(o[r], o_r[0]) <= 1e-5
    assert np.array_equal(np.asarray(ring), np.asarray(ring_verify))


def _prefill_inputs(seed, t, h, d, pad=0):
    ks = jax.random.split(key_for("pallas-prefill", seed, t, h, d), 6)
    q = l2norm(jax.random.normal(ks[0], (t, h, d))) * d**-0.5
    k = l2norm(jax.random.normal(ks[1], (t, h, d)))
    v = jax.random.normal(ks[2], (t, h, d))
    g = -5.0 * jax.nn.sigmoid(2 * jax.random.normal(ks[3], (t, h, d)))  # the safe gate's range (-5, 0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (t, h)))
    if pad:  # padding rows: g = 0, beta = 0
        g, beta = g.at[t - pad:].set(0.0), beta.at[t - pad:].set(0.0)
    return q, k, v, g, beta, jax.random.normal(ks[5], (h, d, d))  # a non-zero initial state


def _recurrence_tol(chunk):
    """f32 tolerance against the recurrence: the chunked form exponentiates differences of in-chunk prefix
    sums of g (|G| up to 5·C), so its rounding grows with the chunk. Measured over 60 draws, the plain-JAX
    kda_chunked deviates from kda_recurrent by up to 3e-6 (C=16), 8e-6 (C=32), 1.8e-5 (C=64); the kernel
    tracks kda_chunked to ~3e-7. Against kda_chunked (same chunk) the tolerance stays 1e-5."""
    return 1e-5 * max(1, chunk // 16)


# Relative to the reference's max (interpret mode computes every dot in f32). Shapes cover T below one
# chunk, T not a multiple of the chunk (padded inside), odd head counts, one and several 16-row
# sub-chunks per chunk, column pieces (block_k, prepare_block_k < d), state row pieces (state_block_k
# < d) and V tiles.
@pytest.mark.parametrize("t,h,d,kw", [
    (1, 3, 16, dict(chunk=16)),
    (40, 3, 16, dict(chunk=16, block_v=16)),
    (70, 1, 32, dict(chunk=32, block_k=16, block_v=16)),
    (100, 5, 32, dict(chunk=64, block_k=16, state_block_k=16, block_v=16)),
    (64, 2, 32, dict(chunk=64, block_k=32)),
    (33, 3, 64, dict(chunk=32, block_k=32, prepare_block_k=32, state_block_k=32, block_v=32)),
])
def test_chunked_prefill_matches_references(t, h, d, kw):
    tuning = PrefillTuning(**kw)
    for seed in range(2):
        args = _prefill_inputs(seed, t, h, d)
        o, s = kda_chunked_prefill(*args, tuning=tuning)  # interpret mode NaN-fills outputs: rel_err fails on gaps
        assert o.shape == (t, h, d) and s.shape == (h, d, d)
        o_ref, s_ref = _chunked_ref(*args, chunk=tuning.chunk)
        assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
        o_rec, s_rec = _recurrent_ref(*args)
        tol = _recurrence_tol(tuning.chunk)
        assert rel_err(o, o_rec) <= tol and rel_err(s, s_rec) <= tol


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_gate_extremes(chunk):
    """Decays at the safe gate's bound (g in (-5, -4.95): the largest factored exponents, e^{8·5}) and near
    0 (g in (-0.01, 0): almost no decay over many chunks)."""
    q, k, v, _, beta, s0 = _prefill_inputs(3, 96, 2, 16)
    u = jax.random.uniform(key_for("pallas-prefill-gate", chunk), k.shape)
    for g in (-5.0 + 0.05 * u, -0.01 * u):
        args = (q, k, v, g, beta, s0)
        o, s = kda_chunked_prefill(*args, tuning=PrefillTuning(chunk=chunk))
        o_rec, s_rec = _recurrent_ref(*args)
        assert rel_err(o, o_rec) <= _recurrence_tol(chunk) and rel_err(s, s_rec) <= _recurrence_tol(chunk)


def test_chunked_prefill_padding_rows_leave_state():
    args = _prefill_inputs(5, 48, 3, 16, pad=13)
    _, s = kda_chunked_prefill(*args, tuning=PrefillTuning(chunk=16, block_v=16))
    _, s_ref = _recurrent_ref(*(a[:35] for a in args[:5]), args[5])
    assert rel_err(s, s_ref) <= 1e-5


# bf16 inputs (q, k, v; g, beta and the state f32 as in the model) take the bf16 path (fla's roundings:
# bf16 operands between the phases and in most dots) within bf16's 1e-2. Covers several sub-chunks per
# chunk and column pieces with bf16 operands.
@pytest.mark.parametrize("t,h,d,kw", [
    (64, 3, 16, dict(chunk=32, block_v=16)),
    (100, 2, 32, dict(chunk=64, block_k=16, prepare_block_k=16)),
])
def test_chunked_prefill_bf16_inputs(t, h, d, kw):
    q, k, v, g, beta, s0 = _prefill_inputs(6, t, h, d)
    args = (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), g, beta, s0)
    assert precision_for(*args[:3]) == "bf16" and precision_for(q, k, v) == "tf32x3"
    o_rec, s_rec = _recurrent_ref(*(a.astype(jnp.float32) for a in args))
    o, s = kda_chunked_prefill(*args, tuning=PrefillTuning(**kw))
    assert rel_err(o, o_rec) <= TOL[jnp.bfloat16] and rel_err(s, s_rec) <= TOL[jnp.bfloat16]


# ---- supports() against the Triton lowering for an H200 (tracing only, no compile: see
# tests/test_pallas_lowering.py), over the shapes lingjax.model passes each op on one device

def _configs():
    """(id, LingConfig, tp, dtype): every fixture at TP 1 and 2 where its heads divide, in f32 (the tests'
    dtype) and bf16 (load's default); presets tiny and mid at TP 1 and 2, flash at 1, 2, 4 and 8, in bf16;
    and tiny with head dims 8 and 24, which the kernels do not all take."""
    out = []
    for path in sorted(FIXTURES.glob("*/config.json")):
        cfg = LingConfig.from_file(path)
        for tp in (1, 2):
            if cfg.kda_num_heads % tp == 0:
                out += [(f"{path.parent.name}-tp{tp}-{jnp.dtype(dt).name}", cfg, tp, dt)
                        for dt in (jnp.float32, jnp.bfloat16)]
    for name, tps in (("tiny", (1, 2)), ("mid", (1, 2)), ("flash", (1, 2, 4, 8))):
        out += [(f"{name}-tp{tp}", preset(name), tp, jnp.bfloat16) for tp in tps]
    out += [(f"tiny-d{d}", dataclasses.replace(preset("tiny"), kda_head_dim=d), 1, jnp.float32) for d in (8, 24)]
    return out


_CONFIGS = {c[0]: c[1:] for c in _configs()}


def _chain_shapes(cfg, tp, dtype, tokens):
    """kda_chain's arguments and keywords as KDAAttention passes them (lingjax.model), per device under TP
    (heads and channels split, lingjax.sharding), on VERIFY_ROWS padded rows."""
    S = jax.ShapeDtypeStruct
    h, d, dm, w = cfg.kda_num_heads // tp, cfg.kda_head_dim, cfg.hidden_size, cfg.conv_size
    p, f32 = h * d, jnp.float32
    args = (S((VERIFY_ROWS, 5 * p), dtype), S((VERIFY_ROWS, dm), dtype), S((h, dm), dtype),
            S((conv_ring_size(cfg), 3 * p), dtype), S((), jnp.int32), S((3 * p, w), f32), S((h,), f32), S((p,), f32),
            S((h, d, d), f32))
    return args, dict(tokens=tokens, num_heads=h, safe_gate=cfg.kda_safe_gate, lower_bound=cfg.kda_lower_bound)


def _prefill_shapes(cfg, tp, dtype, tokens):
    """kda_chunked's arguments as KDAAttention passes them: q, k, v in the activations' dtype, g, beta and
    the state f32."""
    S = jax.ShapeDtypeStruct
    h, d, f32 = cfg.kda_num_heads // tp, cfg.kda_head_dim, jnp.float32
    return (S((tokens, h, d), dtype),) * 3 + (S((tokens, h, d), f32), S((tokens, h), f32), S((h, d, d), f32)), {}


def _lowered_triton_calls(fn, args) -> int:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("__gpu$xla.gpu.triton")


# (op, the kernel's supports and entry, the shapes, the Triton launches one call makes, the widths: a
# decode and a verify on 16 rows for the chain, a prefill chunk (engine.PREFILL_CHUNK's smallest bucket,
# and one not a multiple of the kernel's chunk) for the prefill)
_OPS = {"kda_chain": (kda_chain.supports, kda_chain_verify, _chain_shapes, 1, (1, 4)),
        "kda_chunked": (kda_prefill.supports, kda_chunked_prefill, _prefill_shapes, 3, (32, 100))}


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("config", list(_CONFIGS))
def test_supports_matches_triton_lowering(config, op, h200):
    """Where supports() takes a shape the kernel lowers to Triton for an H200; where it does not it says
    why in a line. Every shape of the mid and flash presets is supported (on the GPU they run today's
    kernels), at TP 1, 2, 4 and 8."""
    cfg, tp, dtype = _CONFIGS[config]
    supports, kernel, shapes, launches, widths = _OPS[op]
    for tokens in widths:
        args, kw = shapes(cfg, tp, dtype, tokens)
        reason = supports(*args, **kw)
        if reason is None:
            fn = functools.partial(kernel, **kw, interpret=False)
            assert _lowered_triton_calls(fn, args) == launches, (config, op, tokens)
        else:
            assert isinstance(reason, str) and reason.strip() and "\n" not in reason, reason
            assert not config.startswith(("mid", "flash")), (config, op, reason)
    if config.startswith(("mid-tp1", "flash-tp1")):  # and the presets at every TP, by supports() alone
        for split, tokens in itertools.product((1, 2, 4, 8), widths):
            args, kw = shapes(cfg, split, dtype, tokens)
            assert supports(*args, **kw) is None, (config, op, split, tokens)


def test_model_logits_with_pallas_kda(hf_fixture):
    """The HF fixtures' f32 logits with every Pallas kernel, the KDA ones included (prompts of <= 16 tokens take
    chain-verify, longer ones prefill)."""
    import lingjax

    ref = np.load(hf_fixture / "reference.npz")
    model = lingjax.load(hf_fixture, dtype="float32", kernels="pallas")
    logits = model.logits(ref["prompt_ids"])
    assert rel_err(logits, ref["logits"]) <= 1e-4
