"""The regression guard: a bench's figures on the working tree against the same bench on an earlier revision, in one
run, interleaved process by process (docs/measuring.md: a figure more than 10% off its last record is a regression
until such an A/B says otherwise).

    python bench/step_bench.py --model mid --kernels pallas --baseline df9e41e
    python bench/step_bench.py --model mid --kernels pallas --baseline /path/to/a/checkout --baseline-rounds 2

The baseline is a git revision, checked out in a temporary worktree (removed after), or a directory holding a tree
already (where the machine has no git history: `git worktree add DIR REV` on another and carry DIR). Each side runs
in fresh processes, A B A B ..., each with its own empty compilation cache unless --warm-cache is given: the first
process on a new machine is what is measured. Options the baseline's script does not know are left out of its
command line (read from its --help), and said so.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from lingjax import revisions

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def tree(rev_or_dir: str):
    """The baseline's root: the directory given, or a temporary git worktree of the revision (removed after):
    lingjax.revisions.tree, a bad --baseline one line."""
    if not Path(rev_or_dir).is_dir():
        try:
            revisions.short(rev_or_dir, ROOT)
        except ValueError as e:
            raise SystemExit(f"--baseline {rev_or_dir}: {e}") from None
    with revisions.tree(rev_or_dir, ROOT) as found:
        yield found


def known_options(root: Path, script: str) -> set[str]:
    """The --options `script` accepts in the tree at root (from its --help)."""
    done = subprocess.run([sys.executable, script, "--help"], cwd=root, capture_output=True, text=True,
                          env=_env(root))
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", done.stdout))


def keep_known(argv: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    """argv without the options (and their values) outside `known` -> (kept, dropped)."""
    kept, dropped, skipping = [], [], False
    for arg in argv:
        if arg.startswith("--"):
            skipping = arg.split("=")[0] not in known
        (dropped if skipping else kept).append(arg)
    return kept, dropped


def _env(root: Path) -> dict:
    import os

    env = dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def rows(report: str) -> dict[tuple[str, str], tuple[float, float | None]]:
    """{(variant, step): (µs/step, floor µs or None)} from a step_bench report's table (any revision's columns)."""
    out, header = {}, None
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| tp |") and "µs/step" in cells:
            header = cells
            continue
        if header is None or not line.startswith("|") or line.startswith("|---") or len(cells) != len(header):
            continue
        row = dict(zip(header, cells))
        try:
            floor = float(row["floor µs"]) if "floor µs" in row else None
            out[(row["kernels"], row["step"])] = (float(row["µs/step"]), floor)
        except (KeyError, ValueError):
            continue
    return out


def run_side(root: Path, script: str, argv: list[str], out: Path, say) -> dict:
    """One fresh process of `script` in the tree at root -> its rows."""
    done = subprocess.run([sys.executable, script, *argv, "--out", str(out)], cwd=root, env=_env(root),
                          capture_output=True, text=True)
    if done.returncode != 0:
        say(f"- {root}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ''}")
    return rows(out.read_text()) if out.exists() else {}


def compare(script: str, argv: list[str], baseline: str, rounds: int, say) -> None:
    """Time `script argv` on the working tree and on `baseline`, interleaved over `rounds` pairs of fresh processes,
    and print one table: medians per (variant, step), baseline / working tree."""
    with tree(baseline) as (root, label), tempfile.TemporaryDirectory() as tmp:
        theirs, dropped = keep_known(argv, known_options(root, script))
        if dropped:
            say(f"the baseline's {script} lacks {' '.join(dropped)}: left out of its command line")
        sides = {"working tree": (ROOT, argv), f"baseline {label}": (root, theirs)}
        results = {side: [] for side in sides}
        for i in range(rounds):
            for side, (where, args) in sides.items():
                say(f"- round {i + 1}: {side}: `python {script} {' '.join(args)}`")
                results[side].append(run_side(where, script, args, Path(tmp) / f"{i}_{len(results[side])}.md", say))
        say()
        names = list(sides)
        say.table("variant", "step", *(f"{n} µs (median of {rounds})" for n in names), "floor µs",
                  f"{names[1]} / {names[0]}")
        keys = [k for k in results[names[0]][0]] if results[names[0]] and results[names[0]][0] else []
        for key in keys:
            med = []
            for n in names:
                times = [r[key][0] for r in results[n] if key in r]
                med.append(statistics.median(times) if times else None)
            floor = results[names[0]][0][key][1]
            ratio = f"{med[1] / med[0]:.3f}" if None not in med else "-"
            say.row(*key, *("-" if m is None else f"{m:.0f}" for m in med), "-" if floor is None else f"{floor:.0f}",
                    ratio)
