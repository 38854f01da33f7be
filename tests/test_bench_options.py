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


def test_kernel_options_parse_and_group():
    from step_bench import grouped, kernel_option

    opts = [kernel_option("moe_route:select=serial"), kernel_option("kda_chain:deferred_norms=true"),
            kernel_option("moe_route:k_splits=2")]
    assert opts[1] == ("kda_chain", "deferred_norms", True)
    assert grouped(opts) == (("moe_route", (("select", "serial"), ("k_splits", 2))),
                             ("kda_chain", (("deferred_norms", True),)))
    for bad in ("moe_route", "moe_route:select", ":select=serial", "moe_route:=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            kernel_option(bad)


def test_exec_hands_kernel_options_to_the_pallas_kernel_only():
    from lingjax import kernels
    from lingjax.execution import Exec

    opts = (("moe_route", (("select", "serial"),)),)
    op = Exec("pallas", kernel_options=opts).op("moe_route")
    assert op.func is kernels.get("moe_route", "pallas") and op.keywords == {"select": "serial"}
    assert Exec("pallas", xla_ops=("moe_route",), kernel_options=opts).op("moe_route") is kernels.get("moe_route", "xla")
    assert Exec("xla", kernel_options=opts).op("moe_route") is kernels.get("moe_route", "xla")
    assert Exec("pallas", kernel_options=opts).op("kda_chain") is kernels.get("kda_chain", "pallas")
