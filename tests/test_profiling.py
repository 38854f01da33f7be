"""The GPU-time census (lingjax.profiling) on a synthetic trace in the jax.profiler GPU layout, and
the HLO scope map on a real compiled program."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from lingjax import profiling

HLO = """
ENTRY %main {
  %fusion.1 = bf16[8]{0} fusion(%p), kind=kCustom, metadata={op_name="jit(r)/shard_map/verify/layer0_kda/kda_proj/dot_general"}
  %fusion.2 = f32[8]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(r)/shard_map/verify/layer0_kda/kda_out/mul"}
  %custom-call.3 = f32[8]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(r)/shard_map/verify/layer0_kda/kda_recurrence/pallas_call"}
  %custom-call.4 = f32[8]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(r)/shard_map/verify/layer1_kda/moe_experts/pallas_call"}
  ROOT %all-reduce.5 = f32[8]{0} all-reduce(%p), metadata={op_name="jit(r)/shard_map/verify/layer1_kda/psum"}
}
"""


def _trace(tmp_path):
    """Two GPUs; GPU 0 runs 6 kernels on two streams over [0, 100) µs with 30 µs idle, plus a
    derived 'XLA Ops' line that must not be counted again."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(Memcpy)"}},
        {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 3, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
    ]

    def kernel(pid, tid, ts, dur, name, op):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": {"hlo_op": op}}

    events = meta + [
        kernel(1, 7, 0, 20, "nvjet_hsh_64x8_gemm", "fusion.1"),  # dense GEMM
        kernel(1, 7, 20, 10, "loop_multiply_fusion", "fusion.2"),  # glue in a dense scope
        kernel(1, 8, 25, 10, "kda_chain_verify", "custom-call.3"),  # overlaps: union counts [20, 35) once
        kernel(1, 7, 40, 5, "mla_decode_split", "command_buffer.9"),  # a Pallas kernel in a CUDA graph: no scope
        kernel(1, 7, 50, 15, "fused_experts_up", "custom-call.4"),
        kernel(1, 7, 85, 15, "ncclDevKernel_AllReduce_Sum_f32", "all-reduce.5"),
        kernel(1, 9, 0, 100, "fusion.1", "fusion.1"),  # derived line
        kernel(2, 7, 0, 40, "nvjet_hsh_64x8_gemm", "fusion.1"),
        kernel(2, 7, 91, 4, "ncclDevKernel_AllReduce_Sum_f32", "all-reduce.5"),  # GPU 0 waits 6 µs of its 15
        kernel(3, 1, 0, 500, "PjitFunction(r)", ""),
    ]
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_census_categories_union_and_calibration(tmp_path):
    kernels = profiling.load_kernels(_trace(tmp_path))
    assert sorted({k.device for k in kernels}) == [0, 1] and len(kernels) == 8
    c = profiling.census(kernels, profiling.op_scopes(HLO), steps=2, real_step_s=40e-6)
    assert c.by_category_us == {"MoE experts": 7.5, "router/glue": 5.0, "all-reduce": 7.5, "dense GEMM": 10.0,
                                "KDA": 5.0, "MLA attention": 2.5}
    assert c.traced_step_us == 50.0 and c.busy_us == 35.0 and c.traced_idle_us == 15.0
    assert c.real_idle_us == 5.0 and c.kernels_per_step == 3.0 and c.devices == 2
    assert c.peer_wait_us == 3.0  # 6 µs over 2 steps
    assert c.collective_gap_us == 10.0  # of the idle [35, 50) and [65, 85), the gap before the all-reduce
    assert profiling.peer_wait_us([k for k in kernels if k.device == 0]) is None
    table = profiling.format_census({"a": c, "b": c})
    assert "| MoE experts | 8 (18.8%) | 8 (18.8%) |" in table and "| traced / real | 1.25 | 1.25 |" in table
    assert "| of the all-reduce time: waiting for a peer (traced) | 3 (7.5%) | 3 (7.5%) |" in table
    assert "| of it: gaps beside a collective (traced) | 10 (20.0%) | 10 (20.0%) |" in table
    with pytest.raises(ValueError, match="no kernels of GPU 3"):
        profiling.census(kernels, {}, steps=1, device=3)


def test_op_scopes_of_a_compiled_program():
    def f(x, w):
        with jax.named_scope("kda_proj"):
            y = x @ w
        with jax.named_scope("moe_router"):
            return jax.nn.sigmoid(y).sum()

    text = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8))).compile().as_text()
    scopes = profiling.op_scopes(text).values()
    assert any("kda_proj" in s for s in scopes) and any("moe_router" in s for s in scopes)


def test_pallas_kernels_are_categorized_by_their_own_names():
    """A Pallas kernel inside a CUDA graph carries no HLO scope: its name alone places it (the projections' `linear`
    is dense GEMM, not glue)."""
    k = lambda name: profiling.Kernel(0, 0.0, 1.0, name, "command_buffer.1")  # noqa: E731
    assert profiling.category(k("linear"), "") == "dense GEMM"
    assert profiling.category(k("kda_chain_verify"), "") == "KDA"
    assert profiling.category(k("moe_up_select"), "") == "MoE experts"
    assert profiling.category(k("moe_router_gemv"), "") == "router/glue"
    assert profiling.category(k("loop_add_fusion"), "") == "router/glue"


def test_top_kernels_group_a_kernels_layers_and_sum_per_step():
    """A kernel launched in every layer (XLA numbers its copies, the scope names the layer) is one row: its launches
    and µs per step summed; rows come the most time first, cut at n, and the table gives each row's share."""
    scopes = {"fusion.1": "jit(r)/jit(main)/layer0_kda/kda_out/add", "fusion.2": "jit(r)/layer12_kda/kda_out/add",
              "fusion.3": "jit(r)/lm_head/dot_general"}

    def k(name, op, dur):
        return profiling.Kernel(0, 0.0, dur, name, op)

    kernels = [k("loop_add_fusion", "fusion.1", 2.0), k("loop_add_fusion_7", "fusion.2", 3.0),
               k("gemv.3", "fusion.3", 4.0), k("linear", "command_buffer.1", 1.0)] * 2
    top = profiling.top_kernels(kernels, scopes, steps=2, n=2)
    assert top == [dict(name="loop_add_fusion", scope="layer*_kda/kda_out/add", category="router/glue", launches=2.0,
                        us=5.0),
                   dict(name="gemv", scope="lm_head/dot_general", category="dense GEMM", launches=1.0, us=4.0)]
    c = profiling.Census(steps=2, traced_step_us=20.0, busy_us=10.0, by_category_us={}, kernels_per_step=4,
                         real_step_us=25.0, top=top)
    table = profiling.format_top(c)
    assert "| loop_add_fusion | layer*_kda/kda_out/add | router/glue | 2 | 5.0 (20.0%) |" in table
    assert profiling.census(kernels, scopes, steps=2, top=3).top[2]["name"] == "linear"
