"""The one measurement seam inside the Pallas kernels. Every kernel of the package launches through
lingjax.pallas.pallas_call, which asks the current Instrument to make the launch; the default Instrument launches
as the product does and changes nothing. A bench (bench/kernel_stamps.py) subclasses Instrument and installs it
with `instrumented(...)` around the trace of the programs it measures, e.g. to stamp each program's start and end.

Hooks: launch(kernel, **pallas_call keywords) makes every kernel's launch; selected(expert) sees the expert the
decode's up kernel selects (lingjax.pallas.moe_experts)."""

from __future__ import annotations

import contextlib

from jax.experimental import pallas as pl

from lingjax.pallas.grid_dependency import after_producers


class Instrument:
    """The product's launches, unobserved. Subclass to observe them."""

    def launch(self, kernel, **kwargs):
        """The launch of `kernel` (its raw body) with pl.pallas_call's keywords -> the callable on the operands."""
        return pl.pallas_call(after_producers(kernel), **kwargs)

    def selected(self, expert):
        return expert


_current = Instrument()


def current() -> Instrument:
    """The instrument kernels traced now launch through."""
    return _current


@contextlib.contextmanager
def instrumented(instrument: Instrument):
    """Kernels traced inside the block launch through `instrument` (an Instrument subclass). Jitted entry points
    keep the programs they traced before: instrument their unjitted forms (`fn.__wrapped__`)."""
    global _current
    saved, _current = _current, instrument
    try:
        yield instrument
    finally:
        _current = saved
