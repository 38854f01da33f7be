"""The model lingjax ships: a small Ling-architecture code model trained by lingjax.train (docs/training.md),
in the official Hugging Face layout under checkpoints/. It is what `lingjax.load()` and the CLI load when no
model is named. Imports nothing heavy, so the CLI's --help stays free of jax."""

from __future__ import annotations

from pathlib import Path

DEFAULT_NAME = "ling-code-tiny"
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / DEFAULT_NAME


def default_checkpoint() -> Path:
    """The shipped checkpoint's directory; FileNotFoundError naming it when this install lacks it (the
    checkpoint lives in the repository, beside the package, not inside a wheel)."""
    if not (DEFAULT_CHECKPOINT / "config.json").exists():
        raise FileNotFoundError(f"the default model {DEFAULT_NAME} is not at {DEFAULT_CHECKPOINT} (it ships with "
                                "a clone of the repository): name one with --model or --checkpoint")
    return DEFAULT_CHECKPOINT


def is_default_checkpoint(path) -> bool:
    """Whether `path` names the shipped checkpoint's directory, however it is spelled (its drafter goes with it)."""
    return Path(path).resolve() == DEFAULT_CHECKPOINT.resolve()


DRAFT_NAME = "ling-code-tiny-dspark"
DEFAULT_DRAFT = DEFAULT_CHECKPOINT.parent / DRAFT_NAME


def default_draft() -> Path | None:
    """The shipped model's DSpark drafter (lingjax.spec.dspark), trained against it; None when this install
    lacks it."""
    return DEFAULT_DRAFT if (DEFAULT_DRAFT / "config.json").exists() else None
