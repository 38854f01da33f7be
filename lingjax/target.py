"""The platform lingjax builds its programs for: this process's default backend and devices, unless a
deviceless compile names others (`compile_for`).

Three choices follow the platform: the kernel set "auto" resolves to (lingjax.kernels), whether Pallas
runs in interpret mode (lingjax.pallas.resolve_interpret), and the GPU compiler options of the step
programs (lingjax.execution.step_jit); the tensor-parallel mesh takes its devices from here
(lingjax.sharding). bench/aot_census.py compiles the step for H200s on a machine without one by
naming the "gpu" platform and a topology's devices.
"""

from __future__ import annotations

import contextlib

import jax

_override: tuple[str, tuple] | None = None  # (platform, devices) of compile_for


def platform() -> str:
    """"gpu", "cpu", ...: what programs are built for."""
    return _override[0] if _override else jax.default_backend()


def devices() -> list:
    """The devices a mesh is made of."""
    return list(_override[1]) if _override else jax.devices()


@contextlib.contextmanager
def compile_for(platform_name: str, target_devices):
    """Build for `platform_name` on `target_devices` (e.g. a topology's abstract devices) inside the block."""
    global _override
    saved, _override = _override, (platform_name, tuple(target_devices))
    try:
        yield
    finally:
        _override = saved
