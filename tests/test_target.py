"""lingjax.target: what programs are built for, and compile_for's override (bench/aot_census.py)."""

import jax

from lingjax import kernels, sharding, target
from lingjax.pallas import resolve_interpret


def test_defaults_follow_this_process():
    assert target.platform() == jax.default_backend() and target.devices() == jax.devices()


def test_compile_for_steers_the_platform_choices_and_restores_them():
    fake = jax.devices()[:2]
    with target.compile_for("gpu", fake):
        assert target.platform() == "gpu" and target.devices() == list(fake)
        assert kernels.resolve("auto") == "pallas" and resolve_interpret(None) is False
        assert sharding.make_mesh(2).devices.tolist() == list(fake)
    assert target.platform() == jax.default_backend()
    assert kernels.resolve("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")


def test_place_leaves_abstract_leaves_alone():
    abstract = {"w": jax.ShapeDtypeStruct((4, 8), "float32")}
    mesh = sharding.make_mesh(1)
    assert sharding.place(abstract, {"w": jax.sharding.PartitionSpec()}, mesh) == abstract
