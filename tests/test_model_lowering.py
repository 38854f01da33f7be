"""Every program of every fixture and shipped preset lowers for an H200 with kernels="auto", on this CPU machine.

Under lingjax.target.compile_for("gpu") kernels="auto" is the Pallas set and each op asks its kernel's
supports() whether the Triton lowering takes the call's shapes; where not, the op runs its XLA reference
and lingjax says so once. Lowering the decode step, a speculative round and a prefill chunk for "cuda"
then runs Pallas's Triton lowering on every kernel the model actually calls, so a shape that supports()
accepts but Triton rejects fails here, not on the GPU. Abstract weights: no memory is used."""

import logging

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import gpu_info

from conftest import FIXTURES
from lingjax import engine, target
from lingjax.config import LingConfig, preset
from lingjax.model import abstract_model
from lingjax.pallas.grid_dependency import WAIT_ASM
from lingjax.runtime import Model, RunOptions
from lingjax.sampling import SamplingParams
from lingjax.spec.step import SpecState

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

CONFIGS = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists()) + ["tiny", "mid"]


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90))


def _config(name: str) -> LingConfig:
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
        programs.append(("spec round", model.spec_program(drafter, SamplingParams()).round, (model.weights, state)))
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
        assert message.split(":")[1].strip().split()[0] in ("kda_chain", "kda_chunked", "mla_absorbed", "moe_route",
                                                              "moe_experts", "moe_routed_experts"), message
