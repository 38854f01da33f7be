"""`lingjax.load` and the loaded model: parameters on device plus the jitted programs that use them.

The NNX module is split once into (graphdef, params); each jitted program takes the parameters as a
flat tuple of arrays (`Model.weights`) and rebuilds the module inside the trace, so a call walks
neither the object graph nor the nnx Variables in Python (flattening Flash's 720 Variables cost the
host ~2 ms per step on the H200 machine: bench/results/step_flash_h200x2_2026-11-29.md). Caches are
separate pytrees, donated.
"""

from __future__ import annotations

import functools
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
from lingjax.execution import Exec
from lingjax import kernels as kernel_sets
from lingjax.model import LingModel, abstract_model, draw, param_count
from lingjax.sampling import SamplingParams, sample

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"


def step_jit(fun, collectives_in_graphs: bool = False, xla_options: tuple[tuple[str, object], ...] = (), **kwargs):
    """jax.jit for a hot step program. On GPU the whole step goes into XLA command buffers (CUDA
    graphs), loops and conditionals included: measured on the H200 (bench/results/
    spec_overlap_h200_2026-11-29.md) this cut the host's dispatch of a speculative round from 3.2-4.3
    ms to 2.0 ms, below the device's time, so the run-ahead loop hides it.
    Collectives stay out of the graphs unless collectives_in_graphs, so each all-reduce splits the
    graph (a TP2 Flash round is ~100 graph launches plus ~90 all-reduces per device, and the host
    sets the pace). (On the H200s XLA already runs its own one-shot all-reduce kernel; NCCL's
    symmetric buffers and the explicit collective-kernel flags change nothing:
    bench/results/launch_h200x2_2026-11-30_run2.md.) Putting them inside gained nothing on `mid` at
    TP2, by default or with XLA's collective kernels forced, neither host-bound
    (bench/results/step_flash_h200x2_2026-11-29.md) nor GPU-bound at 4 rounds per call
    (…_2026-11-30.md), nor on Flash at TP2 (round 1% and decode 4% slower; the idle beside each
    all-reduce kernel grows inside the graphs: …_2026-11-30_run5.md), and a Flash TP4 round compiled
    that way did not finish its timing within 2.5 minutes (…_h200x4_2026-11-29.md).
    XLA's dot merger is off: the Flash profile showed it fusing each KDA layer's five projections
    into one GEMM by copying the five weight matrices into a new buffer every step (26 MB a layer,
    0.6 ms of a TP4 round), which at batch 1 costs far more than the launches it saves. Those five
    are now one stacked weight (KDAAttention.in_proj); the flag keeps XLA from doing the same to
    other projections of one input (MLA's q/kv_a/g).
    Programmatic dependent launch is on (Hopper: a kernel may start while the one before it drains, and
    waits in its prologue for that one's results): a mid TP1 round ran 0.9-3.0% faster in three processes,
    decode between 2.5% faster and 1.4% slower (bench/results/pdl_h200_2026-12-01.md). XLA's kernels wait
    by construction; the Pallas kernels wait through lingjax.pallas.grid_dependency. xla_options: more XLA
    debug options for these programs, (name, value) pairs, e.g. ("xla_gpu_experimental_force_split_k", 1),
    to A/B a compiler choice in one process (bench/step_bench.py --xla-option). Elsewhere plain jax.jit."""
    if target.platform() == "gpu":
        kwargs["compiler_options"] = step_compiler_options(collectives_in_graphs, xla_options)
    return jax.jit(fun, **kwargs)


def step_compiler_options(collectives_in_graphs: bool = False, xla_options=()) -> dict:
    """The GPU compiler options of step_jit (see there), for a bench that compiles its own loop the same way."""
    return {
        "xla_gpu_enable_command_buffer": COMMAND_BUFFERS + (",COLLECTIVES" if collectives_in_graphs else ""),
        "xla_gpu_graph_min_graph_size": 1,
        "xla_gpu_dot_merger_threshold_mb": 0,
        "xla_gpu_enable_pdl": True,
        **dict(xla_options),
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
    """A loaded Ling model. `module` is the Flax NNX LingModel (for notebooks); the methods here are
    the jitted entry points the engine uses. With tp > 1 the parameters are sharded over a mesh of
    tp devices (lingjax/sharding.py) and every program body runs inside shard_map.
    xla_ops: names of lingjax.kernels.OPS that run their XLA reference under any kernel set, to A/B one
    kernel inside the whole step (bench/step_bench.py --xla-ops). xla_options: extra XLA debug options
    of the step programs (step_jit). kernel_options: keyword options for ops' Pallas kernels,
    ((op, ((name, value), ...)), ...), to A/B a kernel option inside the whole step (Exec.kernel_options,
    bench/step_bench.py --kernel-option)."""

    def __init__(self, module: LingModel, kernels: str = "auto", source: str = "", tp: int = 1,
                 router_precision: str = "f32", collectives_in_graphs: bool = False, xla_ops: tuple[str, ...] = (),
                 xla_options: tuple[tuple[str, object], ...] = (),
                 kernel_options: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()):
        self.module = module
        self.collectives_in_graphs = collectives_in_graphs  # see step_jit
        self.xla_options = tuple(xla_options)  # see step_jit
        self.cfg: LingConfig = module.cfg
        self.kernels = kernel_sets.resolve(kernels)  # "auto" -> this backend's set
        self.source = source
        self.tp = tp
        self.mesh = sharding.make_mesh(tp) if tp > 1 else None
        if router_precision not in ("f32", "bf16"):
            raise ValueError(f"router_precision must be 'f32' or 'bf16', got {router_precision!r}")
        for what, names in (("xla_ops", set(xla_ops)), ("kernel_options", {op for op, _ in kernel_options})):
            if names - set(kernel_sets.OPS):
                raise ValueError(f"{what} names unknown ops {sorted(names - set(kernel_sets.OPS))}; "
                                 f"ops: {sorted(kernel_sets.OPS)}")
        self.ex = Exec(self.kernels, sharding.AXIS if self.mesh else None, router_precision, tuple(xla_ops),
                       tuple((op, tuple(opts)) for op, opts in kernel_options))
        self.graphdef, params = nnx.split(module)
        param_specs = sharding.param_specs(params)
        self.cache_specs = sharding.cache_spec(jax.eval_shape(lambda: init_cache(self.cfg, 1, self.dtype)))
        if self.mesh is not None:
            sharding.check_tp(self.cfg, tp)
            params = sharding.place(params, param_specs, self.mesh)
        leaves, self._param_treedef = jax.tree.flatten(params)
        self.weights = tuple(leaves)  # what every program takes; `params` is the structured view
        self.weight_specs = tuple(self._param_treedef.flatten_up_to(param_specs))
        ps, cs, rep, vocab = self.weight_specs, self.cache_specs, P(), P(None, sharding.AXIS)
        self._extend_logits = jax.jit(self.sharded(self._extend_logits_impl, (ps, cs, rep, rep), (vocab, cs)),
                                      donate_argnums=(1,))
        self._prefill_programs, self._decode_programs = {}, {}
        self._spec_programs = {}

    @property
    def params(self):
        """The parameters as an nnx.State (the same arrays as `weights`): for notebooks and tests."""
        return jax.tree.unflatten(self._param_treedef, self.weights)

    def step_jit(self, fun, **kwargs):
        return step_jit(fun, self.collectives_in_graphs, self.xla_options, **kwargs)

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
    (shape, dtype, distribution, sharding): a whole-model program took 5 minutes to compile."""
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
    router_precision="bf16" runs the MoE gate GEMV on bf16 operands (the seed's speed-up; a declared
    rounding change, so parity tests keep the default "f32")."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    kernels = kernel_sets.resolve(kernels)  # fails fast, before any weight is read
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
    mesh = None
    if tp > 1:  # every parameter goes straight into its shards
        sharding.check_tp(cfg, tp)
        mesh = sharding.make_mesh(tp)
    if source in PRESETS:
        module = random_model(cfg, jdtype, seed, mesh)
        return Model(module, kernels, source=f"preset:{source}", tp=tp, router_precision=router_precision)
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
    return Model(module, kernels, source=str(directory), tp=tp, router_precision=router_precision)


load.__doc__ = load.__doc__.format(presets=", ".join(sorted(PRESETS)))
