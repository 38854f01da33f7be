"""bench/ncu_kernels.py's summary: ncu's CSV of kernel durations split into the configurations that made them."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from ncu_kernels import summary_rows  # noqa: E402

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _csv(tmp_path, launches):
    lines = ["==PROF== Connected to process 1", HEAD]
    for i, (kernel, ns) in enumerate(launches):
        lines.append(f'"{i}","1","python3","host","{kernel}","1","7","(128, 1, 1)","(128, 1, 1)","0","9.0",'
                     f'"Command line profiler metrics","gpu__time_duration.sum","ns","{ns:,}"')
    lines.append("==PROF== Disconnected")
    path = tmp_path / "d.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_launches_split_by_group_in_order_with_the_first_skipped(tmp_path):
    # two configurations of 3 launches each, one kernel name; ncu prints thousands separators
    path = _csv(tmp_path, [("k", 9000), ("k", 4000), ("k", 5000), ("k", 12000), ("k", 7000), ("k", 6000)])
    groups = tmp_path / "g.txt"
    groups.write_text("T=1\t3\nT=6\t3\n")
    rows = summary_rows(path, str(groups), skip=1)
    assert rows == [("T=1", "k", 2, 4.5, 4.0, 5.0), ("T=6", "k", 2, 6.5, 6.0, 7.0)]


def test_kernels_counted_per_name(tmp_path):
    # a layer of two kernels launched twice: each name has its own sequence
    path = _csv(tmp_path, [("gemv", 1000), ("up", 20000), ("gemv", 3000), ("up", 22000)])
    groups = tmp_path / "g.txt"
    groups.write_text("moe T=1\t2\n")
    rows = summary_rows(path, str(groups), skip=0)
    assert rows == [("moe T=1", "gemv", 2, 2.0, 1.0, 3.0), ("moe T=1", "up", 2, 21.0, 20.0, 22.0)]


def test_a_profile_short_of_the_groups_is_refused(tmp_path):
    path = _csv(tmp_path, [("k", 1000), ("k", 2000)])
    groups = tmp_path / "g.txt"
    groups.write_text("T=1\t3\n")
    with pytest.raises(ValueError, match="2 launches profiled"):
        summary_rows(path, str(groups), skip=0)
