"""The compute dtypes a user names ("bfloat16", "float32"), in one table: lingjax.load's and the drafter's `dtype`,
the trainer's compute dtype."""

from __future__ import annotations

import jax.numpy as jnp

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def dtype_of(name: str, argument: str = "dtype"):
    """The jnp dtype called `name`; a ValueError naming `argument` for any other name."""
    if name not in DTYPES:
        raise ValueError(f"{argument} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]
