"""bench/serve_bench.py end to end on the tiny preset: the progress bar, the report's table for each prompt length,
and the kernel set it ran (lingjax.load's "auto" resolved, not the flag's spelling)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_serve_bench_tiny(tmp_path):
    out = tmp_path / "serve.md"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--model", "tiny", "--spec", "nextn", "--steps", "2",
         "--prompt-len", "40", "24", "--output-len", "9", "--requests", "2", "--prefill-chunk", "32",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2/2 requests" in run.stderr  # the progress bar
    report = out.read_text()
    assert report == run.stdout
    assert "kernels=xla" in report  # auto on the CPU
    # one table per prompt length, in the order given, under one heading
    assert report.count("| requests measured | 2 (asked 2,") == 2 and report.count("# serve_bench") == 1
    assert report.index("prompt 40 (prefill chunks of 32), output 9") < report.index("prompt 24 (prefill chunks")
    for row in ("mean TPOT", "median TPOT", "output throughput", "peak output throughput (1 s bins)",
                "mean accept length", "derived step time (mean TPOT x accept)", "mean TTFT"):
        assert report.count(f"| {row} | ") == 2
