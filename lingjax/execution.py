"""How a program runs. Exec: how a traced program runs (the kernel set, each Pallas kernel's tuning, and the
tensor-parallel mesh axis when the program body runs inside shard_map, lingjax/sharding.py), passed down explicitly,
static under jit. CompileOptions and step_jit: how the step programs compile on a GPU (docs/engine.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp

from lingjax import kernels, target


class Tuning(Mapping):
    """An immutable, hashable mapping from op name (lingjax.kernels.OPS) to that kernel's frozen tuning
    dataclass: the ops not named run their kernel's defaults."""

    def __init__(self, items: Mapping | None = None):
        self._items = tuple(sorted(dict(items or {}).items()))
        kernels.check_op_names("tuning", (name for name, _ in self._items))

    def __getitem__(self, name: str):
        return dict(self._items)[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Tuning) and self._items == other._items

    def __repr__(self) -> str:
        return f"Tuning({dict(self._items)!r})"


@dataclasses.dataclass(frozen=True)
class Exec:
    kernels: str = "xla"  # "xla" | "pallas" (resolved: lingjax.kernels.resolve)
    tp_axis: str | None = None  # set inside shard_map: weights and heads are this device's shard
    router_precision: str = "f32"  # "f32" (parity) or "bf16" (a declared rounding change), see ops.moe.route
    xla_ops: frozenset[str] = frozenset()  # ops that run their XLA reference whatever `kernels` says
    tuning: Tuning = Tuning()  # op -> its Pallas kernel's tuning; the others take their kernel's defaults
    # trace-time observer: tap(event, value) is called while tracing, e.g. ("moe_route", experts [T, k]) at each
    # MoE layer that routes outside its expert kernels, ("mla_attention", weights [T, H, L]) at each MLA layer; for
    # measurements (bench/) and lingjax.inspection, never changes a result
    tap: Callable[[str, jax.Array], None] | None = None

    def __post_init__(self):
        if self.kernels not in kernels.KERNELS:
            raise ValueError(f"Exec.kernels must be one of {kernels.KERNELS} (resolved), got {self.kernels!r}")
        if self.router_precision not in ("f32", "bf16"):
            raise ValueError(f"router_precision must be 'f32' or 'bf16', got {self.router_precision!r}")
        object.__setattr__(self, "xla_ops", frozenset(self.xla_ops))
        kernels.check_op_names("xla_ops", self.xla_ops)
        if not isinstance(self.tuning, Tuning):
            object.__setattr__(self, "tuning", Tuning(self.tuning))

    def runs_pallas(self, name: str) -> bool:
        """Whether op `name` runs its Pallas implementation."""
        return self.kernels == "pallas" and name not in self.xla_ops

    def runs_kernel(self, name: str, *args, **kwargs) -> bool:
        """Whether op `name` called with these arguments runs its Pallas kernel (not a GPU's fallback)."""
        return kernels.runs_kernel(name, self.runs_pallas(name), self.tuning.get(name), *args, **kwargs)

    def op(self, name: str) -> Callable:
        """The implementation of op `name` under this kernel set (lingjax.kernels.implementation)."""
        return kernels.implementation(name, self.runs_pallas(name), self.tuning.get(name))

    def observe(self, event: str, value: jax.Array) -> None:
        if self.tap is not None:
            self.tap(event, value)

    def psum(self, x: jax.Array) -> jax.Array:
        """The one all-reduce of a row-parallel sub-layer (identity without TP)."""
        return jax.lax.psum(x, self.tp_axis) if self.tp_axis else x

    def gather_vocab(self, logits: jax.Array) -> jax.Array:
        """Full-vocabulary logits from the vocab-parallel lm_head's shards (identity without TP)."""
        return jax.lax.all_gather(logits, self.tp_axis, axis=-1, tiled=True) if self.tp_axis else logits

    def argmax_vocab(self, logits: jax.Array) -> jax.Array:
        """argmax over the (possibly vocab-sharded) last axis, ties to the lowest id like jnp.argmax."""
        return self.max_argmax_vocab(logits)[1]

    def max_argmax_vocab(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(max f32, argmax int32) over the (possibly vocab-sharded) last axis, ties to the lowest id like
        jnp.argmax; a NaN anywhere makes the max NaN. Under TP, ONE collective: each shard's (max, global id of its
        local argmax) pair, as two f32 (ids below 2^24 are exact), all-gathered; the first shard holding the top
        value wins, and shards hold increasing id ranges. A pmax then a pmin would cost two collectives."""
        local = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        top = jnp.max(logits, axis=-1).astype(jnp.float32)
        if not self.tp_axis:
            return top, local
        shards = jax.lax.axis_size(self.tp_axis)
        if logits.shape[-1] * shards > 1 << 24:
            raise ValueError(f"vocabulary {logits.shape[-1] * shards} too large for f32 ids in argmax_vocab")
        offset = jax.lax.axis_index(self.tp_axis) * logits.shape[-1]
        pair = jnp.stack([top, (local + offset).astype(jnp.float32)], -1)
        pairs = jax.lax.all_gather(pair, self.tp_axis)  # [shards, ..., 2]
        winner = jnp.argmax(pairs[..., 0], axis=0)  # the first maximum: the lowest shard (a NaN wins too)
        best = jnp.take_along_axis(pairs, winner[None, ..., None], axis=0)[0]
        return best[..., 0], best[..., 1].astype(jnp.int32)


COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How the step programs compile on a GPU (step_compiler_options); the defaults are the product's, the
    rest is for A/B measurements (bench/step_bench.py --graph-collectives, --xla-option)."""

    collectives_in_graphs: bool = False  # all-reduces inside the CUDA graphs (otherwise each splits a graph)
    xla_options: tuple[tuple[str, object], ...] = ()  # more XLA debug options, (name, value) pairs

    def __post_init__(self):
        object.__setattr__(self, "xla_options", tuple((str(k), v) for k, v in self.xla_options))


def step_jit(fun, compile_options: CompileOptions = CompileOptions(), **kwargs):
    """jax.jit for a hot step program: on a GPU with step_compiler_options (docs/engine.md says why each is
    set), elsewhere plain jax.jit."""
    return jax.jit(fun, compiler_options=step_jit_options(compile_options), **kwargs)


def step_jit_options(compile_options: CompileOptions = CompileOptions()) -> dict | None:
    """The compiler options step_jit gives a program: step_compiler_options on a GPU, none elsewhere."""
    return step_compiler_options(compile_options) if target.platform() == "gpu" else None


def step_compiler_options(compile_options: CompileOptions = CompileOptions()) -> dict:
    """The GPU compiler options of the step programs: the whole step in CUDA graphs (loops and conditionals
    included; collectives only with collectives_in_graphs), XLA's dot merger off (it would copy weights
    to merge GEMMs of one input), programmatic dependent launch on (every Pallas kernel waits for its
    producers: lingjax.pallas.grid_dependency), XLA's GEMM autotuning off (it picks a GEMM's algorithm by
    timing, program by program, so a decode and a verify could round one shape two ways: row invariance
    needs the choice to follow from the shape), then compile_options.xla_options. Also for a bench that
    compiles its own loop the same way."""
    return {
        "xla_gpu_enable_command_buffer": COMMAND_BUFFERS + (",COLLECTIVES" if compile_options.collectives_in_graphs
                                                            else ""),
        "xla_gpu_graph_min_graph_size": 1,
        "xla_gpu_dot_merger_threshold_mb": 0,
        "xla_gpu_enable_pdl": True,
        "xla_gpu_autotune_level": 0,
        **dict(compile_options.xla_options),
    }
