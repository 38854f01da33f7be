"""Will a model fit? Its weights' bytes from the config alone (abstract shapes: nothing is allocated), against
the memory a device has free, checked before any weight is drawn or read."""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from lingjax.config import LingConfig
from lingjax.model import abstract_model

HEADROOM = 0.9  # of a device's free memory the weights may take: caches and workspace need the rest


def weight_bytes(cfg: LingConfig, dtype, fp8=None) -> int:
    """The bytes of the model's parameters in `dtype`, with fp8 (an Fp8Layout) its matrices in fp8 plus scales."""
    state = nnx.state(abstract_model(cfg, dtype, fp8=fp8), nnx.Param)
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(state))


def free_bytes(device=None) -> int | None:
    """Free memory of a device: an accelerator's allocator limit less what it holds; a CPU's available host
    memory (/proc/meminfo). None where neither can be read."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(cfg: LingConfig, dtype, tp: int = 1, source: str = "the model", fp8=None, extra_bytes: int = 0) -> None:
    """ValueError when the weights (fp8: an Fp8Layout, its matrices in fp8) and extra_bytes (copies made at load: a
    draft vocabulary's lm_head rows), split over tp devices, would take more than HEADROOM of a device's free memory
    (the split is taken as even: an estimate, slightly low for the replicated parts)."""
    need = (weight_bytes(cfg, dtype, fp8) + extra_bytes) / tp
    free = free_bytes()
    if free is not None and need > HEADROOM * free:
        where = f"each of {tp} devices" if tp > 1 else f"the {jax.devices()[0].platform.upper()} device"
        raise ValueError(f"{source} needs about {need / 1e9:.1f} GB of weights on {where}, which has "
                         f"{free / 1e9:.1f} GB free; use a larger --tp (more devices) or a smaller model")
