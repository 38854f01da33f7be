"""Shared test helpers. Inputs are drawn fresh each run (seeded by the test's parameters plus a
per-session salt), never zeros; comparisons are relative to the reference's scale."""

import os
import shutil
import tempfile
import zlib
from pathlib import Path

# Eight fake CPU devices for the tensor-parallel tests, up to TP8, and XLA:CPU's code generation at -O0: the test
# programs are small and compiled once each, so LLVM's optimisation costs more than it saves (about 15% of a
# heavy test's time). Set before jax initialises; xdist workers inherit them from the controller.
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

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
    own jitted programs; every module's programs again after _release_compiled_programs; the same model's
    programs in a CLI, bench or notebook process the tests start): with the cache each compiles once a
    session. Fresh for each session and removed at its end, so nothing carries over between runs. One directory
    for the session's every process: the controller makes it, and the xdist workers and the processes the tests
    start find it in the environment (JAX_COMPILATION_CACHE_DIR; the benches ignore it, bench/common.py). jax
    writes an entry without a lock: two processes compiling the same program at once both write it, and a reader
    that catches a half-written entry warns and compiles (jax's cache errors are warnings)."""
    made = "LINGJAX_TEST_COMPILE_CACHE" not in os.environ
    if made:
        os.environ["LINGJAX_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="lingjax-test-compile-cache-")
    return os.environ["LINGJAX_TEST_COMPILE_CACHE"], made


_CACHE_DIR, _MADE_CACHE = _compilation_cache()
os.environ["LINGJAX_NO_CACHE"] = "1"  # the CLI under test keeps this session's cache, not the user's
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
# every program, however fast it compiled (jax caches only those over a second by default): most of a test's
# programs are small ones, built again by each Model (as lingjax.compilation_cache.enable does for the CLI)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


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


# The slow tier: tests that take seconds each on a 2-core machine (HF parity over every fixture, TP on fake
# devices, long speculative runs, interpret-mode kernel sweeps). `pytest -m "not slow"` runs the rest, a few of
# each kind kept (greedy against the full forward, HF logits, the CLI, zero and full acceptance), for daily work;
# the full suite is the CI command. Marked here by module and test function (every parametrisation).
SLOW = {
    "test_checkpoint": {"test_alternate_layouts_load_identically", "test_save_load_round_trip_and_orbax"},
    "test_cli": {
        "test_generate_speculative",
        "test_generate_tensor_parallel",
        "test_generate_ends_cleanly_when_it_stops_early",
    },
    "test_generate": {
        "test_decode_steps_per_call_same_tokens",
        "test_kernel_set_auto_and_bad_names",
        "test_pallas_kernels_give_the_same_model",
        "test_prompt_longer_than_one_prefill_chunk",
        "test_sampling_is_seeded_and_respects_top_k",
        "test_nonfinite_logits_stop_generation_with_an_error",
        "test_xla_ops_override_one_kernel",
    },
    "test_kernel_stamps": {"test_smoke_run_equals_unprobed"},
    "test_model_lowering": {"test_every_program_lowers_with_auto_kernels"},
    "test_ops": {
        "test_experts_sorted_matches_gathered",
        "test_kda_chain_contract_matches_prepare_and_recurrence",
        "test_kda_chunked_matches_recurrent",
        "test_kda_padding_rows_leave_state_unchanged",
        "test_mla_absorbed_matches_expanded",
    },
    "test_pallas_kda": {
        "test_chain_decode_in_place",
        "test_chain_verify_bf16_inputs",
        "test_chain_verify_every_t",
        "test_chain_verify_head_dim_128",
        "test_chain_verify_heads_and_gate_forms",
        "test_chain_verify_padded_rows",
        "test_chain_verify_rows_equal_sequential_decode",
        "test_chain_verify_tiles",
        "test_chain_verify_tiles_per_program",
        "test_chunked_prefill_bf16_inputs",
        "test_chunked_prefill_gate_extremes",
        "test_chunked_prefill_matches_references",
        "test_chunked_prefill_padding_rows_leave_state",
        "test_model_logits_with_pallas_kda",
    },
    "test_pallas_lowering": {"test_moe_kernels_lower"},
    "test_pallas_mla": {"test_matches_reference", "test_row_invariance", "test_tiles_and_splits"},
    "test_pallas_moe": {
        "test_align_matches_sort_reference",
        "test_fused_experts_match_gathered",
        "test_fused_experts_read_the_real_rows_in_place",
        "test_hf_parity_with_pallas_moe",
        "test_kernel_options_reach_the_kernel",
        "test_routed_experts_match_reference",
        "test_router_f32_on_bf16_operands_is_exact",
        "test_router_flash_routing",
        "test_router_matches_reference",
        "test_router_ties_resolve_to_lower_index",
        "test_single_token_shared_expert_split",
        "test_single_token_up_reads_x_row_once",
    },
    "test_parity": {
        "test_bf16_router_keeps_parity",
        "test_decode_step_logits_match_full_forward",
        "test_greedy_tokens_match_hf",
    },
    "test_serve_bench": {"test_serve_bench_tiny"},
    "test_sharding": {
        "test_distributed_argmax_ties_to_lowest_id",
        "test_logits_and_greedy_match_tp1",
        "test_orbax_restores_straight_into_shards",
        "test_random_presets_are_drawn_in_shards_and_equal_at_every_tp",
        "test_sampling_matches_tp1",
        "test_tp8_matches_tp1",
        "test_weights_are_sharded_and_loaded_straight_into_shards",
    },
    "test_train_model": {
        "test_command_data_comes_from_the_cache",
        "test_command_exports_a_finished_run",
        "test_command_refuses_other_options_and_corpus",
        "test_command_resume_equals_uninterrupted_steps",
        "test_command_runs_resumes_and_exports",
        "test_embedded_checkpoint_fits_on_disk",
    },
    "test_dspark": {
        "test_context_cache_holds_the_targets_features_of_committed_rows",
        "test_greedy_equals_plain_greedy",
        "test_greedy_then_sampled_then_greedy_is_unpolluted",
        "test_tensor_parallel_equals_one_device",
        "test_widths_switching_every_call_stay_lossless",
        "test_fp8_target_greedy_equals_plain_greedy",
    },
    "test_train_dspark": {"test_command_trains_resumes_and_exports"},
    "test_spec": {
        "test_bf16_greedy_spec_equals_plain_128_tokens",
        "test_decode_and_verify_reduce_alike",
        "test_greedy_then_sampled_then_greedy_is_unpolluted",
        "test_nextn_greedy_equals_plain_greedy_128_tokens",
        "test_nextn_greedy_matches_hf_fixture",
        "test_rounds_per_call_same_tokens_and_accept_lengths",
        "test_target_only_accept_is_lossless",
        "test_verify_then_commit_equals_sequential_decode",
    },
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.originalname in SLOW.get(item.module.__name__, ()):
            item.add_marker(pytest.mark.slow)


def key_for(*parts) -> jax.Array:
    return jax.random.key(zlib.crc32(repr((SALT,) + parts).encode()) % 2**31)


# f32 results of two different programs that compute the same sums (a split tile, a broadcast row, a fused
# launch against two): XLA:CPU may associate and vectorize them differently by machine, so they agree to a
# few ulp, not bit for bit. Exact equality stays for one program at two inputs' shapes and for data movement.
REORDER_TOL = 1e-6


# A frequency test's bins each within Z_FREQ binomial standard deviations: P(|Z| > 6.5) is 8e-11 a bin, so a test of
# up to 100 bins fails by chance less than once in 10^8 runs (a correct sampler never fails CI), while a sampler
# off by a few percent at the draws the tests take still fails.
Z_FREQ = 6.5


def assert_frequencies(samples, p, vocab: int) -> None:
    """The empirical distribution of integer `samples` matches `p` [vocab] in every bin, within Z_FREQ binomial
    standard deviations (plus 1e-4 for p's own rounding)."""
    samples = np.asarray(samples).reshape(-1)
    p = np.asarray(p, np.float64)
    freq = np.bincount(samples, minlength=vocab) / samples.size
    sigma = np.sqrt(p * (1 - p) / samples.size)
    bad = np.abs(freq - p) > Z_FREQ * sigma + 1e-4
    assert not bad.any(), f"bins {np.flatnonzero(bad).tolist()}: freq {freq[bad]} vs p {p[bad]} ({samples.size} draws)"


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `lingjax ARGV` in this process, argparse's own exits included."""
    from lingjax import cli

    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    return code, out, err


def rel_err(got, want) -> float:
    """max |got - want| / max |want|; NaN anywhere fails."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), "non-finite values in result"
    assert np.isfinite(want).all(), "non-finite values in reference"
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def layer_shards(w) -> set:
    """The shapes of the shards the devices hold of one layer's weight: a stacked layer's (lingjax.stacked.LayerOf,
    how lingjax.Model holds its per-layer parameters) are its stack's shards less the layer axis."""
    from lingjax.stacked import LayerOf

    if isinstance(w, LayerOf):
        return {s.data.shape[1:] for s in w.stack.addressable_shards}
    return {s.data.shape for s in w.addressable_shards}


def fixture_dirs():
    return sorted(p for p in FIXTURES.iterdir() if (p / "reference.npz").exists()) if FIXTURES.exists() else []


@pytest.fixture
def ling_dir(tmp_path):
    """tiny_official's weights with a Ling-3-layout tokenizer and chat template beside them (tests/ling_tokenizer.py)
    -> (directory, {special token: id})."""
    import shutil

    import ling_tokenizer

    from lingjax.config import LingConfig

    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "tiny_official", d)
    return d, ling_tokenizer.write(d, LingConfig.from_file(d / "config.json").vocab_size)


@pytest.fixture
def h200(monkeypatch):
    """Pallas's Triton lowering targets an H200 (sm_90) on this machine without a GPU: the lowering tests' target."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info",
                        lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90))


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
