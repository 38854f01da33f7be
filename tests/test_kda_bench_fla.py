"""kda_bench reads the fla child's output and says when the child was cut off before its end."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from kda_bench import load_fla  # noqa: E402


def _write(tmp_path, records, tail=""):
    path = tmp_path / "fla.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def test_complete_output(tmp_path):
    fla = load_fla(_write(tmp_path, [{"fused_recurrent_T1": 5.1},
                                     {"fused_recurrent_T1": 5.1, "chunk_kda_T8192": 1300.0, "complete": True}]))
    assert fla == {"fused_recurrent_T1": 5.1, "chunk_kda_T8192": 1300.0}


def test_cut_off_output_is_flagged(tmp_path):
    # the child printed its chain figures, then its timeout killed it in the prefill (a torn last line)
    fla = load_fla(_write(tmp_path, [{"fused_recurrent_T1": 5.1}], tail='{"fused_recurrent_T1": 5.1, "chu'))
    assert fla["fused_recurrent_T1"] == 5.1 and "cut off" in fla["error"]


def test_no_output(tmp_path):
    assert load_fla(_write(tmp_path, [], tail="Traceback (most recent call last):\n")) == {"error": "no fla output"}
