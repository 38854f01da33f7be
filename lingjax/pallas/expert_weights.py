"""How the expert kernels (lingjax.pallas.moe_experts) take their weights: all plain or all fp8 (routed and shared
alike), the array each streams, and the scale blocks of fp8 ones."""

from __future__ import annotations

from lingjax.ops.fp8 import Fp8Array


def streamed(w):
    """The array a kernel streams: an fp8 weight's float8_e4m3fn values (its scales go in beside), else w."""
    return w.q if isinstance(w, Fp8Array) else w


def fp8_blocks(w_gate, w_up, w_down, shared):
    """The scale blocks of fp8 expert weights: (up, down), each None for plain weights or a tuple of (gn, gk) per
    weight family (the experts', then the shared expert's). Mixed plain and fp8 weights, or gate and up in other
    blocks, are refused."""
    weights = (w_gate, w_up, w_down) + tuple(shared or ())
    kinds = {isinstance(w, Fp8Array) for w in weights}
    if kinds == {False}:
        return None, None
    if len(kinds) > 1:
        raise ValueError("the expert kernels take all expert weights (routed and shared) in fp8 or none")
    if w_gate.block != w_up.block or (shared is not None and shared[0].block != shared[1].block):
        raise ValueError(f"gate and up weights in other scale blocks: {w_gate.block}, {w_up.block}")
    up = (w_gate.block,) + (() if shared is None else (shared[0].block,))
    down = (w_down.block,) + (() if shared is None else (shared[2].block,))
    return up, down
