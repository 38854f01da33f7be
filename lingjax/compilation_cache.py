"""JAX's persistent compilation cache for lingjax's programs, so a second run of the same command skips XLA.

The CLI turns it on by default; the Python API leaves JAX's configuration to the caller (call `enable()`). Directory:
$LINGJAX_CACHE_DIR, else $XDG_CACHE_HOME/lingjax/jax, else ~/.cache/lingjax/jax, with the program store
(lingjax.program_store) in its programs/. Setting LINGJAX_NO_CACHE=1 (or the CLI's --no-cache) leaves both off. Every
program is cached, however fast it compiled: a model's first token waits on dozens of small programs, and together they
are most of the start-up.
"""

from __future__ import annotations

import os
from pathlib import Path

OFF_VARIABLE = "LINGJAX_NO_CACHE"
DIR_VARIABLE = "LINGJAX_CACHE_DIR"
PROGRAMS_SUBDIR = "programs"  # lingjax.program_store's files (jax's own are files named *-cache and *-atime)


def default_dir() -> Path:
    if os.environ.get(DIR_VARIABLE):
        return Path(os.environ[DIR_VARIABLE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "lingjax" / "jax"


def disabled_by_environment() -> bool:
    return os.environ.get(OFF_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def enable(directory: str | Path | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at `directory` (default_dir() when None) and cache every
    program, and keep the step programs' lowered forms in its PROGRAMS_SUBDIR (lingjax.program_store), so a
    later process neither traces nor lowers them. Returns the directory, or None when LINGJAX_NO_CACHE is set or
    the directory cannot be created (the run goes on uncached)."""
    if disabled_by_environment():
        return None
    path = Path(directory).expanduser() if directory is not None else default_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from lingjax import program_store

    program_store.enable(path / PROGRAMS_SUBDIR)
    return path
