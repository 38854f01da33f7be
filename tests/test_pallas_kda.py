"""Pallas KDA kernels (interpret mode on the CPU) against their plain-JAX references:
chain-verify at every T in 1..16 (and on padded rows), commit, chunked prefill, and the model with
kernels="pallas" for the KDA ops."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import key_for, rel_err
from lingjax.ops import kda
from lingjax.ops.norms import l2norm
from lingjax.pallas.kda_chain import kda_chain_verify, kda_commit, kda_commit_reference
from lingjax.pallas.kda_prefill import default_precision, kda_chunked_prefill

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


# kda_chain_verify options: the first measured version, each option alone, both (these four unrolled at
# every T), the row loop (pinned; today also the default, which test_chain_verify_every_t runs as is: a
# separate {} entry compiled and checked the same kernel twice)
CHAIN_OPTS = {"first": dict(hoist_loads=False, parallel_read=False, row_loop=False),
              "hoisted": dict(hoist_loads=True, parallel_read=False, row_loop=False),
              "parallel": dict(hoist_loads=False, parallel_read=True, row_loop=False),
              "hoisted-parallel": dict(row_loop=False),
              "row-loop": dict(row_loop=True),
              "row-loop-serial-read": dict(row_loop=True, parallel_read=False),
              "unrolled-norms-first": dict(row_loop=False, deferred_norms=False),
              "row-loop-norms-first": dict(row_loop=True, deferred_norms=False),
              "first-norms-first": dict(hoist_loads=False, parallel_read=False, row_loop=False, deferred_norms=False),
              "row-loop-serial-norms-first": dict(row_loop=True, parallel_read=False, deferred_norms=False)}


def _unoptimised(fn):
    """fn compiled with LLVM's optimisations off. At -O2 XLA's CPU backend contracts a multiply and an add
    into one rounding, or not, by the fusion around them, and the kernel's stores (its conv ring rows) move
    those fusions: o then differed by 1 ulp between T = 1 and T = 7 in interpret mode. At -O0 each op rounds
    as written, so the bit-for-bit checks below see the kernel's own arithmetic; the H200's compile is
    checked bit for bit by bench/kda_bench.py and the model-level bench/lossless_check.py."""
    static = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    return jax.jit(fn, static_argnames=static, compiler_options={"xla_backend_optimization_level": 0})


_verify_unoptimised = _unoptimised(kda_chain_verify)


def _verify(args, t, h, safe=True, block_v=8, fn=kda_chain_verify, **opts):
    """fn (kda_chain_verify, or _verify_unoptimised) on _chain_inputs' arguments with its keywords in one
    order: jit caches a compile by the keywords as passed, so the tests' calls of one configuration (in
    different tests too) share one compile."""
    return fn(*args, tokens=t, num_heads=h, safe_gate=safe, lower_bound=-5.0, block_v=block_v, **opts)


def _check_chain(t, h, d, dtype, seed, safe=True, block_v=8, rows=None, fn=kda_chain_verify, **opts):
    """T = t tokens of `rows` (default t) rows against the reference; rows past t must come out zero.
    fn: as _verify's."""
    rows = rows or t
    args = _chain_inputs(seed, rows, h, d, dtype)
    o, staged, ring = _verify(args, t, h, safe, block_v, fn, **opts)
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
def test_chain_verify_every_t(t):  # the default path; the other options at T = 1, 2, 6, 16 below
    for seed in range(2):
        _check_chain(t, 3, 16, jnp.float32, seed)


@pytest.mark.parametrize("row_loop", [True, False])
def test_chain_decode_in_place(row_loop):
    """T = 1 writes the new state over the old (staged aliases the state): donated, the result is the
    reference's and the same bit for bit as the out-of-place call (in interpret mode the output starts
    as the old state, not NaN: every element of it must change, which the reference comparison sees)."""
    args = _chain_inputs(13, 16, 3, 16, jnp.float32)
    cfg = dict(tokens=1, num_heads=3, safe_gate=True, lower_bound=-5.0, block_v=8, row_loop=row_loop)
    want = _chain_ref(*args, tokens=1, num_heads=3, safe_gate=True, lower_bound=-5.0)
    apart = kda_chain_verify(*args, **cfg, in_place=False)
    fresh = args[:3] + (args[3] + 0.0,) + args[4:8] + (args[8] + 0.0,)  # donated copies of the ring and state
    donated = jax.jit(lambda *a: kda_chain_verify(*a, **cfg), donate_argnums=(3, 8))(*fresh)
    for got, ref in zip(donated, want):
        assert rel_err(got, ref) <= TOL[jnp.float32]
    for x, y in zip(donated, apart):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert not np.any(np.asarray(donated[1][0]) == np.asarray(args[8]))


# T = 16 unrolled is the costliest interpret-mode compile of this module: every row-loop option and the
# first unrolled kernel run there, the other unrolled kernels at T = 2 (and at T = 1, 6 in f32 below)
_BF16_CASES = ([(2, o) for o in CHAIN_OPTS]
               + [(16, o) for o, kw in CHAIN_OPTS.items() if o == "first" or kw.get("row_loop")])


@pytest.mark.parametrize("t,opts", _BF16_CASES)
def test_chain_verify_bf16_inputs(t, opts):
    for seed in range(2):
        _check_chain(t, 3, 32, jnp.bfloat16, seed, **CHAIN_OPTS[opts])


@pytest.mark.parametrize("opts", list(CHAIN_OPTS))
@pytest.mark.parametrize("t,h", [(1, 5), (6, 3)])
def test_chain_verify_options(t, h, opts):
    """Each option alone and combined, odd head counts, both gate forms, at T = 1 and a middle T (T = 2 and
    16 in bf16 above; one head in the tests below). (T = 11 on one head was a second middle T: the same code
    as T = 6 with more rows, and the unrolled kernels' costliest compiles in this module.) The non-safe gate
    at the middle T only: its rows' code is the same at T = 1."""
    _check_chain(t, h, 32, jnp.float32, 3, **CHAIN_OPTS[opts])
    if t > 1:
        _check_chain(t, h, 32, jnp.float32, 4, safe=False, **CHAIN_OPTS[opts])


@pytest.mark.parametrize("opts", ["first", "hoisted-parallel", "row-loop"])
def test_chain_verify_tiles_and_gate_forms(opts):
    """BV tiling (down to 4 columns) changes results only in rounding (on the GPU BV16 and BV32 differ in
    the last bits); the non-safe gate is fused too."""
    opts = CHAIN_OPTS[opts]
    args, _, staged = _check_chain(3, 1, 32, jnp.float32, 7, block_v=4, **opts)
    _, staged_wide, _ = _verify(args, 3, 1, block_v=32, **opts)
    assert rel_err(staged, staged_wide) <= 1e-6
    _check_chain(3, 1, 32, jnp.float32, 8, safe=False, block_v=4, **opts)


@pytest.mark.parametrize("tiles", [2, 4])  # 4 x BV 8 = V: one program per head
@pytest.mark.parametrize("opts", ["first", "hoisted-parallel", "row-loop"])
def test_chain_verify_tiles_per_program(tiles, opts):
    """Several V tiles per program (prologue once per program) give the one-tile results. The one-tile
    kernels at T = 1 and 16 are those of test_chain_verify_options and _bf16_inputs (their shapes: one
    compile each in a process). T = 16 in the row loop only: unrolled, with several tiles it was this
    module's costliest compile, and T = 7 already interleaves the tiles' chains over several rows."""
    cases = [(1, 5, jnp.float32, None), (7, 5, jnp.float32, 16)]
    for t, h, dtype, rows in cases + ([(16, 3, jnp.bfloat16, None)] if CHAIN_OPTS[opts].get("row_loop") else []):
        args, o, staged = _check_chain(t, h, 32, dtype, 9, rows=rows, tiles_per_program=tiles, **CHAIN_OPTS[opts])
        o1, staged1, _ = _verify(args, t, h, **CHAIN_OPTS[opts])
        assert rel_err(o, o1) <= 1e-6 and rel_err(staged, staged1) <= 1e-6


@pytest.mark.parametrize("opts", ["first", "hoisted-parallel", "row-loop"])
def test_chain_verify_head_dim_128(opts):
    _check_chain(4, 1, 128, jnp.float32, 0, block_v=64, **CHAIN_OPTS[opts])


@pytest.mark.parametrize("dtype,opts", [(jnp.float32, "first"), (jnp.float32, "hoisted-parallel"),
                                        (jnp.float32, "row-loop"), (jnp.bfloat16, "first"), (jnp.bfloat16, "row-loop")])
def test_chain_verify_padded_rows(dtype, opts):
    """T real rows of 16, as a decode/verify forward passes them, the padding rows random garbage:
    the reference's results, zero output rows past T (_check_chain), and row invariance bit for bit: the
    same as the call on the real rows alone, and row j the same whatever T. All in an unoptimised compile
    (see _unoptimised), the reference check too: an -O2 compile of the same call checked it a second
    time (padded rows at -O2: test_chain_verify_tiles_per_program's one-tile calls at T = 7)."""
    h, d, rows = 3, 16, 16
    out = {}
    for t in (1, 4, 7):  # seed 12 throughout: the same 16 input rows, the first T real
        args, o, staged = _check_chain(t, h, d, dtype, 12, rows=rows, fn=_verify_unoptimised, **CHAIN_OPTS[opts])
        o_real, staged_real, _ = _verify(_real_rows(args, t), t, h, fn=_verify_unoptimised, **CHAIN_OPTS[opts])
        assert np.array_equal(np.asarray(o[:t]), np.asarray(o_real))
        assert np.array_equal(np.asarray(staged), np.asarray(staged_real))
        out[t] = np.asarray(o), np.asarray(staged)
    for t in (1, 4):
        assert np.array_equal(out[t][0][:t], out[7][0][:t]) and np.array_equal(out[t][1], out[7][1][:t])


@pytest.mark.parametrize("opts", ["first", "hoisted-parallel", "row-loop"])
def test_chain_verify_rows_equal_sequential_decode(opts):
    """Verify row r's staged state = r+1 decode steps (T=1 calls) with the ring carried along, and the
    verify's ring = the ring after the decode steps, bit for bit; the verify wraps past the ring's last slot."""
    t, h, d = 5, 3, 16
    args = _chain_inputs(11, t, h, d, jnp.float32, start=17)
    proj, x, b_proj, ring, start, conv_w, a_log, dt_bias, state = args
    cfg = dict(num_heads=h, safe_gate=True, lower_bound=-5.0, **CHAIN_OPTS[opts])
    o, staged, ring_verify = kda_chain_verify(*args, tokens=t, **cfg)
    s = state
    for r in range(t):
        o_r, st_r, ring = kda_chain_verify(proj[r:r + 1], x[r:r + 1], b_proj, ring, start + r, conv_w, a_log, dt_bias,
                                           s, tokens=1, **cfg)
        s = st_r[0]
        assert rel_err(staged[r], s) <= 1e-5 and rel_err(o[r], o_r[0]) <= 1e-5
    assert np.array_equal(np.asarray(ring), np.asarray(ring_verify))


@pytest.mark.parametrize("t", [1, 4, 16])
def test_commit_zero_and_all_accept(t):
    staged = jax.random.normal(key_for("pallas-commit", t), (t, 3, 16, 16))
    for n in sorted({0, t // 2, t - 1}):  # zero-accept, partial, all-accept
        state = kda_commit(staged, jnp.int32(n))
        assert np.array_equal(np.asarray(state), np.asarray(kda_commit_reference(staged, jnp.int32(n))))
        assert np.array_equal(np.asarray(state), np.asarray(staged[n]))


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
# < d), V tiles, and both output forms (fused into the state pass, or a separate pass over the states).
@pytest.mark.parametrize("t,h,d,kw", [
    (1, 3, 16, dict(chunk=16)),
    (40, 3, 16, dict(chunk=16, block_v=16)),
    (70, 1, 32, dict(chunk=32, block_k=16, block_v=16, fuse_output=False)),
    (100, 5, 32, dict(chunk=64, block_k=16, state_block_k=16, block_v=16)),
    (64, 2, 32, dict(chunk=64, block_k=32, fuse_output=False)),
    (33, 3, 64, dict(chunk=32, block_k=32, prepare_block_k=32, state_block_k=32, block_v=32)),
])
def test_chunked_prefill_matches_references(t, h, d, kw):
    for seed in range(2):
        args = _prefill_inputs(seed, t, h, d)
        o, s = kda_chunked_prefill(*args, **kw)  # interpret mode NaN-fills outputs: rel_err fails on gaps
        assert o.shape == (t, h, d) and s.shape == (h, d, d)
        o_ref, s_ref = _chunked_ref(*args, chunk=kw["chunk"])
        assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
        o_rec, s_rec = _recurrent_ref(*args)
        tol = _recurrence_tol(kw["chunk"])
        assert rel_err(o, o_rec) <= tol and rel_err(s, s_rec) <= tol


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_gate_extremes(chunk):
    """Decays at the safe gate's bound (g in (-5, -4.95): the largest factored exponents, e^{8·5}) and near
    0 (g in (-0.01, 0): almost no decay over many chunks)."""
    q, k, v, _, beta, s0 = _prefill_inputs(3, 96, 2, 16)
    u = jax.random.uniform(key_for("pallas-prefill-gate", chunk), k.shape)
    for g in (-5.0 + 0.05 * u, -0.01 * u):
        args = (q, k, v, g, beta, s0)
        o, s = kda_chunked_prefill(*args, chunk=chunk)
        o_rec, s_rec = _recurrent_ref(*args)
        assert rel_err(o, o_rec) <= _recurrence_tol(chunk) and rel_err(s, s_rec) <= _recurrence_tol(chunk)


def test_chunked_prefill_padding_rows_leave_state():
    args = _prefill_inputs(5, 48, 3, 16, pad=13)
    _, s = kda_chunked_prefill(*args, chunk=16, block_v=16)
    _, s_ref = _recurrent_ref(*(a[:35] for a in args[:5]), args[5])
    assert rel_err(s, s_ref) <= 1e-5


# bf16 inputs (q, k, v; g, beta and the state f32 as in the model): by default the bf16 path (fla's
# roundings, see the module docstring) within bf16's 1e-2; precision="tf32x3" keeps the f32 path's
# agreement on the same inputs. Covers several sub-chunks per chunk and both output forms with bf16 operands.
@pytest.mark.parametrize("t,h,d,kw", [
    (64, 3, 16, dict(chunk=32, block_v=16)),
    (100, 2, 32, dict(chunk=64, block_k=16, prepare_block_k=16, fuse_output=False)),
])
def test_chunked_prefill_bf16_inputs(t, h, d, kw):
    q, k, v, g, beta, s0 = _prefill_inputs(6, t, h, d)
    args = (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), g, beta, s0)
    assert default_precision(*args[:3]) == "bf16" and default_precision(q, k, v) == "tf32x3"
    o_rec, s_rec = _recurrent_ref(*(a.astype(jnp.float32) for a in args))
    o, s = kda_chunked_prefill(*args, **kw)
    assert rel_err(o, o_rec) <= TOL[jnp.bfloat16] and rel_err(s, s_rec) <= TOL[jnp.bfloat16]
    o, s = kda_chunked_prefill(*args, precision="tf32x3", **kw)
    tol = _recurrence_tol(kw["chunk"])
    assert rel_err(o, o_rec) <= tol and rel_err(s, s_rec) <= tol


def test_model_logits_with_pallas_kda(hf_fixture, monkeypatch):
    """The HF fixtures' f32 logits with the Pallas KDA kernels; MoE ops whose Pallas kernels are not
    written yet run their references (prompts of <= 16 tokens take chain-verify, longer ones prefill)."""
    import lingjax
    from lingjax import kernels

    ops = dict(kernels.OPS)
    for name in kernels.missing_pallas_ops():
        assert not name.startswith("kda_"), name
        ref = ops[name][0]
        ops[name] = (ref, f"{ref.__module__}:{ref.__name__}")
    monkeypatch.setattr(kernels, "OPS", ops)
    assert kernels.missing_pallas_ops() == []
    ref = np.load(hf_fixture / "reference.npz")
    model = lingjax.load(hf_fixture, dtype="float32", kernels="pallas")
    logits = model.logits(ref["prompt_ids"])
    assert rel_err(logits, ref["logits"]) <= 1e-4
