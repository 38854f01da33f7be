"""Every program of every fixture and shipped preset lowers for an H200 with kernels="auto", on this CPU machine.

Under lingjax.target.compile_for("gpu") kernels="auto" is the Pallas set and each op asks its kernel's
supports() whether the Triton lowering takes the call's shapes; where not, the op runs its XLA reference
and lingjax says so once. Lowering the decode step, a speculative round and a prefill chunk for "cuda"
then runs Pallas's Triton lowering on every kernel the model actually calls, so a shape that supports()
accepts but Triton rejects fails here, not on the GPU. Abstract weights: no memory is used."""

import logging

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES
from lingjax import engine, kernels, target
from lingjax.config import MOE, VERIFY_ROWS, LingConfig, preset
from lingjax.execution import Exec
from lingjax.model import MoE, abstract_model, paths_for
from lingjax.ops import moe as moe_ops
from lingjax.pallas.grid_dependency import WAIT_ASM
from lingjax.param_init import ParamInit
from lingjax.runtime import Model, RunOptions
from lingjax.sampling import SamplingParams
from lingjax.shipped import DEFAULT_CHECKPOINT, DEFAULT_NAME
from lingjax.spec import step as spec_step
from lingjax.spec.step import SpecState

pytestmark = [pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
              pytest.mark.usefixtures("h200")]  # lowered for an H200 (conftest)

CONFIGS = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists()) + ["tiny", "mid", DEFAULT_NAME]


def _config(name: str) -> LingConfig:
    if name == DEFAULT_NAME:
        return LingConfig.from_file(DEFAULT_CHECKPOINT / "config.json")
    return LingConfig.from_file(FIXTURES / name / "config.json") if (FIXTURES / name).is_dir() else preset(name)


def _lowered_programs(cfg: LingConfig, capacity: int = 256, steps: int = 3):
    """(name, StableHLO text) of the decode step, a speculative round and a 32-token prefill chunk."""
    model = Model(abstract_model(cfg, jnp.bfloat16), RunOptions(kernels="auto"))
    assert model.kernels == "pallas"
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    cache = jax.eval_shape(lambda: model.new_cache(capacity))
    prefill, decode = model.step_programs(SamplingParams())
    programs = [("decode", decode, (model.weights, cache, i32, i32, key)),
                ("prefill", prefill, (model.weights, cache, jax.ShapeDtypeStruct((32,), jnp.int32), i32, i32, key))]
    if model.has_mtp:
        drafter = engine.make_drafter(model, "nextn", steps)
        draft = jax.eval_shape(lambda: drafter.init(model.module, capacity))
        state = SpecState(cache=cache, draft=draft, s=i32, bonus=i32, round=i32, key=key)
        program = spec_step.spec_program(model, drafter, SamplingParams())
        programs.append(("spec round", program.round, (program.weights, state)))
    return [(name, fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()) for name, fn, args in programs]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_program_lowers_with_auto_kernels(name, caplog):
    cfg = _config(name)
    with caplog.at_level(logging.WARNING, logger="lingjax"), target.compile_for("gpu", jax.devices()[:1]):
        lowered = _lowered_programs(cfg)
    fallbacks = [r.getMessage() for r in caplog.records if "runs its XLA reference" in r.getMessage()]
    for program, text in lowered:
        calls = text.split("__gpu$xla.gpu.triton")[1:]
        assert all(WAIT_ASM in call for call in calls), f"{program}: a Pallas kernel without griddepcontrol.wait"
    if name == "mid":  # Flash's width: every op on its Pallas kernel, nothing falls back
        assert not fallbacks, fallbacks
        assert all(text.count("__gpu$xla.gpu.triton") for _, text in lowered)
    for message in fallbacks:  # each names the op and a reason
        op = message.split(":")[1].strip().split()[0]
        assert op in ("gemm", "linear", "kda_chain", "kda_chunked", "mla_absorbed", "mla_expanded", "moe_route",
                      "moe_experts", "moe_routed_experts"), message


# the ops whose rounding depends on their shapes: reductions, GEMMs, kernels (slices and pads aside)
_ROUNDING = ("dot_general", "reduce_sum", "reduce_max", "argmax", "top_k", "pallas_call", "gather", "scatter-add")


def _rounding_ops(jaxpr) -> list:
    """(primitive, operand shapes) of every rounding op in a jaxpr, its sub-jaxprs included, in order; a Pallas
    launch is named by its kernel ("pallas_call:linear")."""
    ops = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _ROUNDING:
            name = eqn.primitive.name
            if name == "pallas_call":
                name += ":" + str(eqn.params.get("name", ""))
            ops.append((name, tuple(tuple(v.aval.shape) for v in eqn.invars)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            ops.extend(_rounding_ops(sub))
    return ops


@pytest.mark.parametrize("name", [DEFAULT_NAME, "mid"])
def test_moe_decode_and_verify_round_rows_alike(name, caplog):
    """Row invariance of a MoE sub-layer for an H200: a decode (T = 1) and a verify (T = 4) run the same
    reductions on the same shapes, or the decode is the fused Pallas kernel (which reads row 0 as a verify
    reads row j). The shipped model's expert width is one the Pallas expert kernels refuse: its fallback
    runs on every padded row (a fallback on the real rows alone rounds by T on the GPU, so bf16 speculation
    there would not be lossless)."""
    cfg = _config(name)
    # abstract weights (Flash's experts are gigabytes): tracing reads only shapes
    moe = nnx.eval_shape(lambda: MoE(cfg, ParamInit(nnx.Rngs(0), jnp.bfloat16), layer_id=cfg.mlp_types.index(MOE)))
    graphdef, weights = nnx.split(moe)
    x = jax.ShapeDtypeStruct((VERIFY_ROWS, cfg.hidden_size), jnp.bfloat16)
    ex = Exec(kernels="pallas")

    def trace(tokens):
        forward = lambda w, x: nnx.merge(graphdef, w)(cfg, x, paths_for(tokens, ex))  # noqa: E731
        return _rounding_ops(jax.make_jaxpr(forward)(weights, x).jaxpr)

    kernels.forget_fallbacks()  # each is said once a process: an earlier test may have heard this one
    with caplog.at_level(logging.WARNING, logger="lingjax"), target.compile_for("gpu", jax.devices()[:1]):
        decode, verify = trace(1), trace(4)
    def expert_kernels(ops):  # the MoE's own launches (the shared expert's projections are the dense "linear")
        return sum(op.startswith("pallas_call") and op != "pallas_call:linear" for op, _ in ops)

    kernels_in = expert_kernels(decode), expert_kernels(verify)
    if name == DEFAULT_NAME:
        assert kernels_in == (0, 0) and "runs its XLA reference" in caplog.text
        assert decode == verify
    else:  # Flash's shapes: the decode's fused launches route the token themselves, a verify has a router launch
        assert 0 < kernels_in[0] < kernels_in[1], kernels_in
        assert "runs its XLA reference" not in caplog.text


def test_expert_fallback_computes_the_real_rows():
    """experts_all_rows (the GPU's fallback) gives the reference's result on the real rows."""
    cfg = _config(DEFAULT_NAME)
    moe = MoE(cfg, ParamInit(nnx.Rngs(2), jnp.float32), layer_id=cfg.mlp_types.index(MOE))
    x = jax.random.normal(jax.random.key(3), (VERIFY_ROWS, cfg.hidden_size), jnp.float32)
    w = (moe.w_gate[...], moe.w_up[...], moe.w_down[...])
    weights, chosen = moe_ops.route(x, moe.router[...], moe.router_bias[...], **moe.routing(cfg, paths_for(3)))
    want = moe_ops.experts(x, *w, weights, chosen, moe.limit, tokens=3)
    got = moe_ops.experts_all_rows(x, *w, weights, chosen, moe.limit, tokens=3)
    assert got.shape == want.shape == (3, cfg.hidden_size) and np.isfinite(np.asarray(got)).all()
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 1e-5, err


def test_step_programs_compile_without_gemm_autotuning():
    """The step programs pick each GEMM's algorithm by its shape, not by timing (XLA's autotuner times each
    program apart, so a decode and a verify could round one shape two ways): lossless bf16 speculation on the
    GPU depends on it (bench/results/shipped/embedded_h200_2026-12-03_final.md). An A/B option still overrides it."""
    from lingjax.execution import CompileOptions, step_compiler_options

    assert step_compiler_options()["xla_gpu_autotune_level"] == 0
    ab = CompileOptions(xla_options=(("xla_gpu_autotune_level", 4),))
    assert step_compiler_options(ab)["xla_gpu_autotune_level"] == 4
