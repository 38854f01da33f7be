"""Pallas GPU kernels, each beside the plain-JAX reference in lingjax/ops/ it is tested against.

Empty until the kernel issues land (KDA chain-verify/decode/commit/prefill; MoE router, align,
grouped GEMM); `lingjax.load(..., kernels="pallas")` raises NotImplementedError until then.
"""

import jax


def resolve_interpret(interpret: bool | None) -> bool:
    """interpret=None means: interpret mode unless the backend is a GPU (chosen by backend, never by
    import failure; the CPU backend only runs Pallas in interpret mode)."""
    return jax.default_backend() != "gpu" if interpret is None else interpret
