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
import logging
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from lingjax import checkpoint, requests, sharding, target
from lingjax.cache import ModelCache, init_cache
from lingjax.config import PRESETS, LingConfig, preset
from lingjax import kernels as kernel_sets
from lingjax.execution import Exec, Tuning
from lingjax.model import Fp8Weight, LingModel, abstract_model, draw, fp8_layout, param_count
from lingjax.ops import fp8 as fp8_ops
from lingjax.quantization import Fp8Layout
from lingjax.sampling import SamplingParams, sample
from lingjax.memory import check_fits
from lingjax.requests import check_prompt_ids
from lingjax.shipped import default_checkpoint, default_draft, is_default_checkpoint
from lingjax.tokenizer import Tokenizer

log = logging.getLogger("lingjax")

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


def _device_of(leaf) -> jax.Device:
    """The device a weight lives on; an abstract weight (ShapeDtypeStruct, for lowering only) has none, so
    the default device stands in."""
    devices = getattr(leaf, "devices", None)
    return next(iter(devices())) if devices is not None else jax.devices()[0]


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

    def __init__(self, module: LingModel, options: RunOptions | None = None, *, mesh=None, source: str = "",
                 tokenizer: Tokenizer | None = None):
        self.module = module
        self.cfg: LingConfig = module.cfg
        self.source = source
        self.tokenizer = tokenizer  # text <-> ids (lingjax.tokenizer); None: this model takes token ids only
        self.draft = None  # a lingjax.spec.dspark.DSpark beside the target (with_draft), for spec="dspark"
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
        self._host_sharding = (NamedSharding(mesh, P()) if mesh is not None
                               else SingleDeviceSharding(_device_of(self.weights[0])))
        self._set_options(options or RunOptions())

    def put(self, tree):
        """Host values (numpy arrays, scalars, keys, fresh caches) onto the programs' devices, committed as the
        programs' outputs are: a program's first call, on host values, and its later calls, on the previous
        call's outputs, then see the same argument placement and compile once."""
        return jax.device_put(tree, self._host_sharding)

    def _set_options(self, options: RunOptions) -> None:
        """Adopt `options` and start with no compiled program."""
        self.options = options
        self.ex = options.exec(sharding.AXIS if self.mesh is not None else None)
        if self.draft is not None:
            self.ex = dataclasses.replace(self.ex, materialize=self.draft.cfg.target_layer_ids)
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

    def with_draft(self, draft) -> Model:
        """This model with a DSpark drafter (lingjax.spec.dspark.DSpark, or None) beside it, its weights placed on
        the programs' devices (replicated under TP): its own programs, compiled on first use."""
        if draft is not None:
            draft.cfg.check_target(self.cfg)
            draft = copy.copy(draft)
            draft.params = self.put(draft.params)
        other = copy.copy(self)
        other.draft = draft
        other._set_options(self.options)  # every program materializes the drafter's feature layers (Exec)
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

    @property
    def fp8(self) -> bool:
        """Whether matrices are held in fp8 on the device (lingjax.model.Fp8Weight; load(weights=...))."""
        return any(isinstance(m, Fp8Weight) for _, m in nnx.iter_modules(self.module))

    def num_params(self) -> int:
        return param_count(self.module)

    def new_cache(self, capacity: int) -> ModelCache:
        cache = init_cache(self.cfg, capacity, self.dtype)
        return sharding.place(cache, self.cache_specs, self.mesh) if self.mesh is not None else self.put(cache)

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
        return module.lm_logits(hidden, ex=self.ex), cache

    def _prefill_impl(self, weights, cache, tokens, start, n_valid, key, sampling: SamplingParams):
        """One prompt chunk -> (token sampled from row n_valid-1, cache)."""
        module = self._module(weights)
        hidden, cache = module.forward(tokens, cache, start, n_valid, self.ex)
        last = jax.lax.dynamic_index_in_dim(hidden, n_valid - 1, keepdims=False)
        return sample(module.lm_logits(last, ex=self.ex), key, sampling, self.ex), cache

    def _decode_impl(self, weights, cache, token, pos, key, sampling: SamplingParams, steps: int):
        """`steps` tokens from position pos on -> ([steps] tokens, the last, pos + steps, cache).
        Everything the next call needs comes back as device values; each step's sampling key is the
        key folded with its position, on device, so any steps per call gives the same tokens."""
        module = self._module(weights)

        def step(carry):
            token, pos, cache = carry
            hidden, cache = module.forward(token[None], cache, pos, 1, self.ex)
            token = sample(module.lm_logits(hidden[0], ex=self.ex), jax.random.fold_in(key, pos), sampling, self.ex)
            return (token, pos + 1, cache), token

        (token, pos, cache), new = steps_in_one_call(step, (token, pos, cache), steps)
        return new, token, pos, cache

    # ---- public -----------------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """One full forward over token_ids with no cache carried over -> float32 [T, vocab]."""
        tokens = check_prompt_ids(token_ids, self.cfg.vocab_size)
        logits, _ = self._extend_logits(self.weights, self.new_cache(tokens.size), *self.put((tokens, np.int32(0))))
        return np.asarray(logits)

    def incremental_logits(self, token_ids, prompt_len: int) -> np.ndarray:
        """Logits of rows prompt_len-1 .. T-1 computed the decode way: one extend over the prompt,
        then one T=1 step per later token against the caches -> float32 [T - prompt_len + 1, vocab].
        Equal to logits(token_ids)[prompt_len-1:] up to rounding (chunked vs recurrent KDA,
        expanded vs absorbed MLA)."""
        tokens = check_prompt_ids(token_ids, self.cfg.vocab_size)
        if not 1 <= prompt_len <= tokens.size:
            raise ValueError(f"prompt_len must be in [1, {tokens.size}], got {prompt_len}")
        cache = self.new_cache(tokens.size)
        logits, cache = self._extend_logits(self.weights, cache, *self.put((tokens[:prompt_len], np.int32(0))))
        rows = [np.asarray(logits[-1])]
        for pos in range(prompt_len, tokens.size):
            logits, cache = self._extend_logits(self.weights, cache, *self.put((tokens[pos : pos + 1], np.int32(pos))))
            rows.append(np.asarray(logits[0]))
        return np.stack(rows)


# Random weights up to HOST_DRAW_BYTES are drawn on the host (numpy: no program to compile, the fastest start
# for the small presets); up to ONE_PROGRAM_DRAW_BYTES in one device program; beyond, by one small program per
# distinct leaf kind, reused across leaves (one program for all of Flash would hold its temporaries at once).
HOST_DRAW_BYTES = 64 << 20
ONE_PROGRAM_DRAW_BYTES = 2 << 30


def random_model(cfg: LingConfig, dtype, seed: int, mesh=None, fp8: Fp8Layout | None = None) -> LingModel:
    """LingModel with random weights, each leaf with the distribution its constructor records
    (lingjax.model.ParamInit) and its own stream (the seed and the leaf's index). Small models are drawn on the
    host and placed; larger ones on the device(s), in one program or leaf by leaf, and with a mesh every
    device draws only its own shards (partitionable threefry), so a model larger than one device, such as
    Flash at TP2, never exists whole anywhere. The weights are a function of (config, dtype, seed): the same
    for any mesh. fp8: the matrices kept in fp8 (lingjax.model.fp8_layout), each drawn in `dtype` and quantized
    in the same program (Flash in fp8 on one H200: no bf16 copy of the model ever exists)."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, fp8=fp8))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    keys = [sharding.path_keys(path) for path, _ in leaves]
    where = {k: i for i, k in enumerate(keys)}
    outs = [None if mesh is None else NamedSharding(mesh, sharding.param_spec(k)) for k in keys]
    # one draw per weight: (leaf indices it fills, shape, draw dtype, distribution, fp8 blocks or None)
    draws = []
    for i, (key, (_, var)) in enumerate(zip(keys, leaves)):
        if var.random == ("fp8_scale",):
            continue
        if jnp.dtype(var.dtype) == jnp.dtype(fp8_ops.FP8):
            scale = leaves[where[key[:-1] + ("scale",)]][1]
            (n, k), (sn, sk) = var.shape[-2:], scale.shape[-2:]
            draws.append(((i, where[key[:-1] + ("scale",)]), var.shape, jnp.dtype(dtype), var.random,
                          (var.fp8_block, (n // sn, k // sk))))
        else:
            draws.append(((i,), var.shape, jnp.dtype(var.dtype), var.random, None))
    arrays = [None] * len(leaves)
    total = sum(int(np.prod(shape)) * dt.itemsize for _, shape, dt, _, _ in draws)
    if total <= HOST_DRAW_BYTES:
        for fills, shape, dt, how, blocks in draws:
            w = host_draw(np.random.default_rng([seed, fills[0]]), shape, dt, how)
            if blocks is None:
                arrays[fills[0]] = w
            else:
                q, scale = fp8_ops.quantize(w, blocks[0])
                arrays[fills[0]], arrays[fills[1]] = q, fp8_ops.refine_scales(scale, shape, *blocks)
        arrays = jax.device_put(arrays, outs if mesh is not None else None)
    else:
        base = jax.random.key(seed)
        programs = [_drawer(shape, dt, how, blocks, tuple(outs[f] for f in fills))
                    for fills, shape, dt, how, blocks in draws]
        if total <= ONE_PROGRAM_DRAW_BYTES:
            def draw_all(key):
                return [p.__wrapped__(jax.random.fold_in(key, d[0][0])) for p, d in zip(programs, draws)]

            shardings = [tuple(outs[f] for f in d[0]) for d in draws] if mesh is not None else None
            drawn = jax.jit(draw_all, out_shardings=shardings)(base)
        else:
            drawn = [p(jax.random.fold_in(base, d[0][0])) for p, d in zip(programs, draws)]
        for (fills, *_), values in zip(draws, drawn):
            for f, v in zip(fills, values):
                arrays[f] = v
    return nnx.merge(graphdef, treedef.unflatten([var.replace(a) for (_, var), a in zip(leaves, arrays)]))


def host_draw(rng: np.random.Generator, shape, dtype, how: tuple) -> np.ndarray:
    """lingjax.model.draw's distributions with numpy: normal(mean, std) or log(uniform(low, high)), f32,
    then rounded to dtype."""
    if how[0] == "normal":
        w = how[1] + how[2] * rng.standard_normal(shape, dtype=np.float32)
    else:
        w = np.log(rng.uniform(how[1], how[2], shape)).astype(np.float32)
    return np.asarray(w, np.float32).astype(dtype)


@functools.lru_cache(maxsize=256)
def _drawer(shape, dtype, how, blocks, out_shardings):
    """The jitted draw of one weight -> a tuple of its leaves: (array,), or for fp8 blocks (quantizer block,
    device block) (q, scale), quantized in the same program (lingjax.model.quantize_matrices' rounding)."""
    def one(key):
        w = draw(key, shape, dtype, how)
        if blocks is None:
            return (w,)
        fp8 = fp8_ops.quantize_on_device(w, blocks[0])
        return fp8.q, fp8_ops.refine_scales_on_device(fp8.scale, shape, *blocks)

    return jax.jit(one, out_shardings=None if out_shardings[0] is None else out_shardings)


def resolve(path_or_preset: str | Path) -> tuple[LingConfig, Path | None]:
    """(config, checkpoint directory) of a preset name (directory None) or a checkpoint directory, read
    without touching a weight: what the CLI checks a request against before loading anything."""
    source = str(path_or_preset)
    if source in PRESETS:
        return preset(source), None
    directory = Path(source)
    if not directory.is_dir():
        raise FileNotFoundError(f"{source!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory")
    if not (directory / "config.json").exists():
        raise checkpoint.CheckpointError(f"{directory}: no config.json")
    return LingConfig.from_file(directory / "config.json"), directory


def source_tokenizer(cfg: LingConfig, directory: Path | None, name: str) -> Tokenizer | None:
    """The tokenizer a model source carries: a checkpoint's own files (None, said once, when it has no
    tokenizer.json), or the byte-level tokenizer of a preset."""
    if directory is None:
        return Tokenizer.byte_level(cfg, source=f"byte-level, preset {name}")
    tokenizer = Tokenizer.from_dir(directory, cfg)
    if tokenizer is None:
        log.warning("lingjax: %s has no tokenizer.json: token ids in and out only", directory)
    return tokenizer


def weights_layout(cfg: LingConfig, directory: Path | None, weights: str, tp: int) -> Fp8Layout | None:
    """The fp8 layout load(weights=...) makes for a source, as lingjax would quantize it (an fp8 checkpoint's own
    list of quantized tensors is read as it loads; this estimate serves the memory check): None for dense."""
    if weights not in checkpoint.WEIGHTS:
        raise ValueError(f"weights must be one of {checkpoint.WEIGHTS}, got {weights!r}")
    if weights == "fp8" and directory is not None and checkpoint.is_orbax(directory):
        raise ValueError(f"{directory} is a lingjax (orbax) checkpoint, which loads dense; give its official "
                         "safetensors form (or its `lingjax convert --fp8` copy) for fp8 weights")
    stored_fp8 = directory is not None and checkpoint.read_fp8_config(directory) is not None
    return fp8_layout(cfg, tp) if weights == "fp8" or (weights == "auto" and stored_fp8) else None


_OWN = object()  # load(tokenizer=...) default: the source's own tokenizer


def load_draft(draft, cfg: LingConfig, dtype: str, shipped: bool):
    """load's `draft` argument -> a lingjax.spec.dspark.DSpark or None (see load)."""
    from lingjax.spec import dspark

    if draft is None or isinstance(draft, dspark.DSpark):
        return draft
    if draft == "auto":
        directory = default_draft() if shipped else None
        return dspark.load_dspark(directory, dtype, cfg) if directory is not None else None
    if draft == "random":
        return dspark.random_dspark(dspark.default_config(cfg), dtype)
    return dspark.load_dspark(draft, dtype, cfg)


def load(path_or_preset: str | Path | None = None, dtype: str = "bfloat16", kernels: str = "auto", seed: int = 0,
         progress=None, tp: int = 1, router_precision: str = "f32", tokenizer=_OWN, weights: str = "auto",
         draft="auto") -> Model:
    """Load a model: the shipped code model (no argument: lingjax.shipped), a preset name (random weights:
    {presets}), a directory in the official
    safetensors layout, or a lingjax (orbax) checkpoint written by `lingjax convert`. tp > 1 shards
    it over that many devices (safetensors stream each tensor straight into its shards).
    kernels: "auto" (Pallas on a GPU, the XLA references elsewhere), "pallas" or "xla".
    router_precision="bf16" runs the MoE gate GEMV on bf16 operands (faster; a declared rounding
    change, so parity tests keep the default "f32"). tokenizer: a lingjax.Tokenizer (or None) in place of
    the source's own. weights: "auto" keeps what a checkpoint stores in fp8 in fp8 on the device (docs/fp8.md),
    "fp8" quantizes every other matrix too (a preset's random weights, a bf16 checkpoint as it loads), "dense"
    holds everything in `dtype`. draft: the DSpark drafter for spec="dspark" (Model.draft): "auto" (the shipped
    model's own drafter with the shipped model, loaded by default or by its path; none otherwise), a draft
    checkpoint directory, "random" (a random drafter shaped for the model, lingjax.spec.dspark.default_config: for
    timing rounds), or None. Every argument is checked, and the model's size against the free device memory,
    before any weight is drawn or read."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    options = RunOptions(kernels=kernels, router_precision=router_precision)
    seed = requests.check_seed(seed)
    jdtype = DTYPES[dtype]
    if path_or_preset is None:
        path_or_preset = default_checkpoint()
    shipped = is_default_checkpoint(path_or_preset)
    source = str(path_or_preset)
    cfg, directory = resolve(source)
    mesh = sharding.mesh_for(cfg, tp)  # every parameter goes straight into its shards
    fp8 = weights_layout(cfg, directory, weights, tp)
    check_fits(cfg, jdtype, tp, source, fp8=fp8)
    if tokenizer is _OWN:
        tokenizer = source_tokenizer(cfg, directory, source)  # read before the weights: a bad file fails fast
    drafter = load_draft(draft, cfg, dtype, shipped)  # small: read before the target, so a bad one fails fast
    if directory is None:
        return Model(random_model(cfg, jdtype, seed, mesh, fp8=fp8), options, mesh=mesh, source=f"preset:{source}",
                     tokenizer=tokenizer).with_draft(drafter)
    sharding_for = place = None
    if mesh is not None:

        def sharding_for(path):
            return NamedSharding(mesh, sharding.param_spec(path))

        def place(path, array):
            return jax.device_put(array, sharding_for(path))

    if checkpoint.is_orbax(directory):
        module = checkpoint.load_orbax(directory, cfg, jdtype, sharding_for=sharding_for)
    else:
        module = checkpoint.load_safetensors(directory, cfg, jdtype, place=place, progress=progress, weights=weights,
                                             tp=tp)
    return Model(module, options, mesh=mesh, source=str(directory), tokenizer=tokenizer).with_draft(drafter)


load.__doc__ = load.__doc__.format(presets=", ".join(sorted(PRESETS)))
