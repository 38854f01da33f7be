"""A census (lingjax.profiling.Census) saved, read back, printed, and two compared category by category.

`lingjax profile --out DIR` writes DIR/census.json (the census's fields and what was run: `meta`) and
DIR/census.md (the table); `lingjax profile compare A B` reads two of them (a directory or its census.json) and
prints them side by side with B − A per category (docs/profile.md).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lingjax.profiling import CATEGORIES, Census, format_census, format_top

FILE = "census.json"


def to_json(census: Census, meta: dict) -> str:
    """The census's fields plus `meta` (program, model, kernels, ...) as indented JSON."""
    return json.dumps({"census": dataclasses.asdict(census), "meta": meta}, indent=1, ensure_ascii=False)


def read(path: str | Path) -> tuple[Census, dict]:
    """A saved census (a `--out` directory or its census.json) -> (census, meta). A missing or malformed file is
    a ValueError that names it."""
    path = Path(path)
    file = path / FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no saved census (expected a `lingjax profile --out` directory or its {FILE})")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        fields = {f.name for f in dataclasses.fields(Census)}
        census = Census(**{k: v for k, v in data["census"].items() if k in fields})
        census.by_category_us = {c: float(census.by_category_us.get(c, 0.0)) for c in CATEGORIES}
        return census, dict(data.get("meta", {}))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{file}: not a saved census ({type(e).__name__}: {e})") from None


def save(out: str | Path, census: Census, meta: dict, label: str) -> None:
    """census.json and census.md into the directory `out` (made if missing)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / FILE).write_text(to_json(census, meta) + "\n", encoding="utf-8")
    top = "\n\n" + format_top(census) if census.top else ""
    (out / "census.md").write_text(describe(meta) + "\n\n" + format_census({label: census}) + top + "\n",
                                   encoding="utf-8")


def describe(meta: dict) -> str:
    """One line of what was profiled, from the meta a profile saves."""
    return ", ".join(f"{k} {v}" for k, v in meta.items())


def _step(c: Census) -> float:
    return c.real_step_us or c.traced_step_us


def differences(a: Census, b: Census) -> dict[str, float]:
    """B − A in µs per step: each category, kernel time, real idle, the real and traced step, kernels per step."""
    rows = {cat: b.by_category_us[cat] - a.by_category_us[cat] for cat in CATEGORIES}
    rows["kernel time (union)"] = b.busy_us - a.busy_us
    if a.real_idle_us is not None and b.real_idle_us is not None:
        rows["idle in the real step"] = b.real_idle_us - a.real_idle_us
    if a.real_step_us and b.real_step_us:
        rows["real step (unprofiled)"] = b.real_step_us - a.real_step_us
    rows["traced step (profiler on)"] = b.traced_step_us - a.traced_step_us
    rows["kernels per step"] = b.kernels_per_step - a.kernels_per_step
    return rows


def format_compare(labels: tuple[str, str], a: Census, b: Census) -> str:
    """Markdown: A and B side by side (µs per step, share of each one's real step) with B − A and B / A."""
    la, lb = labels
    rows = [f"| µs per step | {la} | {lb} | {lb} − {la} | {lb} / {la} |", "|---|---|---|---|---|"]

    def ratio(x, y):
        return f"{y / x:.2f}" if x else "—"

    for cat in CATEGORIES:
        x, y = a.by_category_us[cat], b.by_category_us[cat]
        rows.append(f"| {cat} | {x:.0f} ({100 * x / _step(a):.1f}%) | {y:.0f} ({100 * y / _step(b):.1f}%) | "
                    f"{y - x:+.0f} | {ratio(x, y)} |")
    values = {"kernel time (union)": (a.busy_us, b.busy_us),
              "idle in the real step": (a.real_idle_us, b.real_idle_us),
              "real step (unprofiled)": (a.real_step_us, b.real_step_us),
              "traced step (profiler on)": (a.traced_step_us, b.traced_step_us),
              "kernels per step": (a.kernels_per_step, b.kernels_per_step)}
    for name, (x, y) in values.items():
        if x is None or y is None:
            rows.append(f"| {name} | {'—' if x is None else f'{x:.0f}'} | {'—' if y is None else f'{y:.0f}'} | — | — |")
        else:
            rows.append(f"| {name} | {x:.0f} | {y:.0f} | {y - x:+.0f} | {ratio(x, y)} |")
    return "\n".join(rows)
