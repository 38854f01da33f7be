"""Kernel choice, in one place.

`kernels="xla"` runs the plain-JAX references in lingjax/ops; `kernels="pallas"` runs the Pallas kernels in
lingjax/pallas (interpret mode off the GPU, so the same model runs everywhere); `kernels="auto"` (the
default) is "pallas" on a GPU and "xla" elsewhere. Which op a layer needs (chain or chunked KDA, absorbed or
expanded MLA, the Pallas linear or the Pallas GEMM, the decode's routing inside the expert launches) is chosen by the
number of tokens once, in lingjax.model.paths_for, whose flags the layers read; this module only picks the
implementation of an op. (The experts' XLA reference gathers weights at decode/verify rows and sorts the pairs
above: that is the reference's own algorithm; the Pallas kernels serve every T.)

Each Pallas entry point takes its reference's arguments and returns its result, plus a keyword-only
`tuning` (the kernel's frozen tuning dataclass). Each has a `supports` function beside it: on a GPU, a call
whose shapes the kernel's Triton lowering does not take runs the reference instead (for the routed experts
a form of it on every padded row, which keeps speculation lossless), and lingjax says so once per op and
reason (docs/kernels/README.md). Interpret mode takes any shape, so off the GPU the kernels run
as called.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable

from lingjax import target
from lingjax.ops import kda as kda_ops
from lingjax.ops import linear as linear_ops
from lingjax.ops import mla as mla_ops
from lingjax.ops import moe as moe_ops
from lingjax.stacked import layer_as_value, map_layers, materialize

KERNELS = ("xla", "pallas")
CHOICES = ("auto",) + KERNELS

log = logging.getLogger("lingjax")


@dataclasses.dataclass(frozen=True)
class Op:
    reference: Callable  # the plain-JAX semantics, lingjax/ops
    pallas: str  # "module:function" of the Pallas kernel
    supports: str  # "module:function" -> None if the kernel lowers for these arguments, else the reason
    # what a GPU runs where supports() refuses a call: the reference, or a form of it that keeps the kernel's
    # row invariance (one set of shapes whatever T, so a decode and a verify round each row alike)
    fallback: Callable | None = None

    def kernel(self) -> Callable:
        return _attr(self.pallas)

    def reference_for_gpu(self) -> Callable:
        return self.fallback or self.reference

    def unsupported(self, *args, **kwargs) -> str | None:
        return _attr(self.supports)(*args, **kwargs)


OPS = {
    "kda_chain": Op(kda_ops.kda_chain, "lingjax.pallas.kda_chain:kda_chain_verify",
                    "lingjax.pallas.kda_chain:supports"),
    "kda_chunked": Op(kda_ops.kda_chunked, "lingjax.pallas.kda_prefill:kda_chunked_prefill",
                      "lingjax.pallas.kda_prefill:supports"),
    "gemm": Op(linear_ops.linear, "lingjax.pallas.gemm:gemm", "lingjax.pallas.gemm:supports"),
    "linear": Op(linear_ops.rows_linear, "lingjax.pallas.linear:linear", "lingjax.pallas.linear:supports"),
    "mla_absorbed": Op(mla_ops.mla_absorbed, "lingjax.pallas.mla_decode:mla_decode_attention",
                       "lingjax.pallas.mla_decode:supports"),
    "mla_expanded": Op(mla_ops.mla_expanded, "lingjax.pallas.mla_prefill:mla_prefill_attention",
                       "lingjax.pallas.mla_prefill:supports"),
    "moe_route": Op(moe_ops.route, "lingjax.pallas.moe_router:route", "lingjax.pallas.moe_router:supports"),
    "moe_experts": Op(moe_ops.experts, "lingjax.pallas.moe_experts:fused_experts",
                      "lingjax.pallas.moe_experts:supports_fused_experts", moe_ops.experts_all_rows),
    "moe_routed_experts": Op(moe_ops.routed_experts, "lingjax.pallas.moe_experts:routed_experts",
                             "lingjax.pallas.moe_experts:supports_routed_experts", moe_ops.routed_experts_all_rows),
}


def _attr(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def resolve(kernels: str) -> str:
    """"auto" -> the kernel set for this platform; "xla" and "pallas" as given. Raises for an unknown name."""
    if kernels not in CHOICES:
        raise ValueError(f"kernels must be one of {CHOICES}, got {kernels!r}")
    if kernels == "auto":
        return "pallas" if target.platform() == "gpu" else "xla"
    return kernels


def check_op_names(what: str, names) -> None:
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        raise ValueError(f"{what} names unknown ops {unknown}; ops: {sorted(OPS)}")


_reported: set[tuple[str, str]] = set()


def forget_fallbacks() -> None:
    """Say each fallback again from here on, once more (for a bench that reports them model by model)."""
    _reported.clear()


def _fall_back(name: str, reason: str) -> None:
    if (name, reason) not in _reported:
        _reported.add((name, reason))
        log.warning("lingjax: %s runs its XLA reference, not its Pallas kernel: %s", name, reason)


def runs_kernel(name: str, pallas: bool, tuning, *args, **kwargs) -> bool:
    """Whether `implementation(name, pallas, tuning)` called with these arguments runs the Pallas kernel: the
    Pallas set, and on a GPU shapes its supports() takes (interpret mode takes any)."""
    if not pallas:
        return False
    extra = {} if tuning is None else {"tuning": tuning}
    return target.platform() != "gpu" or OPS[name].unsupported(*args, **kwargs, **extra) is None


def on_values(fun: Callable) -> Callable:
    """fun called with every lingjax.stacked.LayerOf among its arguments sliced out of its stack: how an XLA
    reference reads a stacked layer's weight (a Pallas kernel reads it in place)."""

    @functools.wraps(fun)
    def call(*args, **kwargs):
        args, kwargs = map_layers(materialize, (args, kwargs))
        return fun(*args, **kwargs)

    return call


def implementation(name: str, pallas: bool, tuning=None) -> Callable:
    """The implementation of op `name`: its reference, or (pallas) its Pallas kernel with `tuning` (None: the
    kernel's defaults), which on a GPU falls back to the reference (Op.fallback's row-invariant form where the
    op has one) where supports() rejects a call's shapes."""
    op = OPS[name]
    if not pallas:
        return on_values(op.reference)
    extra = {} if tuning is None else {"tuning": tuning}

    def call(*args, **kwargs):
        if target.platform() == "gpu":
            reason = op.unsupported(*args, **kwargs, **extra)
            if reason:
                _fall_back(name, reason)
                return on_values(op.reference_for_gpu())(*args, **kwargs)
        args, kwargs = map_layers(layer_as_value, (args, kwargs))
        return op.kernel()(*args, **kwargs, **extra)

    return call
