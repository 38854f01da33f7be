"""bench/kernel_stamps.py: the probed T = 1 layer (through lingjax.pallas.instrument.instrumented) equals the unprobed
one,
and the report's arithmetic (spreads from the first GEMV program, per-program phases, layer periods, 32-bit
wraparound) is right."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import kernel_stamps as ks  # noqa: E402


def test_smoke_run_equals_unprobed(capsys):
    assert ks.main(["--smoke"]) == 0  # 1 when the probed output differs from the unprobed
    out = capsys.readouterr().out
    assert "bit-equal to the unprobed: True" in out
    # the tiny preset's layer: GEMV, routed and shared up, down: every launch probed
    assert "| programs | 8 | 8 | 2 | 5 |" in out
    assert "| select median |  | 0.00 |  |  |" in out  # the up kernel's selection went through the hook


def _table(programs, start, wait, end, select=None, sm=None, clock=2.0):
    """A stamp table: times in ns from `start` etc. (arrays), SM clock at `clock` GHz from the same origin."""
    t = np.zeros((programs, len(ks.COLUMNS)), np.int64)
    t[:, ks.COL["sm"]] = np.arange(programs) if sm is None else sm
    for name, ns in (("start", start), ("wait", wait), ("end", end)) + (
        (("select", select),) if select is not None else ()
    ):
        t[:, ks.COL[name + "_g"]] = ns
        t[:, ks.COL[name + "_c"]] = np.asarray(ns) * clock
    return (t % 2**32).astype(np.uint32).view(np.int32)  # the kernel stores low 32 bits


def test_phases_from_synthetic_stamps():
    base = 2**32 - 1500  # globaltimer and clock wrap inside the layer
    gemv = _table(4, base + np.array([0, 10, 20, 30]), base + np.array([0, 10, 20, 30]) + 5,
                  base + np.array([900, 1000, 1100, 1200]))
    up_start = base + 2000 + np.array([0, 100, 0, 100, 50, 50])
    up = _table(6, up_start, up_start + 10, up_start + np.array([9000, 9000, 9000, 9000, 7000, 8000]),
                select=up_start + 3010)
    down = _table(3, base + 11000 + np.zeros(3, np.int64), base + 11000 + np.zeros(3, np.int64),
                  base + 15000 + np.array([0, 500, 1000]), sm=np.array([0, 0, 1]))
    layer = {"moe_router_gemv": gemv, "moe_up_select": up, "moe_down_combine": down}
    runs = [[layer, layer, layer]]  # phases reads layers 1..n-2
    assert abs(ks.clock_ghz(runs) - 2.0) < 1e-6
    table = ks.phases(runs, routed_programs=4, clock_ghz=2.0)
    med = lambda key, row: pytest.approx(float(np.median(table[key][row])), abs=1e-9)
    routed, shared = ("moe_up_select", "routed"), ("moe_up_select", "shared")
    assert med(("moe_router_gemv", "all"), "end max") == 1.2  # µs from the first GEMV program's start
    assert med(routed, "start min") == 2.0 and med(routed, "start max") == 2.1
    assert med(routed, "select median") == 5.06  # 2000 + 50 + 3010 ns
    assert med(routed, "select µs median") == 3.0 and med(routed, "stream µs max") == 5.99
    assert med(shared, "work µs median") == 7.49 and med(shared, "programs") == 2
    assert "select min" not in table[shared]  # only the routed programs select
    assert med(("moe_down_combine", "all"), "end max") == 16.0 and med(("moe_down_combine", "all"), "SMs") == 2


def test_periods_between_chained_layers():
    def layer(first_ns):
        return {"moe_router_gemv": _table(2, first_ns + np.array([40, 0]), first_ns + 5, first_ns + 900)}

    base = 2**32 - 20_000  # the second period wraps
    runs = [[layer(base), layer(base + 10_000), layer(base + 46_500), layer(base + 83_000)]]
    assert ks.periods(runs) == pytest.approx([36.5, 36.5])  # layers 1 and 2 to their next (layer 0 warms up)
    runs.append([layer(0), layer(1_000), layer(38_000), layer(80_000), layer(90_000)])
    assert ks.periods(runs) == pytest.approx([36.5, 36.5, 37.0, 42.0, 10.0])
