"""Pallas GPU kernels, each beside the plain-JAX reference in lingjax/ops/ it is tested against.

kda_chain (fused chain-verify/decode + commit), kda_prefill (chunked prefill), moe_router,
moe_align (pair-axis align), moe_experts (grouped GEMMs with the SwiGLU epilogue). lingjax/kernels.py
maps each onto the reference op it replaces; `lingjax.load(..., kernels="pallas")` selects them.
"""

import jax


def resolve_interpret(interpret: bool | None) -> bool:
    """interpret=None means: interpret mode unless the backend is a GPU (chosen by backend, never by
    import failure; the CPU backend only runs Pallas in interpret mode)."""
    return jax.default_backend() != "gpu" if interpret is None else interpret
