"""The bench scripts' launch count on optimised HLO text (bench/common.py: step_bench, aot_census)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import launch_lines, launch_summary  # noqa: E402

# The shapes of an H200 compile: a GEMM fusion whose body is not named %fused..., a tuple-shaped Pallas
# call and multi-output fusion, a rematerialized norm, a while body, and ops inside fusion bodies.
HLO = """HloModule jit_step

%gemm_fusion_dot.7_computation (parameter_0: bf16[16,640], parameter_1: bf16[10240,640]) -> f32[10240,16] {
  %parameter_0 = bf16[16,640]{1,0} parameter(0)
  %parameter_1 = bf16[10240,640]{1,0} parameter(1)
  ROOT %dot.9 = f32[10240,16]{0,1} dot(%parameter_1, %parameter_0), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%fused_computation.3 (param_0: f32[16,2560]) -> (bf16[16,2560], f32[16]) {
  %param_0 = f32[16,2560]{1,0} parameter(0)
  %convert.1 = bf16[16,2560]{1,0} convert(%param_0)
  %reduce.2 = f32[16]{0} reduce(%param_0, %c), dimensions={1}, to_apply=%add
  ROOT %tuple.3 = (bf16[16,2560]{1,0}, f32[16]{0}) tuple(%convert.1, %reduce.2)
}

%body (p: (s32[], f32[16,2560])) -> (s32[], f32[16,2560]) {
  %p = (s32[], f32[16,2560]{1,0}) parameter(0)
  %x = f32[16,2560]{1,0} get-tuple-element(%p), index=1
  %all-reduce.1 = f32[16,2560]{1,0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[16,2560]{1,0}) tuple(%i, %all-reduce.1)
}

ENTRY %main (a: bf16[16,640], w: bf16[10240,640]) -> f32[10240,16] {
  %a = bf16[16,640]{1,0} parameter(0)
  %w = bf16[10240,640]{1,0} parameter(1)
  %gemm_fusion_dot.7 = f32[10240,16]{0,1} fusion(%w, %a), kind=kCustom, calls=%gemm_fusion_dot.7_computation
  %pallas_call.42 = (f32[16,4,16]{2,1,0}, f32[1,4,16,16]{3,2,1,0}) custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
  %input_fusion.3 = (bf16[16,2560]{1,0}, f32[16]{0}) fusion(%x), kind=kInput, calls=%fused_computation.3
  %fusion.9.remat = bf16[16,2560]{1,0} fusion(%x), kind=kCustom, calls=%fused_computation.3
  %while.1 = (s32[], f32[16,2560]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[10240,16]{0,1} copy(%gemm_fusion_dot.7)
}
"""


def test_launches_counted_once_each():
    # the GEMM fusion (not its inner dot), the Pallas call and the multi-output fusion (tuple shapes), the
    # rematerialized fusion, the all-reduce in the loop body, the copy
    assert len(launch_lines(HLO)) == 6
    assert launch_summary(HLO) == "6 (1 remat)"


def test_no_remat_reads_as_a_plain_count():
    assert launch_summary(HLO.replace("%fusion.9.remat", "%fusion.9")) == "6"
