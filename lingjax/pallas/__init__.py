"""Pallas GPU kernels, each beside the plain-JAX reference in lingjax/ops/ it is tested against.

Empty until the kernel issues land (KDA chain-verify/decode/commit/prefill; MoE router, align,
grouped GEMM); `lingjax.load(..., kernels="pallas")` raises NotImplementedError until then.
"""
