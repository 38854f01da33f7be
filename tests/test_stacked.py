"""The per-layer parameters travel stacked (lingjax.stacked.Stacking): which ones, their views inside a program, the
memory bound, and a model whose programs take the stacks giving what one with an array per layer gives."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import key_for
from lingjax import sharding
from lingjax.config import preset
from lingjax.model import abstract_model, fp8_layout
from lingjax.random_weights import random_model
from lingjax.runtime import Model, RunOptions
from lingjax.stacked import IN_PLACE, MAX_STACK_ELEMENTS, LayerOf, Stacking, _name


def _leaves(cfg, fp8=None):
    state = nnx.state(abstract_model(cfg, jnp.bfloat16, fp8=fp8))
    with_paths = jax.tree_util.tree_leaves_with_path(state)
    paths = [sharding.path_keys(p) for p, _ in with_paths]
    leaves = [leaf for _, leaf in with_paths]
    return paths, leaves, [sharding.param_spec(p) for p in paths]


def test_the_plan_stacks_each_kernel_read_parameter_across_its_layers():
    """Flash's layout in fp8: each IN_PLACE name (values and scales apart) is one stack of every layer that has it,
    in layer order, but the routed experts' values (40 x 512 x 768 x 2560 elements: past the kernels' 32-bit
    offsets); the norms, MLA's kv_b_proj and head gate, and the MTP layer travel alone. A stack's spec is its
    members' behind the layer axis, and the views give each leaf its layer of its stack."""
    cfg = preset("flash")
    paths, leaves, specs = _leaves(cfg, fp8_layout(cfg))
    plan = Stacking.plan(paths, leaves, specs)
    arguments = plan.arguments(leaves)
    assert len(arguments) == len(plan.groups) + len(plan.alone) < len(leaves) // 3  # 322 of 1067
    for group, stack in zip(plan.groups, arguments):
        names = {(_name(paths[i]), paths[i][-1]) for i in group}
        assert len(names) == 1 and next(iter(names))[0] in IN_PLACE
        layers = [paths[i][1] for i in group]
        assert layers == sorted(layers) and stack.shape == (len(group), *leaves[group[0]].shape)
    assert all(stack.size <= MAX_STACK_ELEMENTS for stack in arguments[: len(plan.groups)])
    alone = {(_name(paths[i]), paths[i][-1]) for i in plan.alone}
    assert {("input_norm", "input_norm"), ("attn/kv_b_proj", "kv_b_proj"), ("attn/g_proj", "g_proj")} <= alone
    experts = {(f"mlp/{w}", "q") for w in ("w_gate", "w_up", "w_down")}
    assert {(name, part) for name, part in alone if name in IN_PLACE} == experts
    arg_specs = plan.specs(specs)
    assert all(s == P(None, *specs[g[0]]) for g, s in zip(plan.groups, arg_specs))
    views = plan.views(arguments)
    for g, group in enumerate(plan.groups):
        for j, i in enumerate(group):
            assert isinstance(views[i], LayerOf) and views[i].stack is arguments[g] and views[i].layer == j
            assert views[i].shape == tuple(leaves[i].shape) and views[i].dtype == leaves[i].dtype


def test_a_group_larger_than_the_free_memory_stays_per_layer(caplog):
    """A stack is made beside the leaves it copies: with too little free memory for the KDA layers' in_proj stack
    (1.8 GB) it travels one array a layer, said in the log, and the smaller groups (its scales too) are stacked."""
    cfg = preset("flash")
    paths, leaves, specs = _leaves(cfg, fp8_layout(cfg))
    with caplog.at_level(logging.INFO, logger="lingjax"):
        plan = Stacking.plan(paths, leaves, specs, free=10**9)
    stacked = {(_name(paths[g[0]]), paths[g[0]][-1]) for g in plan.groups}
    assert ("attn/in_proj", "q") not in stacked and {("attn/in_proj", "scale"), ("attn/o_proj", "q")} <= stacked
    assert "kept per layer for want of device memory" in caplog.text and "attn/in_proj (1.8 GB)" in caplog.text


def test_a_stacked_layer_reads_as_its_values():
    """LayerOf is the layer's weight: w[...] and a reshape or a no-op astype stay in place (a kernel reads the
    stack), anything else and np.asarray give the layer's values."""
    stack = jax.random.normal(key_for("stacked_layer"), (3, 4, 6), jnp.float32)
    w = LayerOf(stack, 2)
    assert w[...] is w and w.astype(jnp.float32) is w
    flat = w.reshape(-1, 6)
    assert isinstance(flat, LayerOf) and flat.shape == (4, 6) and flat.stack.shape == (3, 4, 6)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(stack[2]))
    np.testing.assert_array_equal(np.asarray(w.astype(jnp.bfloat16)), np.asarray(stack[2].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(w[1]), np.asarray(stack[2, 1]))


def test_a_model_on_stacks_gives_what_one_with_an_array_per_layer_gives():
    """The same random tiny model with its per-layer parameters stacked and without: fewer program arguments, the
    same logits bit for bit (the XLA references slice what the kernels read in place), and the same parameter
    values through Model.params."""
    cfg = preset("tiny")
    apart = Model(random_model(cfg, jnp.float32, 5), RunOptions(kernels="xla"), stack_layers=False)
    stacked = Model(random_model(cfg, jnp.float32, 5), RunOptions(kernels="xla"))
    assert len(stacked.weights) < len(apart.weights) == apart.stacking.n_leaves == stacked.stacking.n_leaves
    tokens = np.arange(3, 14) % cfg.vocab_size
    got, want = stacked.logits(tokens), apart.logits(tokens)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    for a, b in zip(jax.tree.leaves(apart.params, is_leaf=lambda x: isinstance(x, LayerOf)),
                    jax.tree.leaves(stacked.params, is_leaf=lambda x: isinstance(x, LayerOf))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_kernel_traces_once_for_every_layer_of_a_stack():
    """Each layer's launch of a kernel takes the whole stack and its layer as a value (lingjax.stacked.layer_as_value
    at the kernel's jitted entry; the kernel reads the layer from an input): the entry traces once for all the
    layers (one jaxpr, so one lowering and one compiled kernel), not once a layer, and each layer's output is that
    layer's."""
    from lingjax.kernels import implementation

    stack = jax.random.normal(key_for("stacked_trace"), (3, 64, 32), jnp.float32)
    x = jax.random.normal(key_for("stacked_trace_x"), (1, 32), jnp.float32)
    linear = implementation("linear", pallas=True)

    def layers(s, x):
        return [linear(x, LayerOf(s, i)) for i in range(3)]

    entries = [e for e in jax.make_jaxpr(layers)(stack, x).jaxpr.eqns if e.params.get("name") == "linear"]
    assert len(entries) == 3 and len({id(e.params["jaxpr"]) for e in entries}) == 1
    for i, out in enumerate(jax.jit(layers)(stack, x)):
        want = np.asarray(x, np.float64) @ np.asarray(stack[i], np.float64).T
        assert np.isfinite(np.asarray(out)).all()
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
