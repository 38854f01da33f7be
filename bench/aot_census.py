"""The step programs compiled for an H200 on a machine without a GPU (deviceless AOT): launches counted.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python bench/aot_census.py --model flash --tp 2 --rounds-per-call 4 --out aot.md
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python bench/aot_census.py --model flash18 --tp 1 --weights fp8 \
        --programs prefill                            # a 2048-token prefill chunk: launches, lowering and compile s
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python bench/aot_census.py --model flash --tp 1 --weights fp8 \
        --programs decode prefill --store /tmp/store    # twice: the second run reads the programs back
    python bench/aot_census.py --from-hlo FILE...     # the census of saved optimised HLO; no plugin needed

Needs jax's CUDA 13 plugin, in an environment of its own (`pip install "jax[cuda13]==0.11.2" flax==0.12.10
safetensors`, ~4.6 GB), and no GPU: XLA's GPU compiler and Triton compile the programs for the target description
below (sm_90, 132 SMs), and the plugin's CUDA version checks, which need a driver, are skipped by the environment
variable.

Why: every kernel of a step costs a few µs of latency on the H200 even inside a CUDA graph, so launches per step
are a lever, and device time is scarce. This compiles what step_bench times (the T=1 decode and the speculative
round, with the GPU compiler options of lingjax.execution.step_jit and the Pallas kernels lowered through Triton)
and counts launches as step_bench does (common.launch_summary); it also lists the launches of the ENTRY
computation and loop bodies by kind and by the model's named scope. The weights are abstract (shapes only), so
Flash at any TP compiles on a laptop.

How it makes lingjax take its GPU paths: lingjax.target.compile_for("gpu", the topology's devices) (Pallas not
interpreted, step_jit's compiler options, kernels="auto" -> pallas, the mesh from those devices; abstract weights
stay abstract in sharding.place), and it lowers under an abstract mesh naming the H200 (Pallas reads the target
from it). Not the same as the device: no autotuning, so GEMM tile configs may differ from a real compile; which
ops fuse into which kernels is the compiler's own decision. step_bench --profile saves a device compile's round
HLO, which --from-hlo counts the same way.
"""

from __future__ import annotations

import collections
import gzip
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")  # never touch a local GPU: this is the deviceless path

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's lingjax, in the plugin's environment
from common import (  # noqa: E402
    LAUNCH,
    Report,
    add_options,
    launch_lines,
    launch_summary,
    parser,
    progress,
    tuning_for,
    tuning_label,
    xla_label,
)

H200 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 13 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""


H200_BYTES = 143771 * 2**20  # the H200's memory as nvidia-smi reports it (143771 MiB)


def target_devices(n: int, mem_fraction: float):
    """n H200s of one host, described, not present. XLA's GPU memory limit (for scheduling and rematerialization)
    starts from the compile options' device memory size: on a device jaxlib passes the allocator's limit
    (XLA_PYTHON_CLIENT_MEM_FRACTION of the memory); without one XLA takes 80% of the described memory. So the
    description gets mem_fraction / 0.8 of the memory, and XLA's base equals the device's; otherwise a model that
    nearly fills the device (Flash at TP2) shows rematerialized launches that a device compile does not make."""
    memory = int(H200_BYTES * mem_fraction / 0.8)
    topo = topologies.get_topology_desc(platform="cuda", target_config=H200.replace("{memory}", str(memory)),
                                        topology=f"1x1x{n}")
    return topo.devices


def abstract_mesh(n: int, axis: str):
    from jax._src.mesh import AbstractDevice, AbstractMesh  # Pallas' Triton lowering reads the GPU from it

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    return AbstractMesh((n,), (axis,), axis_types=(AxisType.Auto,), abstract_device=device)


def launches(compiled_text: str):
    """The launches launch_lines finds, each as (kind, scope): kind is the fusion kind, the Pallas kernel's name or
    the op; scope is the model's named scope ("kda_proj", "moe", ...; "" outside the layers) from the launch's
    op_name, with its layer as "layerN_kind"."""
    out = []
    for line in launch_lines(compiled_text):
        m = LAUNCH.search(line)
        op, name = m.group("op"), re.search(r'op_name="([^"]*)"', line)
        name = name.group(1) if name else ""
        if op == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            op = f"fusion {kind.group(1) if kind else '?'}"
        elif op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            target = target.group(1) if target else "?"
            op = f"pallas {name.split('/')[-2]}" if "triton" in target and "/" in name else f"custom-call {target}"
        layer = re.search(r"(layer\d+_\w+?)/(\w+)", name)
        out.append((op, layer.groups() if layer else ("", "")))
    return out


def count_table(say, head: str, counts: collections.Counter) -> None:
    say.table(head, "launches")
    for k, n in counts.most_common():
        say.row(k, n)


def step_model(args):
    """The abstract model on the target's devices (inside target.compile_for), with --kernels and the options."""
    from lingjax import sharding
    from lingjax.config import preset
    from lingjax.execution import CompileOptions
    from lingjax.model import abstract_model, fp8_layout
    from lingjax.runtime import Model, RunOptions

    cfg = preset(args.model)
    options = RunOptions(kernels=args.kernels, tuning=tuning_for(args.kernel_option, cfg, args.tp),
                         compile=CompileOptions(xla_options=tuple(args.xla_option)))
    fp8 = fp8_layout(cfg, args.tp) if args.weights == "fp8" else None
    return Model(abstract_model(cfg, jnp.bfloat16, fp8=fp8), options, mesh=sharding.mesh_for(cfg, args.tp),
                 source=args.model)


def compile_programs(args, devices, say) -> list[tuple[str, str]]:
    """The step programs compiled for `devices` (lingjax.target set to them): [(name, optimised HLO)]."""
    import lingjax.sharding as sharding
    from lingjax import engine, program_store
    from lingjax.sampling import SamplingParams
    from lingjax.spec.step import SpecState, spec_program

    model = step_model(args)
    mesh = model.mesh if model.mesh is not None else jax.sharding.Mesh(np.asarray(devices[:1]), (sharding.AXIS,))

    def typed(tree, specs):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                            tree, specs)

    rep = P()
    weights = typed(model.weights, model.weight_specs)
    cache = typed(jax.eval_shape(lambda: model.new_cache(args.capacity)), model.cache_specs)
    i32 = typed(jax.ShapeDtypeStruct((), jnp.int32), rep)
    key = typed(jax.eval_shape(lambda: jax.random.key(0)), rep)
    sampling = SamplingParams()
    drafter = engine.make_drafter(model, "nextn", args.steps)
    draft = jax.eval_shape(lambda: drafter.init(model.module, args.capacity))
    state = SpecState(cache=cache, draft=typed(draft, jax.tree.map(lambda _: rep, draft)), s=i32, bonus=i32,
                      round=i32, key=key)
    prefill, decode = model.step_programs(sampling, args.rounds_per_call)
    chunk = typed(jax.ShapeDtypeStruct((args.chunk,), jnp.int32), rep)
    programs = {
        "decode": (f"decode T=1, {args.rounds_per_call} per call", decode, (weights, cache, i32, i32, key)),
        "spec": (f"spec round S={args.steps}, {args.rounds_per_call} per call",
                 spec_program(model, drafter, sampling, args.rounds_per_call).round, ((weights, ()), state)),
        "prefill": (f"prefill chunk of {args.chunk}", prefill, (weights, cache, chunk, i32, i32, key)),
    }
    programs = [programs[name] for name in args.programs]

    options = xla_label(model.options.compile.xla_options) + tuning_label(model.options.tuning, model.cfg, model.tp)
    say(f"# aot_census: {args.model}, {args.weights} weights, tp {args.tp}, kernels {model.kernels}{options}, jax "
        f"{jax.__version__}, target "
        f"NVIDIA H200 (deviceless, memory limit as at XLA_PYTHON_CLIENT_MEM_FRACTION={args.mem_fraction})")
    texts = []
    if args.store:
        program_store.enable(args.store)
    for name, fn, fargs in programs:
        progress(f"{name}: compiling")
        t0 = time.perf_counter()
        with jax.sharding.use_abstract_mesh(abstract_mesh(args.tp, sharding.AXIS)):
            fn = fn.prepare(fargs) if args.store else fn  # exported into the store, or read back from it
            lowered = fn.trace(*fargs).lower(lowering_platforms=("cuda",))
        t1 = time.perf_counter()
        text = lowered.compile().as_text()
        say(f"{name}: traced and lowered in {t1 - t0:.1f} s, compiled in {time.perf_counter() - t1:.1f} s (this "
            "host's CPUs)")
        if args.hlo_out:
            Path(args.hlo_out).mkdir(parents=True, exist_ok=True)
            (Path(args.hlo_out) / f"{name.split(',')[0].replace(' ', '_').replace('=', '')}.hlo.txt").write_text(text)
        texts.append((name, text))
    return texts


def census(texts, say) -> None:
    """The launch count of each (name, optimised HLO text), then its launches by kind and by scope."""
    rows = [(name, launch_summary(text), launches(text)) for name, text in texts]
    say()
    say.table("program", "launches (step_bench's count, loop bodies once)")
    for name, n, _ in rows:
        say.row(name, n)
    for name, _, found in rows:
        say()
        say(f"{name}, by kind:")
        say()
        count_table(say, "kind", collections.Counter(op for op, _ in found))
        layers = collections.Counter(layer for _, (layer, _) in found if layer)
        scopes = collections.Counter(f"{layer.split('_', 1)[1]} / {scope}" for _, (layer, scope) in found if layer)
        say()
        say(f"{name}, by scope, summed over {len(layers)} layers ({sum(layers.values())} launches; "
            f"{sum(1 for _, (layer, _) in found if not layer)} outside the layers):")
        say()
        count_table(say, "layer kind / scope", scopes)


def main(argv=None):
    ap = parser(__doc__)
    add_options(ap, "model", "tp", "weights", "xla_option", "kernel_option", "out", model="flash", tp=2)
    ap.add_argument("--programs", nargs="+", default=["decode", "spec"], choices=("decode", "spec", "prefill"),
                    help="the T=1 decode, the NEXTN round, a prefill chunk of --chunk tokens")
    ap.add_argument("--chunk", type=int, default=2048, help="the prefill chunk's tokens")
    ap.add_argument("--store", default=None, metavar="DIR",
                    help="through the program store in DIR (lingjax.program_store): a first run exports the "
                         "programs into it, a second reads them back instead of tracing and lowering them")
    ap.add_argument("--kernels", default="pallas", choices=("pallas", "xla"))
    ap.add_argument("--steps", type=int, default=3, help="NEXTN drafts per round (verify width S+1)")
    ap.add_argument("--rounds-per-call", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=9216, help="cache positions (the serving bench's 8192 + 1024)")
    ap.add_argument("--mem-fraction", type=float, default=0.91,
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION of the run being modelled")
    ap.add_argument("--hlo-out", default=None, help="write each program's optimised HLO here")
    ap.add_argument("--from-hlo", nargs="+", default=None,
                    help="census of these optimised HLO files instead (--hlo-out's, or step_bench --profile's .gz)")
    args = ap.parse_args(argv)
    say = Report(args.out)
    if args.from_hlo:
        say(f"# aot_census of saved HLO: {', '.join(args.from_hlo)}")
        census([(path, (gzip.open(path, "rt") if path.endswith(".gz") else open(path)).read())
                for path in args.from_hlo], say)
        return
    devices = target_devices(args.tp, args.mem_fraction)
    from lingjax import target

    with target.compile_for("gpu", devices):  # lingjax's GPU paths (module docstring)
        texts = compile_programs(args, devices, say)
    census(texts, say)


if __name__ == "__main__":
    main()
