"""Step programs lowered once and read back by later processes, so a warm start neither traces nor lowers them.

A process's first token waits for each step program to be traced (the model's Python run over abstract values), lowered
(jaxpr to StableHLO, the Pallas kernels to Triton IR) and compiled. The persistent compilation cache
(lingjax.compilation_cache) spares a second process the compile only: it still traces and lowers every program to find
the cache key, seconds on a large model. Here a step program compiled ahead of its first call (lingjax.precompile) is
exported once (jax.export: its StableHLO and calling convention, serialized) into the store, under a key of everything
that shapes it; a later process with the same key deserializes it and compiles a thin program that calls it, whose key
the persistent cache already holds, because the first process compiled that same thin program. What the key holds
(`key`): the source of every lingjax module, the jax and jaxlib versions, the platform and its devices' kinds, jax's
settings that change a trace (_TRACE_CONFIG), the program's identity (the model's config, dtype, run options and tensor
parallelism, and the program's own static arguments: StepProgram.identity) and its arguments' structure, shapes, dtypes
and shardings. Any of those changed, the key differs and the program is traced again.

The store is off until `enable(directory)` (lingjax.compilation_cache.enable turns it on beside the compilation
cache, as the CLI does). It keeps the KEEP programs used last. A stored program that cannot be read back (corrupt,
or jax refuses it) is traced again and overwritten; without the `flatbuffers` package (jax.export's serialization)
the store stays off.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from pathlib import Path

import jax

from lingjax import target

_state = {"dir": None, "source": None}
KEEP = 64  # stored programs kept (the most recently used; a few hundred KB to a few MB each)


def enable(directory: str | Path | None) -> Path | None:
    """Keep exported step programs in `directory` (None: off). Returns the directory, or None where it cannot be
    created or jax.export cannot serialize here (no flatbuffers): the store then stays off."""
    if directory is None:
        _state["dir"] = None
        return None
    try:
        import flatbuffers  # noqa: F401  (jax.export's serialization needs it)

        path = Path(directory).expanduser()
        path.mkdir(parents=True, exist_ok=True)
    except (ImportError, OSError):
        _state["dir"] = None
        return None
    _state["dir"] = path
    return path


def directory() -> Path | None:
    """The store's directory, None while it is off."""
    return _state["dir"]


def source_hash() -> str:
    """sha256 of every lingjax module's source (each file's path inside the package and its bytes), once a
    process: a change anywhere in lingjax invalidates every stored program."""
    if _state["source"] is None:
        root = Path(__file__).resolve().parent
        digest = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        _state["source"] = digest.hexdigest()
    return _state["source"]


def _describe(leaf) -> str:
    sharding = getattr(leaf, "sharding", None)
    return f"{leaf.shape}/{leaf.dtype}/{getattr(leaf, 'weak_type', False)}/{sharding!r}"


# jax's settings that change what a trace computes
_TRACE_CONFIG = ("jax_default_matmul_precision", "jax_enable_x64", "jax_default_prng_impl",
                 "jax_threefry_partitionable", "jax_numpy_rank_promotion")


def key(identity: str, args) -> str:
    """The stored program's name for a program of this identity called with `args` (arrays or stand-ins)."""
    import jaxlib

    leaves, tree = jax.tree.flatten(args)
    devices = target.devices()
    parts = [source_hash(), jax.__version__, jaxlib.__version__, target.platform(),
             ",".join(sorted({d.device_kind for d in devices})), str(len(devices)),
             *(f"{name}={getattr(jax.config, name)}" for name in _TRACE_CONFIG), identity, str(tree),
             *map(_describe, leaves)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class StepProgram:
    """A step program: `jitted`, the program body `fun` under jax.jit with these donated arguments and compiler
    options, or, for the arguments it was stored for, the program read back from the store (`prepare`).
    `identity`: what, besides its arguments, shapes the program (the key's part its creator knows). Called like
    `jitted`; every other attribute (trace, lower) is jitted's."""

    def __init__(self, fun, identity: str, donate_argnums: tuple[int, ...] = (), compiler_options=None):
        self.fun, self.identity = fun, identity
        self._donate, self._options = tuple(donate_argnums), compiler_options
        self.jitted = jax.jit(fun, donate_argnums=self._donate, compiler_options=compiler_options)
        self._loaded: dict[tuple, object] = {}  # the arguments' signature -> the program calling the stored one
        self._current = self.jitted  # what a call tries first: the last program that served a call

    def __getattr__(self, name):
        return getattr(self.jitted, name)

    def __call__(self, *args):
        try:
            return self._current(*args)
        except (TypeError, ValueError):
            if self._current is self.jitted or self._for(args) is self._current:
                raise  # not a stored program's argument check: the call's own error
        self._current = self._for(args)
        return self._current(*args)

    def _for(self, args):
        """The program for these arguments: the stored one's caller if loaded for them, else jitted."""
        return self._loaded.get(_signature(args), self.jitted)

    def prepare(self, args) -> object:
        """The program for `args`, traced and lowered from the store when it holds it, else exported into it
        (store off, or a program jax cannot export: jitted itself). The caller compiles what it returns (its
        .trace(*args).lower().compile())."""
        store = directory()
        if store is None:
            return self.jitted
        leaves, in_tree = jax.tree.flatten(args)
        path = store / f"{key(self.identity, args)}.jaxexport"
        stored = _read(path)
        if stored is None:
            try:
                stored = self._export(in_tree, leaves)
                blob = pickle.dumps((stored[0].serialize(), stored[1]))
            except Exception:  # a program jax cannot export or serialize: compiled as it is, as without the store
                return self.jitted
            _write(path, blob)
        exported, out_tree = stored
        kept = frozenset(exported.module_kept_var_idx)

        def call(*args):
            # the arguments the program does not read (the MTP layer's weights in a plain decode) are not passed:
            # zeros in their place, dead in the compiled program, so its executable takes the arguments the step
            # program's own would (host dispatch grows with them)
            leaves = [x if i in kept else _unread(x) for i, x in enumerate(jax.tree.leaves(args))]
            return jax.tree.unflatten(out_tree, exported.call(*leaves))

        caller = jax.jit(call, donate_argnums=self._donate, compiler_options=self._options)
        self._loaded[_signature(args)] = caller
        self._current = caller
        return caller

    def _export(self, in_tree, leaves):
        """(fun exported over the arguments' leaves, its result's pytree structure): exported over flat leaves
        because jax.export serializes only plain containers (the caches are dataclasses, the drafter's params
        dicts with int keys); the structures are pickled beside it."""
        out = {}

        def flat(*leaves):
            result = self.fun(*jax.tree.unflatten(in_tree, leaves))
            flat_result, out["tree"] = jax.tree.flatten(result)
            return flat_result

        flat.__name__ = _name(self.fun)  # jax's logs and lingjax.compile_watch name a program by its function

        exported = jax.export.export(jax.jit(flat), platforms=(_lowering_platform(),),
                                     disabled_checks=_CHECKS)(*leaves)
        return exported, out["tree"]


# the Pallas kernels' custom call (Triton, on the GPU): not among jax.export's stable custom calls, because a
# Triton kernel's IR is tied to the jaxlib that lowered it; the key holds jaxlib's version
_CHECKS = (jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),)


def _unread(x):
    """A stand-in of x's shape and type (zeros; a PRNG key of x's kind) for an argument the program never reads."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, x)
        return jax.random.wrap_key_data(jax.numpy.zeros(data.shape, data.dtype), impl=jax.random.key_impl(x))
    return jax.numpy.zeros(x.shape, x.dtype)


def _name(fun) -> str:
    """A program body's function name (through functools.partial and shard_map's wrapping)."""
    while not hasattr(fun, "__name__") and hasattr(fun, "func"):
        fun = fun.func
    return getattr(fun, "__name__", "step_program")


def _lowering_platform() -> str:
    """jax.export's name for the platform lingjax builds for (lingjax.target): its GPUs are CUDA's."""
    return "cuda" if target.platform() == "gpu" else target.platform()


def _signature(args) -> tuple:
    leaves, tree = jax.tree.flatten(args)
    return (tree, *((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))


def _read(path: Path):
    """(the exported program, its result's structure) stored at path, or None (absent, or unreadable: then traced
    again and overwritten)."""
    try:
        blob, out_tree = pickle.loads(path.read_bytes())
        exported = jax.export.deserialize(bytearray(blob))
        os.utime(path)  # used now: the last to go when the store trims itself
        return exported, out_tree
    except FileNotFoundError:
        return None
    except Exception:  # a truncated or foreign file: the program is traced again and the file replaced
        return None


def _write(path: Path, blob: bytes) -> None:
    """Write blob to path whole or not at all (a temporary file renamed): a reader never sees half a program."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return
    _trim(path.parent)


def _trim(store: Path) -> None:
    """Keep the KEEP most recently used programs (each key is one lingjax source, jax version and argument shape,
    so a long-lived cache directory would otherwise grow with every version and prompt size)."""
    try:
        files = sorted(store.glob("*.jaxexport"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in files[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:  # another process trimming at the same time: its work, not an error
        pass
