"""step_bench's --xla-option parsing (also aot_census's): XLA debug options for one variant's programs."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from step_bench import xla_option  # noqa: E402


def test_values_take_their_type():
    assert xla_option("xla_gpu_experimental_force_split_k=1") == ("xla_gpu_experimental_force_split_k", 1)
    assert xla_option("xla_gpu_enable_triton_gemm=false") == ("xla_gpu_enable_triton_gemm", False)
    assert xla_option("xla_gpu_memory_limit_slop_factor=92.5") == ("xla_gpu_memory_limit_slop_factor", 92.5)
    assert xla_option("xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL") == (
        "xla_gpu_enable_command_buffer", "FUSION,CUSTOM_CALL")


@pytest.mark.parametrize("bad", ["xla_gpu_enable_triton_gemm", "force_split_k=1", "=1"])
def test_malformed_options_are_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        xla_option(bad)
