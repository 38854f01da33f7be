"""`lingjax profile` and `lingjax profile compare` (lingjax/profile_command.py, profile_report.py): bad requests
refused in one line before any work; a CPU run on the shipped model writes its trace and census and prints the
census; saved censuses read back and compare with the right arithmetic. Durations vary run to run, so nothing
here asserts a time, only structure and sums."""

import gzip
import json
import subprocess
import sys

import pytest

from lingjax import cli, profile_command, profile_report, profiling
from lingjax.profiling import CATEGORIES, Census


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lingjax: error: "), err
    return err[0]


@pytest.mark.parametrize("argv, message", [
    (["profile", "--steps", "3"], "needs --program nextn or dspark"),
    (["profile", "--program", "prefill", "--steps", "3"], "needs --program nextn or dspark"),
    (["profile", "--program", "prefill", "--prompt-len", "4096"], "one chunk holds at most 2048 tokens"),
    (["profile", "--start", "64"], "--start 64 places a prefill chunk: it needs --program prefill"),
    (["profile", "--program", "prefill", "--start", "-1"], "--start -1: a position"),
    (["profile", "--program", "prefill", "--start", "2040", "--prompt-len", "16"], "must end within half the context"),
    (["profile", "--n", "0"], "--n 0: at least one step"),
    (["profile", "--program", "nextn", "--steps", "0"], "--steps 0: at least one draft"),
    (["profile", "--prompt-len", "0"], "--prompt-len 0"),
    (["profile", "compare"], "one of them"),
    (["profile", "compare", "a", "b", "--kernels", "xla", "pallas"], "one of them"),
    (["profile", "compare", "--kernels", "xla", "xla"], "two different sides"),
    (["profile", "compare", "--kernels", "xla", "pallas", "--weights", "dense", "fp8"], "one of them"),
    (["profile", "compare", "--kernels", "xla"], "one of them"),
    (["profile", "compare", "--weights", "dense", "fp8", "auto"], "--weights takes two values"),
    (["profile", "compare", "a", "b", "--weights", "fp8"], "run nothing"),
    (["profile", "compare", "only_one"], "two saved censuses, got 1"),
    (["profile", "compare", "a", "b", "--out", "c"], "saved already"),
    (["profile", "compare", "no/such/a", "no/such/b"], "no saved census"),
    (["profile", "--checkpoint", "no/such/dir"], "no such directory"),
])
def test_bad_requests_are_one_line(capsys, monkeypatch, argv, message):
    def model_work(*args, **kwargs):
        raise AssertionError("a model was loaded before the request was refused")

    monkeypatch.setattr(profile_command, "_load", model_work)
    assert message in _error(capsys, argv)


def test_help_imports_no_jax():
    code = ("import sys, lingjax.cli\ntry: lingjax.cli.main(['profile', 'compare', '--help'])\n"
            "except SystemExit: pass\nprint('jax imported' if 'jax' in sys.modules else 'no jax')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("no jax") and "--revs" in out and "--kernels" in out


def test_bad_flag_values_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", "--program", "train"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--program" in err[0] and err[0].startswith("lingjax: error: ")


def _census(scale: float, real: float | None) -> Census:
    by = {c: scale * (i + 1) for i, c in enumerate(CATEGORIES)}
    return Census(steps=4, traced_step_us=40 * scale, busy_us=sum(by.values()), by_category_us=by,
                  kernels_per_step=100 * scale, real_step_us=real)


def test_saved_censuses_read_back_and_compare(tmp_path, capsys):
    a, b = _census(1.0, 30.0), _census(2.0, 50.0)
    profile_report.save(tmp_path / "a", a, {"program": "decode T=1", "kernels": "xla"}, "xla")
    profile_report.save(tmp_path / "b", b, {"program": "decode T=1", "kernels": "pallas"}, "pallas")
    back, meta = profile_report.read(tmp_path / "a")
    assert back == a and meta == {"program": "decode T=1", "kernels": "xla"}
    assert profile_report.read(tmp_path / "b" / "census.json")[0] == b
    assert "| MoE experts | 1 (3.3%) |" in (tmp_path / "a" / "census.md").read_text()

    diff = profile_report.differences(a, b)
    assert [diff[c] for c in CATEGORIES] == [i + 1.0 for i in range(len(CATEGORIES))]
    assert diff["kernel time (union)"] == 21.0 and diff["real step (unprofiled)"] == 20.0
    assert diff["idle in the real step"] == (50.0 - 42.0) - (30.0 - 21.0)
    assert diff["kernels per step"] == 100.0

    assert cli.main(["profile", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "A: " in out and "kernels pallas" in out
    assert "| router/glue | 2 (6.7%) | 4 (8.0%) | +2 | 2.00 |" in out
    assert "| all-reduce | 3 (10.0%) | 6 (12.0%) | +3 | 2.00 |" in out
    assert "| real step (unprofiled) | 30 | 50 | +20 | 1.67 |" in out

    (tmp_path / "bad.json").write_text("{\"census\": 3}")
    with pytest.raises(ValueError, match="not a saved census"):
        profile_report.read(tmp_path / "bad.json")


def test_cpu_thunks_load_by_module(tmp_path):
    """A trace without a GPU: the CPU's thunks are the host events naming an hlo_op; other modules' are left out
    of the census, and events without an hlo_op are not kernels."""
    def thunk(ts, dur, op, module="jit_step"):
        return {"ph": "X", "pid": 1, "tid": 2, "ts": ts, "dur": dur, "name": op,
                "args": {"hlo_op": op, "hlo_module": module, "device_ordinal": "0"}}

    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 100, "name": "ThunkExecutor::Execute", "args": {}},
              thunk(0, 10, "ynn_fusion.1"), thunk(10, 5, "fusion.2"), thunk(20, 7, "copy.3", module="jit_other"),
              thunk(30, 20, "while.4"), thunk(31, 4, "fusion.2"), thunk(40, 4, "fusion.2")]  # a loop and its body
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    kernels = profiling.load_kernels(path)
    assert [(k.hlo_op, k.module) for k in kernels] == [("ynn_fusion.1", "jit_step"), ("fusion.2", "jit_step"),
                                                       ("copy.3", "jit_other"), ("fusion.2", "jit_step"),
                                                       ("fusion.2", "jit_step")]  # the loop counts in its body
    hlo = ('HloModule jit_step, entry_computation_layout={}\n'
           '  %ynn_fusion.1 = f32[8]{0} fusion(%p), metadata={op_name="jit(step)/layer0_kda/kda_proj/...i,oi->...o"}\n'
           '  %fusion.2 = f32[8]{0} fusion(%p), metadata={op_name="jit(step)/layer0_kda/kda_recurrence/mul"}\n')
    assert profiling.module_name(hlo) == "jit_step"
    c = profiling.census(kernels, profiling.op_scopes(hlo), steps=1, module="jit_step")
    assert c.by_category_us["dense GEMM"] == 10 and c.by_category_us["KDA"] == 13 and c.kernels_per_step == 4
    with pytest.raises(ValueError, match="in jit_none"):
        profiling.census(kernels, {}, steps=1, module="jit_none")


def _kernel_sum(log_dir, hlo_path) -> tuple[float, int]:
    """(summed thunk µs, thunks) of the step's module in the one trace under log_dir."""
    (trace,) = log_dir.glob("plugins/profile/*/*.trace.json.gz")
    with gzip.open(hlo_path, "rt") as f:
        module = profiling.module_name(f.read())
    mine = [k for k in profiling.load_kernels(trace) if k.device == 0 and k.module in ("", module)]
    return sum(k.dur_us for k in mine), len(mine)


def test_profile_the_shipped_decode_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "prof"
    assert cli.main(["profile", "--n", "2", "--prompt-len", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "program decode T=1" in printed and "| kernels per step (traced) |" in printed
    for cat in CATEGORIES:
        assert f"| {cat} | " in printed
    census, meta = profile_report.read(out)
    assert meta["program"] == "decode T=1" and meta["n"] == 2 and meta["backend"] == "cpu"
    assert census.steps == 2 and census.real_step_us > 0 and census.kernels_per_step > 0
    total, count = _kernel_sum(out, out / "step_hlo.txt.gz")
    assert sum(census.by_category_us.values()) == pytest.approx(total / 2)  # every kernel in one category
    assert census.kernels_per_step == count / 2
    assert census.by_category_us["all-reduce"] == 0 and census.by_category_us["dense GEMM"] > 0
    assert census.by_category_us["MoE experts"] > 0 and census.by_category_us["KDA"] > 0
    md = (out / "census.md").read_text()
    assert md.count("\n| MLA attention |") == 1  # the census's row, once
    assert "kernels with the most time" in printed and "| kernel | scope (layers as *) |" in md
    assert len(census.top) == 15 and census.top[0]["us"] >= census.top[-1]["us"] > 0


@pytest.mark.parametrize("start", [0, 100])
def test_profile_a_prefill_chunk_on_the_cpu(capsys, start):
    """--program prefill: one chunk, padded as the engine pads it (40 tokens -> 64), its census, at position 0 or as
    a later chunk (--start); every program the command offers is one lingjax.steady runs."""
    from lingjax import steady

    assert set(profile_command.PROGRAMS) == set(steady.PROGRAMS)
    argv = ["profile", "--program", "prefill", "--prompt-len", "40", "--n", "1", "--start", str(start)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"program prefill chunk T=64{' at position 100' if start else ''}," in printed and "| KDA | " in printed


def test_compare_dense_and_fp8_weights_in_one_command(tmp_path, capsys):
    """--weights A B, with a single --kernels value for both sides."""
    argv = ["profile", "compare", "--weights", "dense", "fp8", "--kernels", "xla", "--n", "1", "--prompt-len", "8",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| µs per step | dense | fp8 | fp8 − dense | fp8 / dense |" in printed
    dense, fp8 = profile_report.read(tmp_path / "dense"), profile_report.read(tmp_path / "fp8")
    assert dense[1]["weights"] == "dense" and fp8[1]["weights"] == "fp8"
    assert dense[1]["kernels"] == fp8[1]["kernels"] == "xla"
    diff = profile_report.differences(dense[0], fp8[0])
    for cat in CATEGORIES:
        assert f"| {cat} | " in printed and f"{diff[cat]:+.0f} |" in printed


def test_revisions_take_one_weight_format_for_both(monkeypatch):
    """--revs A B --weights fp8: each revision's `lingjax profile` gets --weights fp8."""
    args = cli.build_parser().parse_args(
        ["profile", "compare", "--revs", "A", "B", "--weights", "fp8", "--kernels", "pallas"])
    argv = profile_command._profile_argv(args)
    assert argv[argv.index("--weights") + 1] == "fp8" and argv[argv.index("--kernels") + 1] == "pallas"


def test_compare_refuses_an_unknown_revision(capsys):
    assert "--revs no-such-rev-xyz: neither a directory nor a git revision" in _error(
        capsys, ["profile", "compare", "--revs", "no-such-rev-xyz", "HEAD"])


@pytest.mark.slow
def test_compare_two_revisions(tmp_path, capsys):
    """HEAD in a temporary worktree against this tree as it stands, each in a process of its own."""
    from lingjax import revisions

    try:
        head = revisions.short("HEAD")
    except ValueError:
        pytest.skip("not a git checkout")
    argv = ["profile", "compare", "--revs", "HEAD", str(revisions.ROOT), "--n", "1", "--prompt-len", "8",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"| µs per step | {head} | {revisions.ROOT.name} |" in printed
    assert profile_report.read(tmp_path / head)[1]["program"] == "decode T=1"
    assert not [line for line in revisions.subprocess.run(["git", "-C", str(revisions.ROOT), "worktree", "list"],
                                                          capture_output=True, text=True).stdout.splitlines()
                if f"lingjax-{head}-" in line]  # the temporary worktree is gone


def test_profile_a_tensor_parallel_round(tmp_path, capsys):
    """A NEXTN round of the tiny preset over 2 (fake CPU) devices: the collectives land in all-reduce, and the time
    they waited for the peer device is measured."""
    argv = ["profile", "--model", "tiny", "--tp", "2", "--program", "nextn", "--steps", "2", "--n", "1",
            "--prompt-len", "8", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert "| all-reduce | " in capsys.readouterr().out
    census, meta = profile_report.read(tmp_path)
    assert meta["tp"] == 2 and meta["program"] == "NEXTN round S=2" and census.devices == 2
    assert census.by_category_us["all-reduce"] > 0 and census.peer_wait_us is not None
