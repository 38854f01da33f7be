"""Another revision of this repository, checked out beside the working tree: what an A/B across revisions runs in.

`tree(rev_or_dir)` yields the root of a tree to run: a directory given as is (a checkout made elsewhere, or this
one), or a temporary `git worktree` of a revision, removed after. bench/baseline.py (the regression guard) and
`lingjax profile compare --revs` both use it. Needs a git checkout of lingjax, not an installed wheel.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def short(rev: str, root: Path = ROOT) -> str:
    """rev's short commit hash in the repository at root; ValueError if it is not a revision there."""
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", f"{rev}^{{commit}}"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()
        raise ValueError(f"neither a directory nor a git revision here ({detail[-1] if detail else e})") from None


@contextmanager
def tree(rev_or_dir: str, root: Path = ROOT):
    """-> (the tree's root, its label): the directory given, or a temporary worktree of the revision (removed
    after). Raises ValueError before anything is made if rev_or_dir is neither."""
    if Path(rev_or_dir).is_dir():
        yield Path(rev_or_dir).resolve(), rev_or_dir
        return
    rev = short(rev_or_dir, root)
    work = Path(tempfile.mkdtemp(prefix=f"lingjax-{rev}-"))
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(work), rev], check=True,
                   capture_output=True)
    try:
        yield work, rev
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(work)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
