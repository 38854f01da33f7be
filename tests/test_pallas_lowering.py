"""Every Pallas kernel lowers to Triton IR for an H200 (sm_90) on this CPU machine, its kernel waiting
for its producers first.

The interpret-mode tests check the kernels' arithmetic; they never run Pallas's Triton lowering, which
rejects some programs interpret mode accepts (unsupported ops, shapes, layouts). Lowering for "cuda"
needs no GPU once Pallas is told which GPU to target; compiling the Triton IR to PTX still happens
only on a GPU, so this is a first gate, not a GPU test. Flash-sized shapes at decode/verify widths,
with the zero-padded rows of a verify (lingjax/model.py, row invariance)."""

import functools

import jax
import jax.numpy as jnp
import pytest

from lingjax.pallas.grid_dependency import WAIT_ASM
from lingjax.pallas.kda_chain import ChainTuning, kda_chain_verify
from lingjax.pallas.kda_prefill import kda_chunked_prefill
from lingjax.pallas.l2_prefetch import PREFETCH_ASM
from lingjax.pallas.mla_decode import mla_decode_attention
from lingjax.pallas.moe_align import moe_align
from lingjax.pallas.moe_experts import fused_experts, routed_experts
from lingjax.pallas.moe_router import route

S = jax.ShapeDtypeStruct
BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
D, E, K, ROWS = 2560, 512, 8, 16  # hidden, experts, top-k, padded rows of a verify
I = 384  # one TP2 device's share of an expert's intermediate dim
H, DK, W = 16, 128, 4  # KDA heads on one TP2 device, head dim, conv width
pytestmark = [pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
              pytest.mark.usefixtures("h200")]  # lowered for an H200 (conftest)


def _triton_calls(fn, *shapes) -> int:
    """The Pallas (Triton) calls of fn lowered for the H200; each must begin its kernel with
    griddepcontrol.wait (lingjax.pallas.grid_dependency: the step programs run with PDL)."""
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    calls = text.split("__gpu$xla.gpu.triton")[1:]
    assert all(WAIT_ASM in call for call in calls), "a Pallas kernel without griddepcontrol.wait"
    return len(calls)


@pytest.mark.parametrize("tokens", [1, 4, 7])
def test_moe_kernels_lower(tokens):
    experts = functools.partial(fused_experts, limit=4.0, tokens=tokens, shared_limit=7.0, interpret=False)
    weights = (S((E, I, D), BF), S((E, I, D), BF), S((E, D, I), BF))
    shared = (S((I, D), BF), S((I, D), BF), S((D, I), BF))
    routed = (S((ROWS, K), F32), S((ROWS, K), I32))
    n = _triton_calls(lambda x, *a: experts(x, *a[:5], shared=a[5:]), S((ROWS, D), BF), *weights, *routed, *shared)
    assert n == (2 if tokens == 1 else 3)  # up, down (+ align above T = 1)
    router = functools.partial(route, top_k=K, n_group=8, topk_group=4, scaling=2.5, renormalize=True,
                               interpret=False)
    assert _triton_calls(router, S((ROWS, D), BF), S((E, D), BF), S((E,), F32)) >= 1
    align = functools.partial(moe_align, tokens=tokens, block_m=16, interpret=False)
    assert _triton_calls(align, S((ROWS, K), I32)) == 1
    routed = functools.partial(routed_experts, limit=4.0, top_k=K, n_group=8, topk_group=4, scaling=2.5,
                               renormalize=True, tokens=tokens, shared_limit=7.0, interpret=False)
    layer = (S((ROWS, D), BF), S((E, D), BF), S((E,), F32), *weights)
    n = _triton_calls(lambda x, r, b, *a: routed(x, r, b, *a[:3], shared=a[3:]), *layer, *shared)
    assert n == (3 if tokens == 1 else 5)  # GEMV, up (routing inside), down (+ select and align above T = 1)
    # a decode's up programs prefetch the shared expert's weights into L2 (lingjax.pallas.l2_prefetch); nothing
    # else prefetches
    prefetches = lambda fn, *a: jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",)).as_text().count(
        PREFETCH_ASM)
    assert prefetches(lambda x, r, b, *a: routed(x, r, b, *a[:3], shared=a[3:]), *layer, *shared) == (tokens == 1)
    assert prefetches(routed, *layer) == 0


@pytest.mark.parametrize("tokens,opts", [(1, {}), (4, {}), (16, {}), (4, dict(tuning=ChainTuning(block_v=16)))])
def test_kda_kernels_lower(tokens, opts):
    p = H * DK
    chain = functools.partial(kda_chain_verify, tokens=tokens, num_heads=H, safe_gate=True, lower_bound=-5.0,
                              interpret=False, **opts)
    args = (S((ROWS, 5 * p), BF), S((ROWS, D), BF), S((H, D), BF), S((ROWS + W - 1, 3 * p), BF), S((), I32),
            S((3 * p, W), F32), S((H,), F32), S((p,), F32), S((H, DK, DK), F32))
    assert _triton_calls(chain, *args) == 1
    aliased = jax.jit(chain).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("output_operand_alias<")
    assert aliased == 1 + (tokens == 1)  # the conv ring always, a decode's state too (kda_chain_verify's in_place)
    t = 512
    prefill = functools.partial(kda_chunked_prefill, interpret=False)
    qkv = [S((t, H, DK), BF)] * 3
    assert _triton_calls(prefill, *qkv, S((t, H, DK), F32), S((t, H), F32), S((H, DK, DK), F32)) >= 1


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_mla_decode_lowers(tokens):
    """Flash MLA at TP2: 16 heads, nope/rope/value dims 128/64/128, rank 512, the serving bench's capacity (other
    tunings: tests/test_pallas_mla.py)."""
    mla = functools.partial(mla_decode_attention, scale=0.07, tokens=tokens, interpret=False)
    args = (S((ROWS, 16, 128), BF), S((ROWS, 16, 64), BF), S((9216, 576), BF), S((16 * 256, 512), BF), S((ROWS,), I32))
    assert _triton_calls(mla, *args) == 2  # split, combine


def test_lowering_finds_the_triton_dialects_module_once():
    """MLIR's bindings find the Triton dialect's Python module (lingjax.pallas.dialect_lookup): lowering a kernel
    searches sys.path for no dialect module, where without it every op and value of the kernel searched three."""
    import importlib.abc
    import sys

    from jaxlib.mlir._mlir_libs import _mlir

    searched = []

    class Probe(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            searched.append(name)
            return None

    probe = Probe()
    sys.meta_path.insert(0, probe)
    try:
        align = functools.partial(moe_align, tokens=4, block_m=16, interpret=False)
        assert _triton_calls(align, S((ROWS, K), I32)) == 1
    finally:
        sys.meta_path.remove(probe)
    assert _mlir.globals._check_dialect_module_loaded("tt")
    assert not [name for name in searched if name.endswith(".tt")], searched[:5]
