"""Faster lowering of the Pallas kernels: MLIR's Python module of the Triton dialect made findable.

Before MLIR's Python bindings wrap an op or a type of a dialect, they import the dialect's Python module from
their search prefixes (jaxlib.mlir.dialects, jaxlib.mosaic.python, jax.jaxlib.mosaic.python), and they remember
only an import that succeeded. The Triton dialect ("tt") that Pallas's Triton lowering emits keeps its module
elsewhere (jaxlib.triton.dialect, imported and registered by that lowering), so left alone every op and value of
every kernel would fail three imports, each a search of sys.path: about half of a step program's lowering time,
which a warm process pays for every program. Registered under the first prefix, the module is found once; the
lowered programs are the same text (bench/lowering_bench.py).
"""

from __future__ import annotations

import sys

ALIAS = "jaxlib.mlir.dialects.tt"


def install() -> None:
    """Make the Triton dialect's module importable under MLIR's first search prefix (idempotent; without jaxlib's
    Triton bindings, nothing to do)."""
    if ALIAS in sys.modules:
        return
    try:
        from jaxlib.triton import dialect
    except ImportError:
        return
    sys.modules[ALIAS] = dialect
