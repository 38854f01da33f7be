"""`lingjax profile`: a jax.profiler trace of steady-state steps and its census; `lingjax profile compare`.

    lingjax profile                                      # the shipped model's decode step
    lingjax profile --program nextn --steps 3 --out prof/decode
    lingjax profile --model mid --program dspark --kernels pallas --tp 2 --out prof/mid
    lingjax profile compare prof/a prof/b                # two saved censuses side by side
    lingjax profile compare --kernels xla pallas         # two kernel sets, run in one command
    lingjax profile compare --weights dense fp8          # bf16 against fp8 weights
    lingjax profile compare --revs df9e41e HEAD          # two git revisions, each in its own worktree

The request is checked before a weight is read; then the program is compiled, its unprofiled step timed (N steps
back to back, the median of 3 runs), and N more traced. The census (lingjax.profiling) sorts the trace's kernels
(on a CPU: XLA's thunks) into the write-up's categories by the named scopes the model puts on its ops
(docs/profile.md). This module imports no jax until a command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lingjax import cli
from lingjax.config import DEFAULT_STEPS

PROGRAMS = ("decode", "nextn", "dspark", "prefill")  # lingjax.steady.PROGRAMS (not imported: no jax before a command)


def _add_common(p: argparse.ArgumentParser, *, pairs: bool) -> None:
    cli._add_model_args(p)
    p.add_argument("--program", choices=PROGRAMS, default="decode",
                   help="decode: the T=1 step; nextn: a NEXTN (MTP chain) round; dspark: a DSpark round; prefill: "
                        "one prompt chunk of --prompt-len tokens")
    p.add_argument("--steps", type=int, default=None,
                   help=f"drafts per round (nextn: default {DEFAULT_STEPS}; dspark: the drafter's block size)")
    p.add_argument("--n", type=int, default=10, help="steady-state steps timed and traced")
    p.add_argument("--prompt-len", type=int, default=32,
                   help="prompt tokens (random ids) before the steps; --program prefill: the chunk's tokens")
    p.add_argument("--start", type=int, default=0,
                   help="--program prefill: the chunk's first position, as a later chunk of a longer prompt (the "
                        "cache sized as the engine sizes it for a prompt ending with the chunk)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights and activations")
    p.add_argument("--router-precision", choices=["f32", "bf16"], default="f32", help="MoE gate GEMV operands")
    kernels = dict(choices=["auto", "xla", "pallas"], help="kernel set (auto: Pallas on a GPU, XLA elsewhere)")
    weights = dict(choices=["auto", "fp8", "dense"], help="auto: as the checkpoint stores them; fp8: quantize "
                                                          "every matrix (docs/fp8.md); dense: all in --dtype")
    if pairs:  # two values: the pair compared; one: both sides' setting
        p.add_argument("--kernels", nargs="+", metavar="SET", default=None, **kernels)
        p.add_argument("--weights", nargs="+", metavar="W", default=None, **weights)
    else:
        p.add_argument("--kernels", default="auto", **kernels)
        p.add_argument("--weights", default="auto", **weights)
    p.add_argument("--no-cache", action="store_true", help="do not use the persistent compilation cache")


def add_parser(sub) -> None:
    """The `profile` subcommand (and its `compare`) on cli's subparsers."""
    p = sub.add_parser("profile", help="trace steady-state steps and print the GPU-time census by category "
                                       "(docs/profile.md)", **cli._HELP)
    _add_common(p, pairs=False)
    p.add_argument("--out", type=Path, default=None,
                   help="save the trace (a jax.profiler log dir: XProf or Perfetto) and census.json/census.md here")
    p.set_defaults(run=run_profile)
    inner = p.add_subparsers(dest="profile_command", parser_class=cli._Parser)
    c = inner.add_parser("compare", help="two censuses side by side: two saved ones (A B), or two kernel sets, "
                                         "weight formats or git revisions run here", **cli._HELP)
    c.add_argument("saved", nargs="*", type=Path, metavar="A B", help="two `lingjax profile --out` directories")
    _add_common(c, pairs=True)
    c.add_argument("--revs", nargs=2, metavar="REV", default=None,
                   help="two git revisions (or directories holding a tree), each profiled in a fresh process of its "
                        "own tree: a temporary worktree (lingjax.revisions)")
    c.add_argument("--out", type=Path, default=None, help="save each side's trace and census under OUT/LABEL")
    c.set_defaults(run=run_compare)


# ---- checks, before any weight ---------------------------------------------------------------------------
def _check(args, name: str, cfg) -> None:
    if args.n < 1:
        raise cli.UsageError(f"--n {args.n}: at least one step")
    if args.prompt_len < 1:
        raise cli.UsageError(f"--prompt-len {args.prompt_len}: at least one token")
    from lingjax.requests import PREFILL_CHUNK

    if args.program == "prefill" and args.prompt_len > PREFILL_CHUNK:
        raise cli.UsageError(f"--program prefill --prompt-len {args.prompt_len}: one chunk holds at most "
                             f"{PREFILL_CHUNK} tokens (the engine prefills a longer prompt chunk by chunk)")
    if args.start and args.program != "prefill":
        raise cli.UsageError(f"--start {args.start} places a prefill chunk: it needs --program prefill")
    if args.start < 0:
        raise cli.UsageError(f"--start {args.start}: a position, at least 0")
    if args.program in ("decode", "prefill") and args.steps is not None:
        raise cli.UsageError("--steps counts a round's drafts: it needs --program nextn or dspark")
    if args.steps is not None and args.steps < 1:
        raise cli.UsageError(f"--steps {args.steps}: at least one draft")
    if args.program == "nextn" and cfg.num_nextn_predict_layers == 0:
        raise cli.UsageError(f"{name} has no MTP layer: --program nextn needs one")
    if args.prompt_len > cfg.max_position_embeddings // 2:
        raise cli.UsageError(f"--prompt-len {args.prompt_len}: at most half the context "
                             f"({cfg.max_position_embeddings // 2})")
    if args.start + args.prompt_len > cfg.max_position_embeddings // 2:
        raise cli.UsageError(f"--start {args.start} --prompt-len {args.prompt_len}: the chunk must end within half "
                             f"the context ({cfg.max_position_embeddings // 2})")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise cli.UsageError(f"--out {args.out}: exists and is not a directory")
    cli._check_devices(cfg, args, name)


def _draft_choice(args, name: str) -> str | None:
    """load's draft argument: DSpark needs a drafter (the shipped model's own; a random one for a preset)."""
    from lingjax.shipped import is_default_checkpoint

    if args.program != "dspark":
        return None
    if is_default_checkpoint(name):
        return "auto"
    if args.model is not None:
        return "random"
    raise cli.UsageError(f"--program dspark: {name} has no DSpark drafter of its own (profile a preset or the "
                         "shipped model)")


# ---- running ---------------------------------------------------------------------------------------------
def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _load(args, name: str, weights: str, draft):
    import lingjax
    from lingjax import compilation_cache

    if not args.no_cache:
        compilation_cache.enable()
    _say(f"loading {name} (weights {weights})")
    return lingjax.load(name, dtype=args.dtype, kernels="auto", tp=args.tp, router_precision=args.router_precision,
                        weights=weights, draft=draft)


def profile_model(model, args, out: Path | None):
    """Compile, time (unprofiled), trace and take the census of --program on `model` -> (census, meta)."""
    import numpy as np

    from lingjax import profiling, steady

    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, args.prompt_len).astype(np.int32)
    program = steady.steady_program(model, args.program, prompt, args.steps, start=args.start)
    label = f"{program.name}, kernels {model.kernels}, tp {model.tp}"
    _say(f"{label}: compiling")
    program.launcher(2)()
    _say(f"{label}: timing {args.n} steps, unprofiled")
    real = steady.timed(program, args.n)
    _say(f"{label}: tracing {args.n} steps")
    hlo = program.hlo()
    if out is not None:
        import gzip

        out.mkdir(parents=True, exist_ok=True)
        with gzip.open(out / "step_hlo.txt.gz", "wt") as f:  # the census can be redone offline from these
            f.write(hlo)
    census = profiling.trace_census(program.launcher(args.n), hlo, args.n, real, log_dir=out)
    meta = {"program": program.name, "model": model.source, "kernels": model.kernels, "tp": model.tp,
            "weights": "fp8" if model.fp8 else "dense", "dtype": str(model.dtype), "n": args.n,
            "backend": _backend()}
    if out is not None:
        from lingjax import profile_report

        profile_report.save(out, census, meta, model.kernels)
    return census, meta


def _backend() -> str:
    import jax

    return jax.devices()[0].device_kind


def _source(args):
    cfg, _, name, _ = cli._source(args)
    return cfg, name


def run_profile(args) -> int:
    from lingjax import profile_report, profiling

    cfg, name = _source(args)
    _check(args, name, cfg)
    draft = _draft_choice(args, name)
    model = _load(args, name, args.weights, draft).variant(kernels=args.kernels)
    census, meta = profile_model(model, args, args.out)
    print(profile_report.describe(meta))
    print()
    print(profiling.format_census({model.kernels: census}))
    if census.top:
        print(f"\nthe {len(census.top)} kernels with the most time (a kernel launched in every layer counted once, "
              "its layers' launches summed):")
        print(profiling.format_top(census))
    if meta["backend"].lower() == "cpu":
        print("\non a CPU the 'kernels' are XLA's thunks, run on several threads: their summed time can pass the "
              "step's")
    if args.out is not None:
        print(f"\ntrace and census in {args.out} (view: xprof --logdir {args.out}, or open "
              f"{args.out}/plugins/profile/*/*.trace.json.gz in ui.perfetto.dev)")
    return 0


def run_compare(args) -> int:
    from lingjax import profile_report

    if args.profile_command != "compare":
        raise cli.UsageError("expected `lingjax profile compare`")
    for flag, values in (("--kernels", args.kernels), ("--weights", args.weights)):
        if values is not None and len(values) > 2:
            raise cli.UsageError(f"{flag} takes two values (the sides compared) or one (both sides' setting), got "
                                 f"{len(values)}")
    pair = lambda values: values is not None and len(values) == 2  # noqa: E731
    forms = [bool(args.saved), pair(args.kernels), pair(args.weights), args.revs is not None]
    if sum(forms) != 1:
        raise cli.UsageError("compare takes two saved censuses (A B), or --kernels A B, --weights A B or --revs A B: "
                             "one of them (a single --kernels or --weights value sets both sides)")
    if args.saved and (args.kernels or args.weights):
        raise cli.UsageError("two saved censuses are compared as they were run: --kernels and --weights run nothing")
    if args.saved:
        if len(args.saved) != 2:
            raise cli.UsageError(f"compare takes two saved censuses, got {len(args.saved)}")
        if args.out is not None:
            raise cli.UsageError("--out saves what compare runs: two saved censuses are saved already")
        (a, meta_a), (b, meta_b) = (profile_report.read(p) for p in args.saved)
        labels = ("A", "B")
        print(f"A: {args.saved[0]}: {profile_report.describe(meta_a)}")
        print(f"B: {args.saved[1]}: {profile_report.describe(meta_b)}")
        print()
        print(profile_report.format_compare(labels, a, b))
        return 0
    if args.revs is not None:
        return _compare_revisions(args)
    cfg, name = _source(args)
    by_weights = pair(args.weights)
    kernels, weights = _sides(args.kernels), _sides(args.weights)
    if len(set(weights if by_weights else kernels)) == 1:
        raise cli.UsageError("compare needs two different sides")
    args.weights = weights[0]
    _check(args, name, cfg)
    args.weights = weights[1]
    _check(args, name, cfg)
    draft = _draft_choice(args, name)
    results, labels = [], []
    base = None
    for k, w in zip(kernels, weights):
        label = w if by_weights else k
        if base is None or by_weights:
            base = _load(args, name, w, draft)
        out = None if args.out is None else args.out / label
        results.append(profile_model(base.variant(kernels=k), args, out))
        labels.append(label)
    return _print_compare(labels, results)


def _sides(values) -> list[str]:
    """A compare's --kernels or --weights as [side A, side B]: the pair given, one value for both, or auto."""
    if not values:
        return ["auto", "auto"]
    return list(values) if len(values) == 2 else [values[0], values[0]]


def _profile_argv(args) -> list[str]:
    """The `lingjax profile` flags of this compare (its one kernel set and weight format: as given, else auto)."""
    argv = ["--program", args.program, "--n", str(args.n), "--prompt-len", str(args.prompt_len), "--tp", str(args.tp),
            "--dtype", args.dtype, "--router-precision", args.router_precision]
    for flag, values in (("--kernels", args.kernels), ("--weights", args.weights)):
        if values:
            argv += [flag, values[0]]
    if args.model is not None:
        argv += ["--model", args.model]
    if args.checkpoint is not None:
        argv += ["--checkpoint", str(args.checkpoint.resolve())]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if args.start:
        argv += ["--start", str(args.start)]
    return argv + (["--no-cache"] if args.no_cache else [])


def _compare_revisions(args) -> int:
    """Each revision's `lingjax profile` in a fresh process of its own tree, then the two saved censuses."""
    import os
    import subprocess
    import tempfile

    from lingjax import profile_report, revisions

    a, b = args.revs
    if a == b:
        raise cli.UsageError("compare needs two different sides")
    for rev in args.revs:
        if not Path(rev).is_dir():
            try:
                revisions.short(rev)
            except ValueError as e:
                raise cli.UsageError(f"--revs {rev}: {e}") from None
    argv = _profile_argv(args)
    saved, labels = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, rev in enumerate(args.revs):
            with revisions.tree(rev) as (root, label):
                label = Path(label).name if Path(rev).is_dir() else label
                out = (args.out / label if args.out is not None else Path(tmp) / str(i)).resolve()
                _say(f"{label}: lingjax profile {' '.join(argv)} (in {root})")
                env = dict(os.environ, PYTHONPATH=str(root))
                done = subprocess.run([sys.executable, "-m", "lingjax.cli", "profile", *argv, "--out", str(out)],
                                      cwd=root, env=env, stdout=subprocess.DEVNULL)
                if done.returncode != 0:
                    raise cli.UsageError(f"--revs {rev}: its `lingjax profile` failed (exit {done.returncode}; a "
                                         "revision before `lingjax profile` has none)")
                saved.append(profile_report.read(out))
                labels.append(label)
    return _print_compare(labels, saved, name_sides=True)


def _print_compare(labels: list[str], sides: list, name_sides: bool = False) -> int:
    """The two censuses [(census, meta), (census, meta)], each side described, then side by side; -> exit 0."""
    from lingjax import profile_report

    (a, meta_a), (b, meta_b) = sides
    for side, label, meta in (("A", labels[0], meta_a), ("B", labels[1], meta_b)):
        print(f"{side}: {label + ': ' if name_sides else ''}{profile_report.describe(meta)}")
    print()
    print(profile_report.format_compare(tuple(labels), a, b))
    return 0
