"""The resume state of a training run on disk (docs/training.md): the step, the f32 masters, the biases, the
optimizer state and the rng (orbax), with a JSON record of the run (its RunConfig, the data's seed, position
and fingerprint, the time and tokens spent so far).

    save(run_dir, step, state, record)                 # DIR/checkpoint/step_<n>/{state/, record.json}
    found = latest(run_dir)                            # (step, path) or None
    step, state, record = restore(run_dir, abstract_state, expect=record_of_this_call)

Only the newest checkpoint is kept, so the directory holds one resume state (about 43 MB for the embedded
model) and can be carried between machines. A save is atomic: it is written to a temporary directory and
renamed into place, then the older checkpoints are removed, so an interrupted save leaves the previous one
whole. restore refuses, with one CheckpointMismatch line naming the fields, a checkpoint whose run identity
(`record["run"]`, `record["data"]["fingerprint"]`) differs from this call's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax

CHECKPOINT_DIR = "checkpoint"
RECORD_FILE = "record.json"
STATE_DIR = "state"
FORMAT = "lingjax.train.checkpoint/1"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"


class CheckpointMismatch(ValueError):
    """A resume asked with other hyper-parameters, model config or data than the checkpoint's run."""


def _to_saved(state: dict) -> dict:
    """The state as orbax saves it: params and biases as they are, the optimizer state's leaves flattened
    into a dict of zero-padded indices (its structure comes back from the restore target)."""
    leaves = jax.tree.leaves(state["opt"])
    return {"params": state["params"], "biases": state["biases"], "rng": state["rng"],
            "opt": {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}}


def _from_saved(saved: dict, target: dict) -> dict:
    treedef = jax.tree.structure(target["opt"])
    opt = treedef.unflatten([saved["opt"][f"{i:05d}"] for i in range(treedef.num_leaves)])
    return {"params": saved["params"], "biases": saved["biases"], "opt": opt, "rng": saved["rng"]}


def _dirs(run_dir: Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith(_PREFIX) and (p / RECORD_FILE).exists() and p.name[len(_PREFIX):].isdigit():
            found.append((int(p.name[len(_PREFIX):]), p))
    return sorted(found)


def latest(run_dir: str | Path) -> tuple[int, Path] | None:
    """(step, directory) of the newest complete checkpoint under run_dir, or None."""
    found = _dirs(Path(run_dir))
    return found[-1] if found else None


def save(run_dir: str | Path, step: int, state: dict, record: dict) -> Path:
    """Write the state at `step` (blocking: the next train step donates these arrays) and the JSON record,
    then drop every other checkpoint. Returns the checkpoint's directory."""
    import orbax.checkpoint as ocp  # here, for start-up time: orbax is slow to import; only save and restore need it

    root = (Path(run_dir) / CHECKPOINT_DIR).absolute()
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(_TMP_PREFIX + "*"):  # what an interrupted save left
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f"{_TMP_PREFIX}{_PREFIX}{step:08d}"
    tmp.mkdir()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp / STATE_DIR, _to_saved(state))
        ckptr.wait_until_finished()
    record = {"format": FORMAT, **record, "step": int(step)}
    (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    if final.exists():  # the same step saved again (a resumed call that took no step)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in _dirs(root.parent):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_record(path: str | Path) -> dict:
    return json.loads((Path(path) / RECORD_FILE).read_text())


def _differences(saved, want, prefix="") -> list[str]:
    if isinstance(saved, dict) and isinstance(want, dict):
        out = []
        for k in sorted(set(saved) | set(want)):
            out += _differences(saved.get(k), want.get(k), f"{prefix}{k}.")
        return out
    return [] if saved == want else [f"{prefix[:-1]} (checkpoint {saved!r}, asked {want!r})"]


def check_identity(record: dict, expect: dict, where: Path) -> None:
    """Raise CheckpointMismatch unless record's "run" and data fingerprint equal expect's."""
    diffs = _differences(record.get("run"), expect.get("run"), "")
    saved_fp, want_fp = record.get("data", {}).get("fingerprint"), expect.get("data", {}).get("fingerprint")
    if saved_fp != want_fp:
        diffs.append(f"data fingerprint (checkpoint {saved_fp}, this corpus and tokenizer {want_fp})")
    if diffs:
        raise CheckpointMismatch(f"{where} belongs to another run: " + "; ".join(diffs)
                                 + "; resume with the same options or use another --out")


def restore(run_dir: str | Path, target: dict, expect: dict | None = None) -> tuple[int, dict, dict]:
    """(step, state, record) of the newest checkpoint; target: the state's abstract tree
    (lingjax.train.step.abstract_state), whose structure and dtypes the restored arrays take. With expect,
    check_identity first, before any array is read."""
    import orbax.checkpoint as ocp  # here, for start-up time (see save)

    found = latest(run_dir)
    if found is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint")
    step, path = found
    record = read_record(path)
    if expect is not None:
        check_identity(record, expect, path)
    # Placed on this process's first device whatever the saving machine was (a GPU run resumes on a CPU).
    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here), _to_saved(target))
    with ocp.StandardCheckpointer() as ckptr:
        saved = ckptr.restore(path.absolute() / STATE_DIR, abstract)
    return step, _from_saved(saved, target), record


def dir_bytes(path: str | Path) -> int:
    """Bytes of the files under path."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())

