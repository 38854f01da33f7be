"""bench/common.py's command-line options: XLA debug options (step_bench, aot_census) and kernel tuning fields
(--kernel-option OP:FIELD=VALUE), which become each op's tuning dataclass."""

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import add_options, kernel_option, tuning_for, tuning_label, xla_option  # noqa: E402
from lingjax.config import preset  # noqa: E402
from lingjax.pallas.kda_chain import ChainTuning  # noqa: E402
from lingjax.pallas.moe_experts import one_token_tiles  # noqa: E402
from lingjax.pallas.moe_router import RouterTuning  # noqa: E402


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


def test_kernel_options_become_tuning_dataclasses():
    opts = [kernel_option("moe_route:k_splits=2"), kernel_option("kda_chain:block_v=16"),
            kernel_option("moe_route:select_warps=1")]
    assert opts[1] == ("kda_chain", "block_v", 16)
    assert tuning_for(opts) == {"moe_route": RouterTuning(k_splits=2, select_warps=1),
                                "kda_chain": ChainTuning(block_v=16)}
    assert tuning_label(tuning_for(opts)) == " moe_route:k_splits=2 moe_route:select_warps=1 kda_chain:block_v=16"
    for bad in ("moe_route", "moe_route:k_splits", ":k_splits=2", "moe_route:=1", "no_such_op:block_v=16"):
        with pytest.raises(argparse.ArgumentTypeError):
            kernel_option(bad)
    with pytest.raises(ValueError, match="no field"):
        tuning_for([kernel_option("kda_chain:row_loop=true")])


def test_decode_expert_tiles_start_from_the_width_the_model_runs():
    # routed_experts picks its tiles by expert width when given none: an option changes that choice, per device
    cfg = preset("flash")
    got = tuning_for([kernel_option("moe_routed_experts:stages_up=4")], cfg, tp=2)
    assert got == {"moe_routed_experts": dataclasses.replace(one_token_tiles(cfg.moe_intermediate_size // 2),
                                                             stages_up=4)}
    assert tuning_label(got, cfg, tp=2) == " moe_routed_experts:stages_up=4"


def test_common_options_parse():
    ap = add_options(argparse.ArgumentParser(), "model", "tp", "kernels", "kernel_option", "out", many=("tp",),
                     model="flash")
    args = ap.parse_args(["--tp", "2", "4", "--kernel-option", "kda_chain:num_warps=2"])
    assert (args.model, args.tp, args.kernels, args.out) == ("flash", [2, 4], "auto", None)
    assert args.kernel_option == [("kda_chain", "num_warps", 2)]
    assert ap.parse_args([]).tp == [1]
