"""Generation compiles each of its programs once: for a safetensors checkpoint and its `lingjax convert`
(orbax) copy, with and without speculation, and a second identical request compiles nothing. A program
lowered again (for example because an argument's sharding changed between the first and later steps) would
recompile inside the token loop and cost a compile per request."""

import collections
import logging

import jax
import pytest

import lingjax
from conftest import FIXTURES
from lingjax import checkpoint

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
