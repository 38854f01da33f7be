"""The loaded model: parameters on device plus the jitted programs that use them (lingjax.load builds one).

The NNX module is split once into (graphdef, params); each jitted program takes the parameters as a
flat tuple of arrays (`Model.weights`) and rebuilds the module inside the trace, so a call walks
neither the object graph nor the nnx Variables in Python (at Flash's ~720 Variables that walk would cost the
host milliseconds a step). The per-layer parameters travel stacked, one array per name across the layers
(lingjax.stacked.Stacking): a call's host cost grows with its argument arrays. Caches are separate pytrees, donated.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from lingjax import kernels as kernel_sets
from lingjax import sharding
from lingjax.cache import ModelCache, init_cache
from lingjax.config import LingConfig
from lingjax.execution import CompileOptions, Exec, Tuning, step_jit_options
from lingjax.memory import HEADROOM, free_bytes
from lingjax.model import Fp8Weight, LingModel, param_count
from lingjax.program_store import StepProgram
from lingjax.requests import check_prompt_ids
from lingjax.sampling import SamplingParams, sample
from lingjax.sharding import path_keys
from lingjax.stacked import Stacking
from lingjax.tokenizer import Tokenizer


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
    same weights that runs differently (an A/B inside one process).

    The module's per-layer parameters are copied into stacks (stack_layers=False: not; lingjax.stacked), so the
    module handed in should not be kept: its arrays are still held until it is dropped."""

    def __init__(self, module: LingModel, options: RunOptions | None = None, *, mesh=None, source: str = "",
                 tokenizer: Tokenizer | None = None, stack_layers: bool = True):
        self.cfg: LingConfig = module.cfg
        self.dtype = module.dtype
        self.has_mtp: bool = module.has_mtp
        # whether matrices are held in fp8 on the device (lingjax.model.Fp8Weight; load(weights=...))
        self.fp8: bool = any(isinstance(m, Fp8Weight) for _, m in nnx.iter_modules(module))
        self._num_params = param_count(module)
        self.source = source
        self.tokenizer = tokenizer  # text <-> ids (lingjax.tokenizer); None: this model takes token ids only
        self.draft = None  # a lingjax.spec.dspark.DSpark beside the target (with_draft), for spec="dspark"
        self.draft_vocab = None  # a lingjax.spec.draft_vocab.DraftVocab the drafters draft over (None: all)
        self.mesh = mesh
        self.tp = 1 if mesh is None else mesh.size
        if mesh is not None:
            sharding.check_tp(self.cfg, self.tp)
        self.graphdef, params = nnx.split(module)
        del module
        param_specs = sharding.param_specs(params)
        self.cache_specs = sharding.cache_spec(jax.eval_shape(lambda: init_cache(self.cfg, 1, self.dtype)))
        if mesh is not None:
            params = sharding.place(params, param_specs, mesh)
        with_paths, self._param_treedef = jax.tree_util.tree_flatten_with_path(params)
        del params
        paths = [path_keys(p) for p, _ in with_paths]
        leaves = [leaf for _, leaf in with_paths]
        del with_paths
        leaf_specs = self._param_treedef.flatten_up_to(param_specs)
        concrete = isinstance(leaves[0], jax.Array)
        free = free_bytes(_device_of(leaves[0])) if concrete else None
        self.stacking = (Stacking.plan(paths, leaves, leaf_specs, None if free is None else int(HEADROOM * free))
                         if stack_layers else Stacking(n_leaves=len(leaves)))
        self.weight_specs = self.stacking.specs(leaf_specs)
        shardings = None
        if mesh is not None:
            shardings = [NamedSharding(mesh, spec) for spec in self.weight_specs[:len(self.stacking.groups)]]
        elif concrete:
            shardings = [SingleDeviceSharding(_device_of(leaves[0]))] * len(self.stacking.groups)
        # what every program takes: the stacks, then the parameters that travel alone; `params` is the structured view
        self.weights = self.stacking.arguments(leaves, shardings)
        del leaves
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
        # what shapes every program of this model besides its arguments (lingjax.program_store.key): the config,
        # dtype, run options, tensor parallelism and the parameters' structure (the programs take them flat)
        self.identity = repr((self.cfg, str(self.dtype), options, self.tp, str(self._param_treedef), self.stacking))
        ps, cs, rep, vocab = self.weight_specs, self.cache_specs, P(), P(None, sharding.AXIS)
        self._extend_logits = jax.jit(self.sharded(self._extend_logits_impl, (ps, cs, rep, rep), (vocab, cs)),
                                      donate_argnums=(1,))
        self._prefill_programs, self._decode_programs = {}, {}
        # programs built elsewhere for this model and options (lingjax.spec.step.spec_program), by what built them
        self.programs: dict = {}
        self.compiled: set = set()  # programs compiled ahead of their first call (lingjax.precompile), by key

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
        other._set_options(self.options)  # programs of its own, which read the drafter
        return other

    def with_draft_vocab(self, vocab) -> Model:
        """This model with the drafters (NEXTN and DSpark) drafting over a draft vocabulary
        (lingjax.spec.draft_vocab.DraftVocab, placed like the lm_head; None: the whole vocabulary): its own
        programs, compiled on first use. The verify keeps the full lm_head, so the output is unchanged."""
        if vocab is not None and vocab.head.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"a draft vocabulary of width {vocab.head.shape[1]} for a model of hidden size "
                             f"{self.cfg.hidden_size}")
        other = copy.copy(self)
        other.draft_vocab = vocab
        other._set_options(self.options)
        return other

    @property
    def kernels(self) -> str:
        """The resolved kernel set, "xla" or "pallas" (RunOptions.kernels)."""
        return self.options.kernels

    @property
    def params(self):
        """The parameters as an nnx.State over the same arrays as `weights`, nothing copied: a stacked layer's
        parameter is a lingjax.stacked.LayerOf (np.asarray or jnp.asarray gives its values). For notebooks and tests."""
        return jax.tree.unflatten(self._param_treedef, self.stacking.views(self.weights))

    @property
    def module(self) -> LingModel:
        """The Flax NNX LingModel over `params` (nothing copied), for notebooks."""
        return nnx.merge(self.graphdef, self.params)

    def step_jit(self, fun, name: str, donate_argnums: tuple[int, ...] = ()) -> StepProgram:
        """fun jitted as a step program (as lingjax.execution.step_jit jits it) that the program store can keep
        (lingjax.program_store): `name` is what sets it apart from this model's other programs (the program and
        its static arguments), to which the model's own identity is added."""
        return StepProgram(fun, f"{self.identity}\n{name}", donate_argnums, step_jit_options(self.options.compile))

    def sharded(self, fun, in_specs, out_specs):
        """fun itself without TP; under TP, fun running on each device's shards (shard_map)."""
        if self.mesh is None:
            return fun
        return jax.shard_map(fun, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def num_params(self) -> int:
        return self._num_params

    def new_cache(self, capacity: int) -> ModelCache:
        cache = init_cache(self.cfg, capacity, self.dtype)
        return sharding.place(cache, self.cache_specs, self.mesh) if self.mesh is not None else self.put(cache)

    def step_programs(self, sampling: SamplingParams, rounds_per_call: int = 1):
        """(prefill, decode) jitted for this sampling (built once, then reused):
        prefill(weights, cache, tokens, start, n_valid, key) -> (token, cache);
        decode(weights, cache, token, pos, key) -> (int32 [rounds_per_call] new tokens, the last of them,
        pos + rounds_per_call, cache): that many T=1 steps in one call (a lax.scan)."""
        ps, cs, rep = self.weight_specs, self.cache_specs, P()
        if sampling not in self._prefill_programs:
            prefill = self.sharded(functools.partial(self._prefill_impl, sampling=sampling),
                                   (ps, cs, rep, rep, rep, rep), (rep, cs))
            self._prefill_programs[sampling] = self.step_jit(prefill, f"prefill {sampling!r}", donate_argnums=(1,))
        if (sampling, rounds_per_call) not in self._decode_programs:
            decode = self.sharded(functools.partial(self._decode_impl, sampling=sampling, steps=rounds_per_call),
                                  (ps, cs, rep, rep, rep), (rep, rep, rep, cs))
            # pos is donated too, so the next pos lands at the same address every call: a new address
            # would make every CUDA graph that reads it re-record (the token stays: the host reads it)
            self._decode_programs[sampling, rounds_per_call] = self.step_jit(
                decode, f"decode {sampling!r} {rounds_per_call}", donate_argnums=(1, 3))
        return self._prefill_programs[sampling], self._decode_programs[sampling, rounds_per_call]

    # ---- program bodies (each sees this device's shards under TP) ------------------------------
    def _module(self, weights) -> LingModel:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._param_treedef, self.stacking.views(weights)))

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


