"""`lingjax.load` and the loaded model: parameters on device plus the jitted programs that use them.

The NNX module is split once into (graphdef, params); each jitted program takes the parameters as a
flat tuple of arrays (`Model.weights`) and rebuilds the module inside the trace, so a call walks
neither the object graph nor the nnx Variables in Python (at Flash's ~720 Variables that walk would cost the
host milliseconds a step). Caches are separate pytrees, donated.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lingjax import checkpoint, sharding, target
from lingjax.cache import ModelCache, init_cache
from lingjax.config import PRESETS, LingConfig, preset
from lingjax import kernels as kernel_sets
from lingjax.execution import Exec, Tuning
from lingjax.model import LingModel, abstract_model, draw, param_count
from lingjax.sampling import SamplingParams, sample

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How the step programs compile on a GPU (step_compiler_options); the defaults are the product's, the
    rest is for A/B measurements (bench/step_bench.py --graph-collectives, --xla-option)."""

    collectives_in_graphs: bool = False  # all-reduces inside the CUDA graphs (otherwise each splits a graph)
    xla_options: tuple[tuple[str, object], ...] = ()  # more XLA debug options, (name, value) pairs

    def __post_init__(self):
        object.__setattr__(self, "xla_options", tuple((str(k), v) for k, v in self.xla_options))


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a Model runs: `kernels` ("auto" resolves here, once: Pallas on a GPU, XLA elsewhere) and
    `router_precision` are lingjax.load's; `xla_ops` (ops that run their XLA reference under any kernel set),
    `tuning` (op -> its Pallas kernel's tuning dataclass) and `compile` are for A/B measurements of one kernel,
    tile or compiler option inside the whole step (bench/), through Model.variant."""

    kernels: str = "auto"
    router_precision: str = "f32"
    xla_ops: tuple[str, ...] = ()
    tuning: Mapping = dataclasses.field(default_factory=dict)
    compile: CompileOptions = CompileOptions()

    def __post_init__(self):
        object.__setattr__(self, "kernels", kernel_sets.resolve(self.kernels))
        object.__setattr__(self, "xla_ops", tuple(sorted(set(self.xla_ops))))
        object.__setattr__(self, "tuning", Tuning(self.tuning))
        self.exec()  # every other check, before any program is built

    def exec(self, tp_axis: str | None = None) -> Exec:
        return Exec(self.kernels, tp_axis, self.router_precision, frozenset(self.xla_ops), self.tuning)


def step_jit(fun, compile_options: CompileOptions = CompileOptions(), **kwargs):
    """jax.jit for a hot step program: on a GPU with step_compiler_options (docs/engine.md says why each is
    set), elsewhere plain jax.jit."""
    if target.platform() == "gpu":
        kwargs["compiler_options"] = step_compiler_options(compile_options)
    return jax.jit(fun, **kwargs)


def step_compiler_options(compile_options: CompileOptions = CompileOptions()) -> dict:
    """The GPU compiler options of the step programs: the whole step in CUDA graphs (loops and conditionals
    included; collectives only with collectives_in_graphs), XLA's dot merger off (it would copy weights
    to merge GEMMs of one input), programmatic dependent launch on (every Pallas kernel waits for its
    producers: lingjax.pallas.grid_dependency), then compile_options.xla_options. Also for a bench that
    compiles its own loop the same way."""
    return {
        "xla_gpu_enable_command_buffer": COMMAND_BUFFERS + (",COLLECTIVES" if compile_options.collectives_in_graphs
                                                            else ""),
        "xla_gpu_graph_min_graph_size": 1,
        "xla_gpu_dot_merger_threshold_mb": 0,
        "xla_gpu_enable_pdl": True,
        **dict(compile_options.xla_options),
    }


def check_rounds_per_call(n: int) -> int:
    """The one validity check of a rounds_per_call, before any program is built."""
    if n < 1:
        raise ValueError(f"rounds_per_call must be >= 1, got {n}")
    return n


def steps_in_one_call(step, carry, n: int):
    """n applications of step(carry) -> (carry, out) inside one program (rounds_per_call): (the last
    carry, the outputs stacked [n, ...]). A lax.scan; n == 1 runs the step once, without a loop."""
    if n == 1:
        carry, out = step(carry)
        return carry, jax.tree.map(lambda a: a[None], out)
    return jax.lax.scan(lambda c, _: step(c), carry, length=n)


class Model:
    """A loaded Ling model. `module` is the Flax NNX LingModel (for notebooks); the methods here are the jitted
    entry points the engine uses. With a mesh the parameters are sharded over its devices (lingjax/sharding.py)
    and every program body runs inside shard_map. lingjax.load builds one; `variant` derives another over the
    same weights that runs differently (an A/B inside one process)."""

    def __init__(self, module: LingModel, options: RunOptions | None = None, *, mesh=None, source: str = ""):
        self.module = module
        self.cfg: LingConfig = module.cfg
        self.source = source
        self.mesh = mesh
        self.tp = 1 if mesh is None else mesh.size
        if mesh is not None:
            sharding.check_tp(self.cfg, self.tp)
        self.graphdef, params = nnx.split(module)
        param_specs = sharding.param_specs(params)
        self.cache_specs = sharding.cache_spec(jax.eval_shape(lambda: init_cache(self.cfg, 1, self.dtype)))
        if mesh is not None:
            params = sharding.place(params, param_specs, mesh)
        leaves, self._param_treedef = jax.tree.flatten(params)
        self.weights = tuple(leaves)  # what every program takes; `params` is the structured view
        self.weight_specs = tuple(self._param_treedef.flatten_up_to(param_specs))
        self._set_options(options or RunOptions())

    def _set_options(self, options: RunOptions) -> None:
        """Adopt `options` and start with no compiled program."""
        self.options = options
        self.ex = options.exec(sharding.AXIS if self.mesh is not None else None)
        ps, cs, rep, vocab = self.weight_specs, self.cache_specs, P(), P(None, sharding.AXIS)
        self._extend_logits = jax.jit(self.sharded(self._extend_logits_impl, (ps, cs, rep, rep), (vocab, cs)),
                                      donate_argnums=(1,))
        self._prefill_programs, self._decode_programs, self._spec_programs = {}, {}, {}

    def variant(self, **changes) -> Model:
        """This model's weights, mesh and source with RunOptions fields changed (kernels, router_precision,
        xla_ops, tuning, compile): its own programs, compiled on first use."""
        other = copy.copy(self)
        other._set_options(dataclasses.replace(self.options, **changes))
        return other

    @property
    def kernels(self) -> str:
        """The resolved kernel set, "xla" or "pallas" (RunOptions.kernels)."""
        return self.options.kernels

    @property
    def params(self):
        """The parameters as an nnx.State (the same arrays as `weights`): for notebooks and tests."""
        return jax.tree.unflatten(self._param_treedef, self.weights)

    def step_jit(self, fun, **kwargs):
        return step_jit(fun, self.options.compile, **kwargs)

    def sharded(self, fun, in_specs, out_specs):
        """fun itself without TP; under TP, fun running on each device's shards (shard_map)."""
        if self.mesh is None:
            return fun
        return jax.shard_map(fun, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    @property
    def dtype(self):
        return self.module.dtype

    @property
    def has_mtp(self) -> bool:
        return self.module.has_mtp

    def num_params(self) -> int:
        return param_count(self.module)

    def new_cache(self, capacity: int) -> ModelCache:
        cache = init_cache(self.cfg, capacity, self.dtype)
        return sharding.place(cache, self.cache_specs, self.mesh) if self.mesh is not None else cache

    def step_programs(self, sampling: SamplingParams, rounds_per_call: int = 1):
        """(prefill, decode) jitted for this sampling (built once, then reused):
        prefill(weights, cache, tokens, start, n_valid, key) -> (token, cache);
        decode(weights, cache, token, pos, key) -> (int32 [rounds_per_call] new tokens, the last of them,
        pos + rounds_per_call, cache): that many T=1 steps in one call (a lax.scan)."""
        check_rounds_per_call(rounds_per_call)
        ps, cs, rep = self.weight_specs, self.cache_specs, P()
        if sampling not in self._prefill_programs:
            prefill = self.sharded(functools.partial(self._prefill_impl, sampling=sampling),
                                   (ps, cs, rep, rep, rep, rep), (rep, cs))
            self._prefill_programs[sampling] = self.step_jit(prefill, donate_argnums=(1,))
        if (sampling, rounds_per_call) not in self._decode_programs:
            decode = self.sharded(functools.partial(self._decode_impl, sampling=sampling, steps=rounds_per_call),
                                  (ps, cs, rep, rep, rep), (rep, rep, rep, cs))
            # pos is donated too, so the next pos lands at the same address every call: a new address
            # would make every CUDA graph that reads it re-record (the token stays: the host reads it)
            self._decode_programs[sampling, rounds_per_call] = self.step_jit(decode, donate_argnums=(1, 3))
        return self._prefill_programs[sampling], self._decode_programs[sampling, rounds_per_call]

    def spec_program(self, drafter, sampling: SamplingParams, rounds_per_call: int = 1):
        """The jitted speculative prefill/rounds for this drafter, sampling and rounds per call
        (built once, then reused)."""
        from lingjax.spec.step import SpecProgram

        key = (drafter, sampling, rounds_per_call)
        if key not in self._spec_programs:
            self._spec_programs[key] = SpecProgram(self, drafter, sampling, rounds_per_call)
        return self._spec_programs[key]

    # ---- program bodies (each sees this device's shards under TP) ------------------------------
    def _module(self, weights) -> LingModel:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._param_treedef, weights))

    def _extend_logits_impl(self, weights, cache, tokens, start):
        module = self._module(weights)
        hidden, cache = module.forward(tokens, cache, start, tokens.shape[0], self.ex)
        return module.lm_logits(hidden), cache

    def _prefill_impl(self, weights, cache, tokens, start, n_valid, key, sampling: SamplingParams):
        """One prompt chunk -> (token sampled from row n_valid-1, cache)."""
        module = self._module(weights)
        hidden, cache = module.forward(tokens, cache, start, n_valid, self.ex)
        last = jax.lax.dynamic_index_in_dim(hidden, n_valid - 1, keepdims=False)
        return sample(module.lm_logits(last), key, sampling, self.ex), cache

    def _decode_impl(self, weights, cache, token, pos, key, sampling: SamplingParams, steps: int):
        """`steps` tokens from position pos on -> ([steps] tokens, the last, pos + steps, cache).
        Everything the next call needs comes back as device values; each step's sampling key is the
        key folded with its position, on device, so any steps per call gives the same tokens."""
        module = self._module(weights)

        def step(carry):
            token, pos, cache = carry
            hidden, cache = module.forward(token[None], cache, pos, 1, self.ex)
            token = sample(module.lm_logits(hidden[0]), jax.random.fold_in(key, pos), sampling, self.ex)
            return (token, pos + 1, cache), token

        (token, pos, cache), new = steps_in_one_call(step, (token, pos, cache), steps)
        return new, token, pos, cache

    # ---- public -----------------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """One full forward over token_ids with no cache carried over -> float32 [T, vocab]."""
        tokens = jnp.asarray(np.asarray(token_ids, dtype=np.int32).reshape(-1))
        if tokens.shape[0] == 0:
            raise ValueError("token_ids is empty")
        _check_ids(tokens, self.cfg.vocab_size)
        logits, _ = self._extend_logits(self.weights, self.new_cache(tokens.shape[0]), tokens, jnp.int32(0))
        return np.asarray(logits)

    def incremental_logits(self, token_ids, prompt_len: int) -> np.ndarray:
        """Logits of rows prompt_len-1 .. T-1 computed the decode way: one extend over the prompt,
        then one T=1 step per later token against the caches -> float32 [T - prompt_len + 1, vocab].
        Equal to logits(token_ids)[prompt_len-1:] up to rounding (chunked vs recurrent KDA,
        expanded vs absorbed MLA)."""
        tokens = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if not 1 <= prompt_len <= tokens.size:
            raise ValueError(f"prompt_len must be in [1, {tokens.size}], got {prompt_len}")
        _check_ids(tokens, self.cfg.vocab_size)
        cache = self.new_cache(max(tokens.size, 1))
        logits, cache = self._extend_logits(self.weights, cache, jnp.asarray(tokens[:prompt_len]), jnp.int32(0))
        rows = [np.asarray(logits[-1])]
        for pos in range(prompt_len, tokens.size):
            logits, cache = self._extend_logits(self.weights, cache, jnp.asarray(tokens[pos : pos + 1]), jnp.int32(pos))
            rows.append(np.asarray(logits[0]))
        return np.stack(rows)


def _check_ids(tokens, vocab: int) -> None:
    bad = np.asarray(tokens)
    bad = bad[(bad < 0) | (bad >= vocab)]
    if bad.size:
        raise ValueError(f"token ids {bad[:5].tolist()} are outside the vocabulary [0, {vocab})")


def random_model(cfg: LingConfig, dtype, seed: int, mesh=None) -> LingModel:
    """LingModel with random weights drawn on the device(s), leaf by leaf, each with the distribution
    its constructor records (lingjax.model._Init). With a mesh every device draws only its own
    shards (partitionable threefry: the same weights for any mesh), so a model larger than one
    device, such as Flash at TP2, never exists whole anywhere. One small program per distinct
    (shape, dtype, distribution, sharding), each compiled once."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    base = jax.random.key(seed)

    def make(i, path, var):
        spec = sharding.param_spec(sharding.path_keys(path))
        out = None if mesh is None else NamedSharding(mesh, spec)
        return var.replace(_drawer(var.shape, jnp.dtype(var.dtype), var.random, out)(jax.random.fold_in(base, i)))

    return nnx.merge(graphdef, treedef.unflatten([make(i, path, var) for i, (path, var) in enumerate(leaves)]))


@functools.lru_cache(maxsize=256)
def _drawer(shape, dtype, how, out_sharding):
    return jax.jit(functools.partial(draw, shape=shape, dtype=dtype, how=how), out_shardings=out_sharding)


def load(path_or_preset: str | Path, dtype: str = "bfloat16", kernels: str = "auto", seed: int = 0,
         progress=None, tp: int = 1, router_precision: str = "f32") -> Model:
    """Load a model: a preset name (random weights: {presets}), a directory in the official
    safetensors layout, or a lingjax (orbax) checkpoint written by `lingjax convert`. tp > 1 shards
    it over that many devices (safetensors stream each tensor straight into its shards).
    kernels: "auto" (Pallas on a GPU, the XLA references elsewhere), "pallas" or "xla".
    router_precision="bf16" runs the MoE gate GEMV on bf16 operands (faster; a declared rounding
    change, so parity tests keep the default "f32"). Every argument is checked before any weight is read."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    options = RunOptions(kernels=kernels, router_precision=router_precision)
    jdtype = DTYPES[dtype]
    source = str(path_or_preset)
    directory = Path(source)
    if source in PRESETS:
        cfg = preset(source)
    elif not directory.is_dir():
        raise FileNotFoundError(f"{source!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory")
    elif not (directory / "config.json").exists():
        raise checkpoint.CheckpointError(f"{directory}: no config.json")
    else:
        cfg = LingConfig.from_file(directory / "config.json")
    mesh = sharding.mesh_for(cfg, tp)  # every parameter goes straight into its shards
    if source in PRESETS:
        return Model(random_model(cfg, jdtype, seed, mesh), options, mesh=mesh, source=f"preset:{source}")
    sharding_for = place = None
    if mesh is not None:

        def sharding_for(path):
            return NamedSharding(mesh, sharding.param_spec(path))

        def place(path, array):
            return jax.device_put(array, sharding_for(path))

    if checkpoint.is_orbax(directory):
        module = checkpoint.load_orbax(directory, cfg, jdtype, sharding_for=sharding_for)
    else:
        module = checkpoint.load_safetensors(directory, cfg, jdtype, place=place, progress=progress)
    return Model(module, options, mesh=mesh, source=str(directory))


load.__doc__ = load.__doc__.format(presets=", ".join(sorted(PRESETS)))
