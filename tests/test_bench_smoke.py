"""Every bench script with a --smoke mode, run as a user runs it (`python bench/<script>.py --smoke`, a fresh
process on the CPU, interpret mode): it exits 0 and prints its report's table, with no row marked as failing.
A check of the scripts, not a measurement; the runs are in the slow tier (up to a minute each on 2 cores)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# script -> the header of a table its report prints (its first cells)
TABLES = {
    "step_bench": "| tp | weights | kernels | step | µs/step |",
    "kda_bench": "| part | T | tuning | µs | floor µs |",
    "kda_chain_ab": "| tuning | T=1 µs | T=4 µs |",
    "mla_bench": "| T | context | path | µs | floor µs |",
    "moe_bench": "| T | tuning | router µs | router + align launch µs | ids equal |",
    "kernel_stamps": "|  | moe_router_gemv (all) | moe_up_select (routed) |",
    "fp8_bench": "| variant | tuning (changed from the decode's tiles) | vs exact |",
    "linear_bench": "| projection | [N, K] | variant | launch |",
    "gemm_bench": "| shape | [N, K] | variant | plan |",
    "moe_prefill_bench": "| tiles | ms per layer | bits | vs first |",
    "mla_prefill_bench": "| start | variant | ms per layer | TFLOP/s |",
    "mla_kvb_ab": "| form | µs per layer | q_lat bits | o bits |",
    "draft_vocab_sweep": "| spec | S (verify width) | draft vocab |",
    "dispatch_bench": "| N | N arrays, read µs | N arrays donated, returned µs |",
    "compile_bench": "| program | cold: trace s | lower s | compile s |",
}


def test_every_smoke_mode_is_listed():
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py") if "args.smoke" in p.read_text()}
    assert scripts == set(TABLES)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(TABLES))
def test_smoke(script):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith(TABLES[script]) for line in lines), run.stdout[-3000:]
    rows = [line for line in lines if line.startswith("|") and not line.startswith("|---")]
    assert len(rows) >= 2  # the header and at least one row
    bad = [row for row in rows if " FAIL" in row or "DIFFER" in row or "failed:" in row]
    assert not bad, bad
