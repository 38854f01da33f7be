"""What the bench scripts share: the report, timing, byte floors, shapes from the presets, and the command-line
options common to several scripts. Each script imports it from beside itself (`python bench/<script>.py` puts
bench/ first on sys.path); the method behind the floors and timings is docs/measuring.md. jax is imported where it
is used, not here: the parser and the report also serve embedded_bench's `hf` mode, which runs in an interpreter
that has torch and no jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import os
import re
import statistics
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np

from lingjax.config import KDA, MOE, PRESETS, LingConfig, preset


def __getattr__(name: str):
    """BF16 and F32, jax's dtypes, imported on first use (the module docstring says why)."""
    if name in ("BF16", "F32"):
        import jax.numpy as jnp

        return {"BF16": jnp.bfloat16, "F32": jnp.float32}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- the report ---------------------------------------------------------------------------------------
class Report:
    """Prints each line as it comes and, with a path, rewrites that markdown file after every line, so a run cut
    short (a device call's time limit) keeps what it printed. append=True keeps what the file already holds
    (another process's rows) and writes after it; silent=True reports nothing (a process other than the first)."""

    def __init__(self, path: str | None = None, append: bool = False, silent: bool = False):
        self.path, self.lines, self.silent = path, [], silent
        if path and append and Path(path).exists():
            self.lines = Path(path).read_text().splitlines()

    def __call__(self, text: str = "") -> None:
        if self.silent:
            return
        print(text, flush=True)
        self.lines.append(text)
        if self.path:
            Path(self.path).write_text("\n".join(self.lines) + "\n")

    def table(self, *columns: str) -> None:
        """A markdown table's header and rule (after a blank line); its rows follow through row()."""
        if self.lines and self.lines[-1]:
            self()
        self("| " + " | ".join(columns) + " |")
        self("|" + "---|" * len(columns))

    def row(self, *cells) -> None:
        self("| " + " | ".join(str(c) for c in cells) + " |")


def heading(say: Report, title: str) -> None:
    """The report's first lines: its title, then date, device, jax version and the command that ran."""
    import jax

    dev = jax.devices()[0]
    say(f"# {title}")
    say(f"{datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}, {dev.device_kind} "
        f"x{len(jax.devices())} ({jax.default_backend()}), jax {jax.__version__}")
    say(f"command: `python {' '.join(sys.argv)}`")
    say(CACHE_NOTE)


def progress(text: str) -> None:
    """A progress line on stderr (not part of the report)."""
    print(text, file=sys.stderr, flush=True)


# ---- timing -------------------------------------------------------------------------------------------
def median_seconds(fn, *args, reps: int) -> float:
    """Median wall time of fn(*args) to completion, after one untimed call (compilation)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pipelined_seconds(fn, *args, calls: int = 10, reps: int = 5) -> float:
    """Median over `reps` batches of the wall time per call of `calls` calls of fn(*args) dispatched back to back
    with one wait at the end, after one untimed call: the host's dispatch overlaps the device's work, so a call's
    fixed host cost drops out where the device takes longer (median_seconds waits after every call)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def read_bandwidth(elements: int = 2 << 30, warm: int = 10, reps: int = 21) -> float:
    """Read bandwidth in B/s: a bf16 array (4 GiB by default) summed in f32 (a step mostly reads weights), after
    `warm` untimed passes. Its result moves between processes and within one, so a bench that divides by it
    measures it twice and takes the larger (the stricter floor)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((elements,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    for _ in range(warm):
        total(x).block_until_ready()
    return x.nbytes / median_seconds(total, x, reps=reps)


def copy_bandwidth(nbytes: int, dtype=None, reps: int = 7) -> float:
    """Copy bandwidth in B/s (bytes read + written): an array of nbytes (dtype, default bf16) scaled by 1.5."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if dtype is None else dtype
    big = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    return 2 * big.nbytes / median_seconds(jax.jit(lambda a: a * 1.5), big, reps=reps)


def rel(got, want) -> float:
    """max |got - want| / max |want|; inf when got holds a NaN or an infinity."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def run_or_report(run, say, row: str, empty: int, fails: list, name: str):
    """run()'s result; if it raises (a variant that fails to compile), None after printing `row` with the error
    and `empty` empty cells as a table row and adding `name` to fails, so the other variants still run."""
    try:
        return run()
    except Exception as e:
        say(f"{row} failed: {type(e).__name__}: {str(e)[:80]} |" + " |" * empty)
        fails.append(name)
        return None


def floor_row(row: str, us: float, floor_us: float, err: float, ok: bool) -> str:
    """A timed variant's table row: `row` (its leading cells), µs, floor µs, x floor, rel. err (FAIL if not ok)."""
    return f"{row} {us:.2f} | {floor_us:.2f} | {us / floor_us:.2f} | {err:.1e}{'' if ok else ' FAIL'} |"


# ---- shapes from the presets, per device at tensor-parallel size tp -----------------------------------
@dataclasses.dataclass(frozen=True)
class MoEShape:
    d: int  # hidden size
    i: int  # expert width on one device
    e: int  # experts
    shared: int  # the shared expert's width on one device (0: none)
    routing: dict  # route()'s keywords: top_k, n_group, topk_group, scaling, renormalize
    limit: float  # the routed experts' SwiGLU clamp
    shared_limit: float


def moe_shape(cfg: LingConfig, tp: int = 1) -> MoEShape:
    """One device's MoE layer of cfg: experts split by width over tp devices (lingjax/sharding.py), the clamps of
    the first layer that clamps both the routed and the shared experts (or of the last layer)."""
    layer = next((i for i in range(cfg.num_hidden_layers)
                  if cfg.swiglu_limit(i, shared=False) and cfg.swiglu_limit(i, shared=True)), cfg.num_hidden_layers - 1)
    routing = dict(top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                   scaling=cfg.routed_scaling_factor, renormalize=cfg.norm_topk_prob)
    return MoEShape(cfg.hidden_size, cfg.moe_intermediate_size // tp, cfg.num_experts,
                    cfg.shared_intermediate_size // tp, routing, cfg.swiglu_limit(layer, shared=False),
                    cfg.swiglu_limit(layer, shared=True))


@dataclasses.dataclass(frozen=True)
class KDAShape:
    heads: int  # on one device
    dim: int  # K = V, the head dim
    hidden: int  # the model width (x and b_proj)
    conv: int  # the short conv's taps
    safe_gate: bool
    lower_bound: float


def kda_shape(cfg: LingConfig, tp: int = 1) -> KDAShape:
    return KDAShape(cfg.kda_num_heads // tp, cfg.kda_head_dim, cfg.hidden_size, cfg.conv_size, cfg.kda_safe_gate,
                    cfg.kda_lower_bound)


# ---- byte floors ----------------------------------------------------------------------------------------
# An fp8 matrix's bytes per element: one, plus a float32 scale per 128 x 128 block (finer device blocks at TP > 1
# add at most a few scales more: below 0.1%)
FP8_MATRIX_BYTES = 1 + 4 / (128 * 128)


def moe_layer_bytes(shape: MoEShape, distinct: float, itemsize: int = 2, matrix_itemsize: float | None = None
                    ) -> float:
    """One device's bytes of a batch-1 MoE layer: the distinct routed experts and the shared one (gate, up, down)
    at the device's width (matrix_itemsize bytes per element, default itemsize: fp8 weights), and the router
    weight, replicated."""
    matrix = itemsize if matrix_itemsize is None else matrix_itemsize
    return (distinct * 3 * shape.i * shape.d + 3 * shape.shared * shape.d) * matrix + shape.e * shape.d * itemsize


def layer_bytes(cfg: LingConfig, attn: str, mlp: str, distinct: float, width: int, ctx: int, itemsize: int,
                tp: int, matrix_itemsize: float | None = None) -> float:
    """One decoder layer's bytes on one device at batch 1, verify width `width`, `ctx` cached positions: split
    weights count 1/tp, replicated ones (router, MLA kv_a_proj and latent cache) in full. matrix_itemsize: the
    bytes per element of the projection and expert matrices (default itemsize; FP8_MATRIX_BYTES for fp8 weights:
    the router, conv taps, caches and states keep theirs)."""
    matrix = itemsize if matrix_itemsize is None else matrix_itemsize
    d = cfg.hidden_size
    total = 0.0
    if attn == KDA:
        p, h = cfg.kda_dim, cfg.kda_num_heads
        total += ((6 * p * d + h * d) * matrix + 3 * p * cfg.conv_size * 4) / tp
        total += (1 + width) * h * cfg.kda_head_dim**2 * 4 / tp  # state read + one staged write per row
    else:
        nh = cfg.num_heads
        weights = nh * cfg.qk_head_dim * d + nh * 256 * cfg.kv_lora_rank + nh * d + d * nh * cfg.v_head_dim
        total += weights * matrix / tp
        total += cfg.mla_cache_dim * d * matrix + ctx * cfg.mla_cache_dim * itemsize  # kv_a_proj + latent cache
    if mlp == MOE:
        total += moe_layer_bytes(moe_shape(cfg, tp), distinct, itemsize, matrix)  # experts split by width
    else:
        total += 3 * cfg.intermediate_size * d * matrix / tp
    return total


# ---- launches in optimised HLO ---------------------------------------------------------------------------
# an instruction's result shape is one token or a tuple "(s1, s2, ...)": multi-output fusions and custom calls
# (a Pallas kernel with several outputs) have tuple shapes
LAUNCH = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+(?P<op>fusion|custom-call|cublas\S*|all-reduce\S*|all-gather\S*|"
                    r"copy|dot|convolution|gather|scatter|sort|dynamic-update-slice|reduce)\(")
FUSION_BODY = re.compile(r"\sfusion\(.*?calls=(%[\w.\-]+)")


def launch_lines(compiled_text: str) -> list[str]:
    """The launch-like instructions of an optimised HLO module: those of every computation that is not a fusion's
    body (ENTRY, loop and branch bodies, command buffers), a loop body counted once. Fusion bodies are found by the
    fusions' `calls=`, not by name: a GEMM fusion's body is named %gemm_fusion_dot.N_computation, and its dot is
    the fusion's, not a launch of its own."""
    bodies = set(FUSION_BODY.findall(compiled_text))
    out, inside = [], False
    for line in compiled_text.splitlines():
        if line and not line.startswith(" "):
            inside = line.split(" ")[0] in bodies
        elif not inside and LAUNCH.search(line):
            out.append(line)
    return out


def launch_summary(compiled_text: str) -> str:
    """"N" launches, or "N (M remat)" when XLA's rematerialization duplicated M of them (named *.remat) to fit its
    memory limit: the device memory it is given less the program's arguments."""
    lines = launch_lines(compiled_text)
    remat = sum(".remat" in line.split("=")[0] for line in lines)
    return f"{len(lines)} ({remat} remat)" if remat else str(len(lines))


# ---- kernel tuning from the command line -----------------------------------------------------------------
def default_tuning(op: str, cfg: LingConfig | None = None, tp: int = 1):
    """The tuning dataclass op's Pallas kernel runs with when given none: its `tuning` keyword's default, or, for
    the decode's routed experts, which choose their tiles by expert width, that choice at cfg's width on one of
    tp devices; for the experts after routing, which choose theirs by T, a verify's (a tuning given to them
    replaces a prefill chunk's larger blocks too)."""
    from lingjax import kernels

    kernels.check_op_names("a kernel option", [op])
    default = inspect.signature(kernels.OPS[op].kernel()).parameters["tuning"].default
    if default is None and op == "moe_experts":
        from lingjax.pallas.moe_experts import ExpertTuning

        return ExpertTuning()
    if default is None and op == "moe_routed_experts":
        from lingjax.pallas.moe_experts import one_token_tiles

        if cfg is None:
            raise ValueError("moe_routed_experts' default tiles depend on the model's expert width: give its config")
        return one_token_tiles(cfg.moe_intermediate_size // tp)
    if not dataclasses.is_dataclass(default):
        raise ValueError(f"{op}'s kernel has no default tuning to change")
    return default


def typed(value: str):
    """int, float, true/false, or the string given."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def xla_option(text: str) -> tuple[str, object]:
    """xla_NAME=VALUE from the command line (an XLA debug option): VALUE as typed() reads it."""
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("xla_"):
        raise argparse.ArgumentTypeError(f"expected xla_NAME=VALUE, got {text!r}")
    return name, typed(value)


def kernel_option(text: str) -> tuple[str, str, object]:
    """OP:FIELD=VALUE from the command line: a field of op's tuning dataclass (OP in lingjax.kernels.OPS), VALUE as
    typed() reads it."""
    from lingjax import kernels

    op, colon, rest = text.partition(":")
    name, sep, value = rest.partition("=")
    if not colon or not sep or not op or not name:
        raise argparse.ArgumentTypeError(f"expected OP:FIELD=VALUE, got {text!r}")
    if op not in kernels.OPS:
        raise argparse.ArgumentTypeError(f"{op!r} is not an op; ops: {sorted(kernels.OPS)}")
    return op, name, typed(value)


def tuning_for(options, cfg: LingConfig | None = None, tp: int = 1) -> dict:
    """[(op, field, value), ...] (kernel_option's) -> {op: its default tuning (default_tuning) with those fields}."""
    fields: dict[str, dict] = {}
    for op, name, value in options:
        fields.setdefault(op, {})[name] = value
    out = {}
    for op, changes in fields.items():
        base = default_tuning(op, cfg, tp)
        known = {f.name for f in dataclasses.fields(base)}
        if set(changes) - known:
            raise ValueError(f"{op}'s {type(base).__name__} has no field {sorted(set(changes) - known)}; "
                             f"fields: {sorted(known)}")
        out[op] = dataclasses.replace(base, **changes)
    return out


def tuning_label(tuning, cfg: LingConfig | None = None, tp: int = 1) -> str:
    """" OP:FIELD=VALUE ...": the fields of each op's tuning that differ from its default."""
    out = []
    for op, value in dict(tuning).items():
        base = default_tuning(op, cfg, tp)
        out += [f" {op}:{f.name}={getattr(value, f.name)}" for f in dataclasses.fields(value)
                if getattr(value, f.name) != getattr(base, f.name)]
    return "".join(out)


def xla_label(xla_options) -> str:
    """" NAME=VALUE ...": the XLA debug options given."""
    return "".join(f" {name}={value}" for name, value in xla_options)


# ---- the common command-line options ---------------------------------------------------------------------
def _options() -> dict:
    """The common options' argparse keywords, by name (a function: the kernel set's names import jax)."""
    from lingjax import kernels

    return {
        "model": dict(default="mid", help=f"a preset ({', '.join(sorted(PRESETS))}: random weights) or a checkpoint"),
        "tp": dict(type=int, default=1, help="tensor-parallel size (devices)"),
        "kernels": dict(default="auto", choices=kernels.CHOICES,
                        help="auto (lingjax.load's default): Pallas on a GPU, the XLA references elsewhere"),
        "dtype": dict(default="bfloat16", choices=("bfloat16", "float32")),
        "router_precision": dict(default="f32", choices=("f32", "bf16")),
        "weights": dict(default="dense", choices=("dense", "fp8"),
                        help="dense: every weight in the model dtype; fp8: the matrices in fp8 "
                             "(lingjax.load weights=)"),
        "xla_option": dict(type=xla_option, action="append", default=[], metavar="xla_NAME=VALUE",
                           help="an XLA debug option for the programs (repeatable: all at once)"),
        "kernel_option": dict(type=kernel_option, action="append", default=[], metavar="OP:FIELD=VALUE",
                              help="a field of an op's Pallas tuning (lingjax.kernels.OPS; e.g. kda_chain:block_v=16; "
                                   "repeatable: all at once)"),
        "smoke": dict(action="store_true",
                      help="tiny sizes, on any backend (interpret mode off the GPU): a script check"),
        "out": dict(default=None, help="also write the markdown report to this file (rewritten after every line)"),
    }


def add_options(ap: argparse.ArgumentParser, *names: str, many: tuple[str, ...] = (), **defaults):
    """Adds the common options `names` (model, tp, kernels, dtype, router_precision, xla_option, kernel_option, smoke,
    out) to ap; those in `many` take one or more values (a list, run one after another); `defaults` overrides
    their defaults (a list for those in `many`)."""
    for name in names:
        spec = dict(_options()[name])
        if name in many:
            spec["nargs"] = "+"
            spec["default"] = [spec["default"]]
        if name in defaults:
            spec["default"] = defaults[name]
        ap.add_argument("--" + name.replace("_", "-"), **spec)
    return ap


# What the run's compilation cache is, for heading(): set when the command line is parsed (cache_from_args).
CACHE_NOTE = "compilation cache: as the environment sets it"


def cache_from_args(warm) -> str:
    """Benches start from an empty compilation cache, as a new user's first process does (jax keeps XLA's per-fusion
    autotuning results beside its compiled programs, so a warm cache can hide what a cold machine pays:
    docs/measuring.md). warm: None (no persistent cache, whatever JAX_COMPILATION_CACHE_DIR says), True (lingjax's
    cache directory) or a directory -> the note heading() prints."""
    global CACHE_NOTE
    import jax

    from lingjax import compilation_cache

    if warm is None:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        jax.config.update("jax_compilation_cache_dir", None)
        CACHE_NOTE = "compilation cache: none (every program compiled, and autotuned, in this process)"
    else:
        path = compilation_cache.enable(None if warm is True else warm)
        CACHE_NOTE = (f"compilation cache: {path} (--warm-cache: programs and XLA's autotuning of earlier processes "
                      "are reused)")
    return CACHE_NOTE


class _BenchParser(argparse.ArgumentParser):
    """Every bench's parser: --warm-cache, applied as the command line is parsed (where jax is installed: without
    it, as in embedded_bench's `hf` mode, there is no compilation cache to set)."""

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if find_spec("jax") is not None:
            cache_from_args(parsed.warm_cache)
        return parsed


def parser(doc: str) -> argparse.ArgumentParser:
    """An ArgumentParser whose --help prints the script's docstring as written, with --warm-cache."""
    ap = _BenchParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-cache", nargs="?", const=True, default=None, metavar="DIR",
                    help="use the persistent compilation cache (lingjax's directory, or DIR): programs and XLA's "
                         "autotuning results of earlier processes are reused; default: none, as on a new machine")
    return ap


def config_of(model: str) -> LingConfig:
    """A preset's config, or a checkpoint directory's config.json."""
    if model in PRESETS:
        return preset(model)
    return LingConfig.from_file(Path(model) / "config.json")
