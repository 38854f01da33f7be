"""lingjax.program_store: a step program stored by one model (or process) is read back by the next, neither traced
nor lowered again, and computes the same tokens; the key tells programs apart by everything that shapes them; a
bad file is traced again; the CLI keeps the store beside its compilation cache."""

import collections
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import lingjax
from lingjax import program_store
from lingjax.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TRACED = {"_prefill_impl", "_decode_impl", "_prefill_chunk", "_rounds"}  # the step programs' own bodies


@pytest.fixture
def store(tmp_path):
    program_store.enable(tmp_path / "programs")
    yield tmp_path / "programs"
    program_store.enable(None)


@pytest.fixture
def traced():
    """The names of the computations jax lowers while attached ("Compiling jit(NAME) ..."), as in
    test_compile_once."""
    names = collections.Counter()

    class Handler(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Compiling jit("):
                names[message[len("Compiling jit("):message.index(")")]] += 1

    handler, logger = Handler(logging.WARNING), logging.getLogger("jax")
    logger.addHandler(handler)
    with jax.log_compiles(True):
        yield names
    logger.removeHandler(handler)


@pytest.mark.parametrize("source,spec,tp", [("tiny", None, 1), ("tiny", "nextn", 2), (None, "dspark", 1)],
                         ids=["plain", "nextn tp2", "dspark"])
def test_a_stored_program_is_read_back_not_traced(source, spec, tp, store, traced):
    """A first model stores its step programs; a second model of the same checkpoint and options (new program
    objects, as in a new process) reads them back: none of the step programs' bodies is traced again, and the
    tokens equal both the first model's and a model's without the store. (DSpark: the shipped model and its
    drafter, whose parameters hold dicts of int keys: the programs are exported over flat leaves.)"""
    prompt, n = [5, 17, 42, 9], 7

    def load():
        return lingjax.load(source, seed=3, tp=tp) if source else lingjax.load()

    first = lingjax.generate(load(), prompt, n, ignore_eos=True, spec=spec)
    assert len(TRACED & set(traced)) == 2, dict(traced)  # traced (and exported) once
    stored = sorted(os.listdir(store))
    assert len(stored) == 2  # the prefill and the decode step (or the speculative prefill and round)
    traced.clear()
    second = lingjax.generate(load(), prompt, n, ignore_eos=True, spec=spec)
    assert not TRACED & set(traced), dict(traced)
    assert sorted(os.listdir(store)) == stored
    program_store.enable(None)
    plain = lingjax.generate(load(), prompt, n, ignore_eos=True, spec=spec)
    assert second.tokens == first.tokens == plain.tokens


def _census(hlo: str) -> tuple:
    """(opcode counts, the ENTRY computation's parameters, aliased outputs) of a compiled program's HLO text."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[: entry.index("\n}")]
    return (collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", hlo)), entry.count(" parameter("),
            hlo.splitlines()[0].count("-alias)"))


def test_the_stored_program_compiles_to_the_same_program(store):
    """The program read back compiles to what the step program compiles to: the same instructions, the same
    arguments (the ones the program never reads are dropped, as jit drops them: here the MTP layer's weights in a
    plain decode) and the same donated buffers aliased to outputs."""
    model = lingjax.load("tiny", seed=3)
    _, decode = model.step_programs(SamplingParams(), 2)
    token, pos = model.put((jnp.int32(1), jnp.int32(4)))
    args = (model.weights, model.new_cache(64), token, pos, model.put(jax.random.key(0)))
    want = _census(decode.jitted.trace(*args).lower().compile().as_text())
    decode.prepare(args)  # stored
    decode._loaded.clear()
    got = _census(decode.prepare(args).trace(*args).lower().compile().as_text())  # read back
    assert got == want
    assert want[1] < len(jax.tree.leaves(args)) and want[2] > 0  # some arguments unread, some buffers aliased


def test_the_key_follows_what_shapes_a_program(store):
    """Two loads of one model key a program alike; another sampling, run option, tensor parallelism or argument
    shape keys it otherwise."""
    prompt = jnp.zeros(32, jnp.int32)

    def prefill_key(model, sampling=SamplingParams(), capacity=64):
        prefill, _ = model.step_programs(sampling)
        cache = model.new_cache(capacity)
        args = (model.weights, cache, *model.put((prompt, jnp.int32(0), jnp.int32(4))), jax.random.key(0))
        return program_store.key(prefill.identity, args)

    model = lingjax.load("tiny", seed=3)
    base = prefill_key(model)
    assert prefill_key(lingjax.load("tiny", seed=4)) == base  # other weights' values: the same program
    assert prefill_key(model, SamplingParams(temperature=0.5)) != base
    assert prefill_key(model.variant(router_precision="bf16")) != base
    assert prefill_key(lingjax.load("tiny", seed=3, tp=2)) != base
    assert prefill_key(model, capacity=128) != base


def test_a_bad_file_is_traced_again_and_replaced(store, traced):
    """A stored program that does not deserialize (here: cut in half) costs a trace, not a wrong or failed call,
    and is written again whole."""
    prompt = [5, 17, 42, 9]
    first = lingjax.generate(lingjax.load("tiny", seed=3), prompt, 5, ignore_eos=True)
    for path in store.iterdir():
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    traced.clear()
    again = lingjax.generate(lingjax.load("tiny", seed=3), prompt, 5, ignore_eos=True)
    assert again.tokens == first.tokens
    assert {"_prefill_impl", "_decode_impl"} <= set(traced)  # traced again
    for path in store.iterdir():
        assert program_store._read(path) is not None  # a whole program again


def test_a_stored_program_keeps_its_donation(store):
    """The program read back donates what the step program donates: the donated input is gone after the call."""
    def add_double(a, b):
        return a + b, b * 2

    program = program_store.StepProgram(add_double, "add double", donate_argnums=(0,))
    a, b = jnp.arange(4.0) + 1, jnp.arange(4.0)
    program.prepare((a, b)).trace(a, b).lower().compile()
    total, double = program(a, b)
    assert a.is_deleted() and not b.is_deleted()
    assert total.tolist() == [1, 3, 5, 7] and double.tolist() == [0, 2, 4, 6]
    c, d = jnp.arange(3.0), jnp.ones(3)  # other shapes than those stored: the jitted program serves them
    assert program(c, d)[0].tolist() == [1, 2, 3] and c.is_deleted()


def test_the_store_keeps_the_programs_used_last(store, monkeypatch):
    """Past KEEP programs the least recently used go; a program read back counts as used."""
    monkeypatch.setattr(program_store, "KEEP", 2)
    program = program_store.StepProgram(jnp.negative, "negative")
    names = {}
    for n in (1, 2):
        program.prepare((jnp.ones(n),))
        names[n] = set(os.listdir(store)) - set().union(*names.values())
        os.utime(store / next(iter(names[n])), (1000 + n, 1000 + n))  # distinct use times, the older first
    program._loaded.clear()
    program.prepare((jnp.ones(1),))  # read back: 1 is now the newest
    program.prepare((jnp.ones(3),))  # a third program: 2, the least recently used, goes
    assert len(os.listdir(store)) == 2
    assert names[1] <= set(os.listdir(store)) and not names[2] & set(os.listdir(store))


def test_the_store_is_off_until_enabled():
    program = program_store.StepProgram(jnp.negative, "negative")
    assert program_store.directory() is None
    assert program.prepare((jnp.ones(2),)) is program.jitted


@pytest.mark.slow
def test_the_cli_reads_back_what_an_earlier_run_stored(tmp_path):
    """Two `lingjax generate` processes with one cache directory: the first stores the step programs beside the
    compilation cache, the second reads them back and prints the same text."""
    env = {k: v for k, v in os.environ.items() if k != "LINGJAX_NO_CACHE"}
    env.update(LINGJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "lingjax.cli", "generate", "--model", "tiny", "--prompt-ids", "5 17 42",
               "--max-new-tokens", "6", "--ignore-eos"]
    runs = [subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    assert runs[0].stdout == runs[1].stdout
    assert len(list((tmp_path / "cache" / "programs").glob("*.jaxexport"))) == 2
