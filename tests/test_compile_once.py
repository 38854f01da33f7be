"""Generation compiles each of its programs once: for a safetensors checkpoint and its `lingjax convert`
(orbax) copy, with and without speculation, and a second identical request compiles nothing. A program
lowered again (for example because an argument's sharding changed between the first and later steps) would
recompile inside the token loop and cost a compile per request. And every program is compiled before the first
one runs, together (lingjax.precompile): the stand-in arguments they are compiled for are the real calls'."""

import collections
import logging

import jax
import numpy as np
import pytest

import lingjax
from conftest import FIXTURES
from lingjax import checkpoint, engine, precompile, steady

# The programs generation runs, by speculation mode (jit names: the jitted functions' names).
PROGRAMS = {None: {"_prefill_impl", "_decode_impl"}, "nextn": {"_prefill_chunk", "_rounds"}}


class _Compiles(logging.Handler):
    """Names of the computations jax lowers while attached ("Compiling jit(NAME) with global shapes ...")."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.names = collections.Counter()

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling jit("):
            self.names[message[len("Compiling jit("):message.index(")")]] += 1


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    converted = tmp_path_factory.mktemp("orbax") / "tiny_c"
    checkpoint.convert(FIXTURES / "tiny_c", converted)
    return {"safetensors": FIXTURES / "tiny_c", "orbax": converted}


@pytest.fixture
def compiles():
    handler, logger = _Compiles(), logging.getLogger("jax")
    logger.addHandler(handler)
    with jax.log_compiles(True):
        yield handler
    logger.removeHandler(handler)


@pytest.mark.parametrize("spec", [None, "nextn"], ids=["plain", "nextn"])
@pytest.mark.parametrize("layout", ["safetensors", "orbax"])
def test_generation_compiles_each_program_once(layout, spec, sources, compiles):
    model = lingjax.load(sources[layout], dtype="float32")
    compiles.names.clear()
    first = lingjax.generate(model, [1, 2, 3], 9, ignore_eos=True, spec=spec)
    once = {name: compiles.names[name] for name in PROGRAMS[spec]}
    assert once == dict.fromkeys(PROGRAMS[spec], 1), dict(compiles.names)
    compiles.names.clear()
    again = lingjax.generate(model, [1, 2, 3], 9, ignore_eos=True, spec=spec)
    assert not compiles.names, dict(compiles.names)
    assert again.tokens == first.tokens


@pytest.mark.parametrize("spec", [None, "dspark"], ids=["plain", "dspark"])
def test_every_program_compiles_before_the_first_runs(spec, compiles, monkeypatch):
    """A prompt of three chunks (one prefill program for all of them: the last one's 5 tokens pad to the same 32
    rows) and, for DSpark, two verify widths (a round program each): all of them are compiled inside one
    compile_together call, and none after it. (NEXTN's generation takes the same speculative path with one
    width.)"""
    model = lingjax.load()  # the shipped model: NEXTN and its DSpark drafter
    calls, inside = [], collections.Counter()  # the programs compiled inside compile_together
    real = precompile.compile_together

    def spy(done, jobs):
        calls.append(sorted({job.name for job in jobs}))
        before = collections.Counter(compiles.names)
        real(done, jobs)
        inside.update(compiles.names - before)
    monkeypatch.setattr(engine, "compile_together", spy)
    steps = set().union(*PROGRAMS.values())
    compiles.names.clear()
    kwargs = {None: {}, "dspark": dict(spec="dspark", widths=(3, 5))}[spec]
    prompt = list(range(3, 3 + 2 * 32 + 5))  # two full chunks of 32 and a last one of 5 (padded to 32 rows)
    lingjax.generate(model, prompt, 12, ignore_eos=True, prefill_chunk=32, **kwargs)
    rounds = "the decode step" if spec is None else "the speculative round"
    prefill = "the prefill" if spec is None else "the speculative prefill"
    assert calls == [sorted({prefill, rounds})], calls
    step_compiles = {name: n for name, n in compiles.names.items() if name in steps}
    outside = {name: n for name, n in (compiles.names - inside).items() if name in steps}
    assert not outside, outside
    assert sum(step_compiles.values()) == {None: 2, "dspark": 3}[spec], step_compiles


@pytest.mark.parametrize("program, jitted", [("decode", "_decode_impl"), ("prefill", "_prefill_impl")])
def test_the_benches_steady_programs_compile_once(program, jitted, sources, compiles):
    """bench/step_bench times lingjax.steady's programs and reports their compile seconds: the calls after the first
    (on the first's committed outputs) reuse its compile, as the engine's do, so those seconds are one compile's."""
    model = lingjax.load(sources["safetensors"], dtype="float32")
    launch = steady.steady_program(model, program, np.arange(1, 9, dtype=np.int32)).launcher(3)
    compiles.names.clear()
    jax.block_until_ready(launch()[1])
    assert compiles.names[jitted] == 1, dict(compiles.names)
