"""Profile capture and a census of GPU time per category for steady-state steps.

The categories are the write-up's (its NEXTN census on 4 Blackwell GPUs): MoE experts, router and
other small glue kernels, all-reduce, dense GEMM, KDA, MLA attention, and idle. A kernel's category
comes from the named scopes the model puts on its ops (lingjax/model.py): the trace names each GPU
kernel's HLO instruction (`hlo_op`), the optimised HLO maps that instruction to its `op_name`
metadata, and the scope path inside it says which sub-layer launched it.

The profiler perturbs what it measures: it slows the host's launches (on Flash at TP2/TP4 a traced
round took 1.55-1.81x the unprofiled one), so a traced step has gaps a real step does not. `census`
therefore takes the unprofiled step time too and reports both the traced idle and the idle left in
a real step once the kernel time is known (real step − kernel time), the write-up's
profiled-vs-unprofiled calibration. Kernels inside CUDA graphs are traced with the command buffer
as their `hlo_op`, so they are found by their own (fusion) names.

    with capture("/tmp/prof") as trace:
        run_steps(n)
    c = census(load_kernels(trace.path), op_scopes(compiled.as_text()), steps=n, real_step_s=t)
    print(format_census({"pallas": c}))
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import re
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import jax

CATEGORIES = ("MoE experts", "router/glue", "all-reduce", "dense GEMM", "KDA", "MLA attention")
_COLLECTIVE = re.compile(r"all-reduce|allreduce|psum|all-gather|allgather|reduce-scatter|reducescatter|nccl", re.I)
_GEMM = re.compile(r"gemm|gemv|cutlass|xmma|cublas|nvjet|matmul|dot|ynn_fusion|xnn_fusion", re.I)  # XLA:CPU: [xy]nn
_DENSE_SCOPES = {"kda_proj", "kda_gate", "kda_out", "mla_proj", "mla_out", "dense_mlp", "lm_head", "eh_proj"}
_PALLAS = ((re.compile(r"kda_"), "KDA"), (re.compile(r"mla_"), "MLA attention"),
           (re.compile(r"moe_(up|down)"), "MoE experts"), (re.compile(r"moe_(router|align)"), "router/glue"),
           (re.compile(r"linear"), "dense GEMM"),  # lingjax.pallas.linear: the projections and lm_head at T <= 16
           (re.compile(r"gemm\b"), "dense GEMM"))  # lingjax.pallas.gemm, above 16 rows (not XLA's gemm_fusion)
_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name="([^"]*)"')


@dataclasses.dataclass
class Kernel:
    device: int
    start_us: float
    dur_us: float
    name: str
    hlo_op: str
    module: str = ""  # the HLO module that ran it, where the trace says (the CPU's thunks do)


@dataclasses.dataclass
class Census:
    steps: int
    traced_step_us: float  # device 0: first kernel start to last kernel end, per step
    busy_us: float  # device 0: union of kernel intervals, per step
    by_category_us: dict  # device 0: summed kernel time per category, per step
    kernels_per_step: float  # device 0
    real_step_us: float | None = None  # unprofiled, measured separately
    devices: int = 1
    peer_wait_us: float | None = None  # device 0: collective time before the last peer joined, per step
    collective_gap_us: float = 0.0  # device 0: idle (traced) in the gaps just before or after a collective, per step
    top: list = dataclasses.field(default_factory=list)  # device 0: top_kernels' rows, the most time first

    @property
    def traced_idle_us(self) -> float:
        return self.traced_step_us - self.busy_us

    @property
    def real_idle_us(self) -> float | None:
        return None if self.real_step_us is None else max(self.real_step_us - self.busy_us, 0.0)


class _Trace:
    path: Path | None = None


@contextlib.contextmanager
def capture(log_dir: str | Path):
    """jax.profiler trace of the block; afterwards `.path` is the trace file (Chrome JSON, gzipped)."""
    log_dir = Path(log_dir)
    trace = _Trace()
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        yield trace
    files = sorted(log_dir.glob("plugins/profile/*/*.trace.json.gz")) or \
        sorted(log_dir.glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"jax.profiler wrote no trace under {log_dir}")
    trace.path = files[-1]


def _plain(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def op_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its op_name metadata (the jax named-scope path), from optimised HLO text.
    Each name is also entered with '.' and '-' as '_': inside a CUDA graph the trace's hlo_op is
    the command buffer, and only the kernel's own name (the fusion's, so spelled) is left."""
    scopes = {}
    for line in hlo_text.splitlines():
        m = _OP_NAME.match(line)
        if m:
            scopes[m.group(1)] = scopes[_plain(m.group(1))] = m.group(2)
    return scopes


def scope_of(kernel: Kernel, scopes: dict[str, str]) -> str:
    return scopes.get(kernel.hlo_op) or scopes.get(kernel.name) or scopes.get(_plain(kernel.name), "")


def load_kernels(trace_path: str | Path) -> list[Kernel]:
    """GPU kernel (and memcpy) events of every device in a jax.profiler trace. Device processes are
    named '/device:GPU:N'; only their stream threads hold raw kernels (the 'XLA Ops'/'XLA Modules'
    lines are derived copies). A trace without a GPU (XLA:CPU) has the CPU's thunks instead: the host
    events that name an `hlo_op`, each on one of XLA's threads (docs/profile.md)."""
    with gzip.open(trace_path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu = _gpu_kernels(events)
    return gpu if gpu else _cpu_thunks(events)


def _cpu_thunks(events) -> list[Kernel]:
    """XLA:CPU's thunks: host events with an `hlo_op`, on device `device_ordinal`. A thunk that holds others on
    its thread (a loop, a call: its body's thunks run inside its interval) is left out, so time is counted
    once, in its leaves. Thunks of one step run on several threads at once, so their summed time can exceed the
    step's span."""
    by_thread = defaultdict(list)
    for e in events:
        args = e.get("args", {}) if e.get("ph") == "X" else {}
        if "hlo_op" in args:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    kernels = []
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        for e, after in zip(thread, thread[1:] + [None]):
            end = float(e["ts"]) + float(e.get("dur", 0.0))
            if after is not None and float(after["ts"]) < end:
                continue  # a parent: the next thunk on its thread starts inside it
            args = e["args"]
            kernels.append(Kernel(int(args.get("device_ordinal", 0)), float(e["ts"]), float(e.get("dur", 0.0)),
                                  e.get("name", ""), str(args["hlo_op"]), str(args.get("hlo_module", ""))))
    return sorted(kernels, key=lambda k: k.start_us)


def _gpu_kernels(events) -> list[Kernel]:
    devices, streams = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        name = e.get("args", {}).get("name", "")
        if e.get("name") == "process_name" and (m := re.match(r"/device:GPU:(\d+)", name)):
            devices[e["pid"]] = int(m.group(1))
        elif e.get("name") == "thread_name":
            streams[(e["pid"], e["tid"])] = name
    kernels = []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices:
            continue
        if not streams.get((e["pid"], e.get("tid")), "").startswith("Stream"):
            continue
        args = e.get("args", {})
        kernels.append(Kernel(devices[e["pid"]], float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", ""),
                              str(args.get("hlo_op", "")), str(args.get("hlo_module", ""))))
    return kernels


def module_name(hlo_text: str) -> str:
    """The HLO module's name (`HloModule jit__decode_impl, ...` -> 'jit__decode_impl'), '' if none."""
    m = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M)
    return m.group(1) if m else ""


def traced_kernels(fn, *args, device: int = 0) -> list[Kernel]:
    """The GPU kernels of one call fn(*args), run to completion under the profiler, on `device` (a
    temporary trace, removed after)."""
    with tempfile.TemporaryDirectory() as tmp:
        with capture(tmp) as trace:
            jax.block_until_ready(fn(*args))
        return [k for k in load_kernels(trace.path) if k.device == device]


def category(kernel: Kernel, scope: str) -> str:
    text = f"{kernel.name} {kernel.hlo_op}"
    if _COLLECTIVE.search(text):
        return "all-reduce"
    for pattern, cat in _PALLAS:  # Pallas kernels carry their own names, not an HLO instruction's
        if pattern.match(kernel.name):
            return cat
    parts = set(scope.split("/"))
    if parts & {"kda_recurrence", "commit"}:
        return "KDA"
    if parts & {"mla_attention", "mla_cache_write"}:
        return "MLA attention"
    if parts & {"moe_experts", "moe_shared"}:
        return "MoE experts"
    if parts & _DENSE_SCOPES and (_GEMM.search(text) or "->" in scope.rsplit("/", 1)[-1]):  # an einsum's op
        return "dense GEMM"
    return "router/glue"


def _union_us(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def peer_wait_us(kernels: list[Kernel], device: int = 0) -> float | None:
    """Of `device`'s collective kernels' time, the part spent before the last peer started the same
    collective (matched across devices by name and order of occurrence, as every device runs the same
    program): a collective kernel runs until its peers arrive, so its duration mixes waiting with the
    transfer itself. None with fewer than two devices in the trace."""
    devices = sorted({k.device for k in kernels})
    if len(devices) < 2:
        return None
    runs = defaultdict(lambda: defaultdict(list))  # kernel name -> device -> its collectives in time order
    for k in sorted(kernels, key=lambda k: k.start_us):
        if _COLLECTIVE.search(f"{k.name} {k.hlo_op}"):
            runs[k.name][k.device].append(k)
    wait = 0.0
    for per_device in runs.values():
        for i, k in enumerate(per_device.get(device, [])):
            peers = [per_device[d][i].start_us for d in devices if d != device and i < len(per_device[d])]
            if peers:
                wait += min(max(max(peers) - k.start_us, 0.0), k.dur_us)
    return wait


def collective_gap_us(kernels: list[Kernel], device: int = 0) -> float:
    """Of `device`'s idle time in the trace, the gaps that end where a collective kernel starts or start
    where one ends. Each all-reduce left out of the CUDA graphs splits them (lingjax.execution.step_compiler_options),
    and with them inside the gaps stay (the all-reduce kernels as graph nodes): under TP these gaps can hold
    most of a round's idle time, so the census reports them apart (docs/measuring.md)."""
    total, end, ended_collective = 0.0, None, False
    for k in sorted((k for k in kernels if k.device == device), key=lambda k: k.start_us):
        collective = bool(_COLLECTIVE.search(f"{k.name} {k.hlo_op}"))
        if end is not None and k.start_us > end and (collective or ended_collective):
            total += k.start_us - end
        if end is None or k.start_us + k.dur_us >= end:
            end, ended_collective = k.start_us + k.dur_us, collective
    return total


_LAYER_INDEX = re.compile(r"(?<=\blayer)\d+")  # a layer's index in a scope path ("layer7_kda/kda_proj")
_JIT_PREFIX = re.compile(r"^(jit\([^)]*\)/)+")  # the program's own scopes, the same for every kernel of a step
_NAME_SUFFIX = re.compile(r"([._]\d+)+$")  # XLA's numbering of a kernel's copies ("loop_add_fusion_12", "ynn_fusion.3")


def kernel_group(kernel: Kernel, scope: str) -> tuple[str, str]:
    """(kernel name without XLA's copy numbering, scope path with layer indices as '*'): the key under which a
    kernel launched once per layer is counted with its copies in the other layers."""
    return _NAME_SUFFIX.sub("", kernel.name), _LAYER_INDEX.sub("*", _JIT_PREFIX.sub("", scope))


def top_kernels(kernels: list[Kernel], scopes: dict[str, str], steps: int, n: int = 15) -> list[dict]:
    """The `n` kernel groups (kernel_group) with the most time: [{name, scope, category, launches, us}], launches
    and µs per step, the most time first."""
    us, count, cat = defaultdict(float), defaultdict(int), {}
    for k in kernels:
        scope = scope_of(k, scopes)
        key = kernel_group(k, scope)
        us[key] += k.dur_us
        count[key] += 1
        cat.setdefault(key, category(k, scope))
    order = sorted(us, key=lambda key: -us[key])[:n]
    return [dict(name=key[0], scope=key[1], category=cat[key], launches=count[key] / steps, us=us[key] / steps)
            for key in order]


def census(kernels: list[Kernel], scopes: dict[str, str], steps: int, real_step_s: float | None = None,
           device: int = 0, module: str = "", top: int = 15) -> Census:
    """Per-step GPU time by category on `device` over a trace of `steps` back-to-back steps, and the `top` kernel
    groups by time (top_kernels). With `module` (module_name of the program's HLO), kernels that name another HLO
    module (the trace says on the CPU) are left out: host-side copies and conversions around the steps are not the
    step."""
    mine = [k for k in kernels if k.device == device and (not module or k.module in ("", module))]
    if not mine:
        raise ValueError(f"the trace holds no kernels of GPU {device}{f' in {module}' if module else ''} "
                         f"(devices seen: {sorted({k.device for k in kernels})})")
    by = defaultdict(float)
    for k in mine:
        by[category(k, scope_of(k, scopes))] += k.dur_us
    window = max(k.start_us + k.dur_us for k in mine) - min(k.start_us for k in mine)
    busy = _union_us((k.start_us, k.start_us + k.dur_us) for k in mine)
    return Census(steps=steps, traced_step_us=window / steps, busy_us=busy / steps,
                  by_category_us={c: by[c] / steps for c in CATEGORIES}, kernels_per_step=len(mine) / steps,
                  real_step_us=None if real_step_s is None else real_step_s * 1e6,
                  devices=len({k.device for k in kernels}),
                  peer_wait_us=None if (wait := peer_wait_us(kernels, device)) is None else wait / steps,
                  collective_gap_us=collective_gap_us(kernels, device) / steps,
                  top=top_kernels(mine, scopes, steps, top))


def format_census(censuses: dict[str, Census]) -> str:
    """Side-by-side markdown table, one column per labelled census (µs per step, share of the step)."""
    labels = list(censuses)

    def cell(us, c):
        step = c.real_step_us or c.traced_step_us
        return f"{us:.0f} ({100 * us / step:.1f}%)"

    rows = [f"| µs per step (share of real step) | {' | '.join(labels)} |", "|---" * (len(labels) + 1) + "|"]
    for cat in CATEGORIES:
        rows.append(
            f"| {cat} | " + " | ".join(cell(censuses[l].by_category_us[cat], censuses[l]) for l in labels) + " |"
        )
    rows.append("| of the all-reduce time: waiting for a peer (traced) | " + " | ".join(
        cell(c.peer_wait_us, c) if c.peer_wait_us is not None else "—" for c in censuses.values()) + " |")
    rows.append("| idle in the real step (real − kernel time) | " + " | ".join(
        cell(c.real_idle_us, c) if c.real_idle_us is not None else "—" for c in censuses.values()) + " |")
    rows.append("| kernel time (union) | " + " | ".join(f"{c.busy_us:.0f}" for c in censuses.values()) + " |")
    rows.append("| real step (unprofiled) | " + " | ".join(
        f"{c.real_step_us:.0f}" if c.real_step_us else "—" for c in censuses.values()) + " |")
    rows.append("| traced step (profiler on) | " + " | ".join(
        f"{c.traced_step_us:.0f}" for c in censuses.values()) + " |")
    rows.append("| traced / real | " + " | ".join(
        f"{c.traced_step_us / c.real_step_us:.2f}" if c.real_step_us else "—" for c in censuses.values()) + " |")
    rows.append("| idle while traced | " + " | ".join(
        f"{c.traced_idle_us:.0f} ({100 * c.traced_idle_us / c.traced_step_us:.1f}%)" for c in censuses.values()) + " |")
    rows.append("| of it: gaps beside a collective (traced) | " + " | ".join(
        f"{c.collective_gap_us:.0f} ({100 * c.collective_gap_us / c.traced_step_us:.1f}%)" for c in censuses.values())
        + " |")
    rows.append("| kernels per step (traced) | " + " | ".join(
        f"{c.kernels_per_step:.0f}" for c in censuses.values()) + " |")
    return "\n".join(rows)


def format_top(c: Census) -> str:
    """The census's top kernel groups as a markdown table: µs and launches per step, share of the step."""
    step = c.real_step_us or c.traced_step_us
    rows = ["| kernel | scope (layers as *) | category | launches per step | µs per step (share) |",
            "|---|---|---|---|---|"]
    for t in c.top:
        rows.append(f"| {t['name']} | {t['scope'] or '-'} | {t['category']} | {t['launches']:g} | "
                    f"{t['us']:.1f} ({100 * t['us'] / step:.1f}%) |")
    return "\n".join(rows)


def trace_census(launch, hlo_text: str, steps: int, real_step_s: float | None = None,
                 log_dir: str | Path | None = None, keep: str | Path | None = None) -> Census:
    """Trace launch() (which dispatches `steps` steps of the program whose optimised HLO is `hlo_text` and
    returns (start time, its last output)), then take the census of device 0. log_dir: where jax.profiler
    writes its log (XProf's --logdir; a temporary one if None). keep: a file path the raw trace is copied to
    before the census, so a failed census can be redone offline."""
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(tempfile.TemporaryDirectory())
        with capture(log_dir) as trace:
            jax.block_until_ready(launch()[1])
        kernels = load_kernels(trace.path)
        if keep is not None:
            shutil.copy(trace.path, keep)
    return census(kernels, op_scopes(hlo_text), steps, real_step_s, module=module_name(hlo_text))
