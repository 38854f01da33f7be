"""Shared test helpers. Inputs are drawn fresh each run (seeded by the test's parameters plus a
per-session salt), never zeros; comparisons are relative to the reference's scale."""

import os
import shutil
import tempfile
import zlib
from pathlib import Path

# Eight fake CPU devices for the tensor-parallel tests, up to TP8 (must be set before jax initialises;
# xdist workers inherit it from the controller).
_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = Path(__file__).parent / "fixtures"
# A fresh salt per session (printed, so a failure can be replayed with LINGJAX_TEST_SALT). Kept in the
# environment: pytest-xdist starts its workers after the controller has imported this file, so they
# inherit the controller's salt.
SALT = int(os.environ.setdefault("LINGJAX_TEST_SALT", str(np.random.SeedSequence().entropy % 2**31)))


def _compilation_cache() -> tuple[str, bool]:
    """(the session's compilation cache directory, whether this process made it). The tests build many
    programs whose XLA computations are identical (a Model or a ReplayDrafter per test, each with its
    own jitted programs; every module's programs again after _release_compiled_programs): with the
    cache each compiles once. Fresh for each session and removed at its end, so nothing carries over
    between runs; the controller makes it and each xdist worker takes its own subdirectory (jax's cache
    writes entries unlocked, so two processes must not share one)."""
    made = "LINGJAX_TEST_COMPILE_CACHE" not in os.environ
    if made:
        os.environ["LINGJAX_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="lingjax-test-compile-cache-")
    root = os.environ["LINGJAX_TEST_COMPILE_CACHE"]
    return os.path.join(root, os.environ.get("PYTEST_XDIST_WORKER", "main")), made


_CACHE_DIR, _MADE_CACHE = _compilation_cache()
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)


def pytest_unconfigure(config):
    if _MADE_CACHE:
        shutil.rmtree(os.environ["LINGJAX_TEST_COMPILE_CACHE"], ignore_errors=True)


def _report_salt(config):
    """The salt, at the start and after the failures: pytest's report header is hidden under the -q
    of addopts. Only the controller writes (an xdist worker's output is not shown)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(config, "workerinput"):
        reporter.write_line(f"lingjax test salt: {SALT} (replay with LINGJAX_TEST_SALT={SALT})")


def pytest_sessionstart(session):
    _report_salt(session.config)


def pytest_terminal_summary(terminalreporter, config):
    _report_salt(config)


def key_for(*parts) -> jax.Array:
    return jax.random.key(zlib.crc32(repr((SALT,) + parts).encode()) % 2**31)


# f32 results of two different programs that compute the same sums (a split tile, a broadcast row, a fused
# launch against two): XLA:CPU may associate and vectorize them differently by machine, so they agree to a
# few ulp, not bit for bit. Exact equality stays for one program at two inputs' shapes and for data movement.
REORDER_TOL = 1e-6


def rel_err(got, want) -> float:
    """max |got - want| / max |want|; NaN anywhere fails."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), "non-finite values in result"
    assert np.isfinite(want).all(), "non-finite values in reference"
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def fixture_dirs():
    return sorted(p for p in FIXTURES.iterdir() if (p / "reference.npz").exists()) if FIXTURES.exists() else []


@pytest.fixture(params=fixture_dirs(), ids=lambda p: p.name)
def hf_fixture(request):
    return request.param


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps memory for each executable it
    JIT-compiles; a few thousand executables in one process run into the kernel's limit on memory
    maps (vm.max_map_count, 65530 here) and the next compile segfaults."""
    yield
    jax.clear_caches()
    import gc

    gc.collect()
