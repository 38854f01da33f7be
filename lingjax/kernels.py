"""Kernel choice, in one place: `kernels="xla"` runs the plain-JAX references in lingjax/ops;
`kernels="pallas"` runs the Pallas kernels in lingjax/pallas (interpret mode off the GPU, so the
same model runs everywhere); `kernels="auto"` (the default) is "pallas" on a GPU, "xla" elsewhere:
on the GPU the Pallas set is the fast one and the one measured lossless for bf16 speculation
(bench/results/lossless_h200_2026-11-30.md), off it interpret mode is only for tests. Which op a
layer needs (chain or chunked KDA, gathered or sorted MoE) is chosen by shape in
lingjax.model.paths_for; this module only picks the implementation.

Each Pallas entry point takes the reference's arguments and returns its result; it may add
keyword-only options with defaults (tile sizes, interpret, or extra fused work such as the shared
expert in `fused_experts`).
"""

from __future__ import annotations

import importlib

from lingjax import target

from lingjax.ops import kda as kda_ops
from lingjax.ops import mla as mla_ops
from lingjax.ops import moe as moe_ops

KERNELS = ("xla", "pallas")
CHOICES = ("auto",) + KERNELS


# op name -> (reference, "module:function" of the Pallas implementation)
OPS = {
    "kda_chain": (kda_ops.kda_chain, "lingjax.pallas.kda_chain:kda_chain_verify"),
    "kda_chunked": (kda_ops.kda_chunked, "lingjax.pallas.kda_prefill:kda_chunked_prefill"),
    "mla_absorbed": (mla_ops.mla_absorbed, "lingjax.pallas.mla_decode:mla_decode_attention"),
    "moe_route": (moe_ops.route, "lingjax.pallas.moe_router:route"),
    "moe_experts": (moe_ops.experts_gathered, "lingjax.pallas.moe_experts:fused_experts"),
    "moe_routed_experts": (moe_ops.routed_experts, "lingjax.pallas.moe_experts:routed_experts"),
}


def _pallas(op: str):
    module, name = OPS[op][1].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ModuleNotFoundError, AttributeError):
        return None


def missing_pallas_ops() -> list[str]:
    return [op for op in OPS if _pallas(op) is None]


def resolve(kernels: str) -> str:
    """"auto" -> the kernel set for this backend; "xla" and "pallas" as given. Raises for an unknown
    name, or for "pallas" while a Pallas kernel is missing (load calls this before reading weights)."""
    if kernels not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {kernels!r}")
    if kernels == "auto":
        kernels = "pallas" if target.platform() == "gpu" else "xla"
    if kernels == "pallas" and missing_pallas_ops():
        raise NotImplementedError(f"kernels='pallas' needs Pallas kernels not written yet: {missing_pallas_ops()}; "
                                  "use kernels='xla'")
    return kernels


def get(op: str, kernels: str):
    """The implementation of `op` for the kernel set `kernels`."""
    if kernels == "xla":
        return OPS[op][0]
    if kernels == "pallas":
        impl = _pallas(op)
        if impl is None:
            raise NotImplementedError(f"no Pallas kernel for {op} yet ({OPS[op][1]})")
        return impl
    raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
