"""The draft vocabulary (docs/speculation.md, Draft vocabulary): the drafters' logits over a frequency-ranked subset
of the vocabulary, read from a gathered copy of those rows of lm_head.

A NEXTN round reads the lm_head once to verify and once per draft and draft-extend; only the verify needs the
whole vocabulary. Drafting over the Vd most frequent tokens reads Vd/V of the bytes. It is lossless by
construction: the verify keeps the full head, so a draft outside the subset is merely never proposed (greedy
output is the target's argmax either way), and a sampled draft's distribution is zero outside the subset, which
rejection sampling (lingjax.spec.accept) corrects to the target's distribution.

    vocab = draft_vocab.build(model.module.lm_head[...], draft_vocab.top_ids(counts, n), mesh)
    model = model.with_draft_vocab(vocab)          # lingjax.load(..., draft_vocab=n | "P%") does both

Frequency tables: a .npy file holding one vector of V non-negative numbers, the count (or any weight) of each
token id in a corpus; ranked by count, ties to the lower id. The shipped model's sits beside it
(SHIPPED_TABLE; remade by `python -m lingjax.train.token_frequencies`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

TABLE_NAME = "token_frequencies.npy"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftVocab:
    """The subset on the device. Under TP `head` is split by rows like the lm_head (each device reads Vd/tp rows,
    its argmax reduced by Exec.max_argmax_vocab over subset indices) and `ids` is replicated."""

    ids: jax.Array  # [Vd] int32: the subset's token ids, ascending (ties break to the lower id, as the full argmax)
    head: jax.Array  # [Vd, D]: lm_head rows ids, contiguous (a copy: Vd·D·itemsize bytes beside the lm_head)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.head.size) * self.head.dtype.itemsize + int(self.ids.size) * 4


SPECS = DraftVocab(ids=P(), head=P("tp", None))  # lingjax.sharding.AXIS


# ---- sizes and tables ------------------------------------------------------------------------------
_SIZE = re.compile(r"^(?:(\d+)|(\d+(?:\.\d+)?)%)$")


def check_size(spec) -> int | float | None:
    """load's draft_vocab argument, checked without a model: None or "full" -> None (the whole vocabulary), an int
    N >= 1 -> N, "N" -> N, "P%" with 0 < P <= 100 -> P / 100 as a float. ValueError naming the value otherwise."""
    if spec is None or spec == "full":
        return None
    if isinstance(spec, bool):
        raise ValueError(f"draft_vocab must be a token count N or a percentage 'P%', got {spec!r}")
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"draft_vocab must be at least 1 token, got {spec}")
        return spec
    m = _SIZE.match(str(spec).strip())
    if m is None:
        raise ValueError(f"draft_vocab must be a token count N, a percentage 'P%' or 'full', got {spec!r}")
    if m.group(1) is not None:
        return check_size(int(m.group(1)))
    pct = float(m.group(2))
    if not 0 < pct <= 100:
        raise ValueError(f"draft_vocab percentage must be in (0, 100], got {spec!r}")
    return pct / 100


# a percentage's rows round up to a multiple of this (per device): the draft GEMV's N tiles are powers of 2
# (lingjax/pallas/linear.py), so a size with a small power-of-2 factor would get small tiles
PERCENT_ALIGN = 256


def resolve_size(spec, vocab_size: int, tp: int = 1) -> int | None:
    """The subset's size for a model of vocab_size tokens split over tp devices: N rounded up to a multiple of tp
    (each device holds whole rows), or ceil(P·V) rounded up to a multiple of PERCENT_ALIGN·tp; None when that is
    the whole vocabulary (no copy is made)."""
    size = check_size(spec)
    if size is None:
        return None
    if isinstance(size, int) and size > vocab_size:
        raise ValueError(f"draft_vocab {size} exceeds the vocabulary of {vocab_size} tokens")
    n = size if isinstance(size, int) else max(1, math.ceil(size * vocab_size - 1e-9))
    align = tp if isinstance(size, int) else PERCENT_ALIGN * tp
    n = -(-n // align) * align
    return None if n >= vocab_size else n


def read_table(path, vocab_size: int) -> np.ndarray:
    """A frequency table file -> float64 [vocab_size]; ValueError naming the file on any other content."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"draft vocabulary table {path}: no such file")
    try:
        table = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"draft vocabulary table {path}: not a .npy array ({e})") from None
    return check_counts(table, vocab_size, f"draft vocabulary table {path}")


def check_counts(table, vocab_size: int, what: str = "draft_vocab_table") -> np.ndarray:
    """A frequency table (an array) -> float64 [vocab_size]; ValueError naming `what` unless it is a numeric
    vector of vocab_size finite, non-negative counts."""
    table = np.asarray(table)
    if table.shape != (vocab_size,) or not np.issubdtype(table.dtype, np.number):
        raise ValueError(f"{what}: expected a numeric vector of {vocab_size} counts (the model's vocabulary), got "
                         f"{table.dtype} {table.shape}")
    table = table.astype(np.float64)
    if not np.isfinite(table).all() or (table < 0).any():
        raise ValueError(f"{what}: counts must be finite and non-negative")
    return table


def top_ids(counts: np.ndarray, n: int) -> np.ndarray:
    """The n most frequent token ids (ties to the lower id), ascending: int32 [n]."""
    order = np.lexsort((np.arange(counts.size), -np.asarray(counts, np.float64)))
    return np.sort(order[:n]).astype(np.int32)


def zipf_counts(vocab_size: int, exponent: float = 1.1, seed: int = 0) -> np.ndarray:
    """A synthetic table for benches on models without a corpus (not for the product): Zipf weights over a
    random permutation of the ids."""
    ranks = np.random.default_rng(seed).permutation(vocab_size) + 1
    return ranks.astype(np.float64) ** -exponent


# ---- the device copy --------------------------------------------------------------------------------
def build(lm_head, ids: np.ndarray, mesh=None) -> DraftVocab:
    """The gathered copy of lm_head [V, D] rows `ids` (int32 [Vd], ascending), placed like the lm_head (rows split
    over the mesh) or on lm_head's device."""
    ids = np.asarray(ids, np.int32)
    if ids.ndim != 1 or ids.size == 0 or (np.diff(ids) <= 0).any() or ids[0] < 0 or ids[-1] >= lm_head.shape[0]:
        raise ValueError("draft vocabulary ids must be distinct, ascending and inside the vocabulary")
    if mesh is not None and ids.size % mesh.size:
        raise ValueError(f"a draft vocabulary of {ids.size} tokens does not split over {mesh.size} devices")
    head = jnp.take(lm_head, jnp.asarray(ids), axis=0)
    vocab = DraftVocab(ids=jnp.asarray(ids), head=head)
    if mesh is None:
        return jax.device_put(vocab, next(iter(lm_head.devices())))
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), vocab, SPECS)


def specs(params):
    """PartitionSpecs for a drafter's params (lingjax.spec.step): a DraftVocab's as SPECS, the rest replicated."""
    return jax.tree.map(lambda x: SPECS if isinstance(x, DraftVocab) else jax.tree.map(lambda _: P(), x), params,
                        is_leaf=lambda x: isinstance(x, DraftVocab))


# ---- inside the programs ----------------------------------------------------------------------------
def _logits(module, vocab: DraftVocab, hidden, ex):
    """hidden [..., D] -> f32 logits over the subset [..., Vd] (under TP this device's Vd/tp of them)."""
    from lingjax.model import paths_for, project

    flat = hidden.reshape(-1, hidden.shape[-1])
    with jax.named_scope("draft_vocab_head"):
        logits = project(flat, vocab.head, paths_for(flat.shape[0], ex, pad_small=False), jnp.float32)
    return logits.reshape(hidden.shape[:-1] + logits.shape[-1:])


def draft_argmax(module, vocab, hidden, ex) -> jax.Array:
    """A draft token: the argmax of the draft logits of hidden [..., D] over the subset (the whole vocabulary when
    vocab is not a DraftVocab: None or a drafter's empty params) -> int32 [...]."""
    if not isinstance(vocab, DraftVocab):
        return ex.argmax_vocab(module.lm_logits(hidden, pad_small=False, ex=ex))
    return vocab.ids[ex.argmax_vocab(_logits(module, vocab, hidden, ex))]


def full_draft_logits(module, vocab, hidden, ex) -> jax.Array:
    """The draft logits of hidden [..., D] as a full-vocabulary row, gathered across shards: f32 [..., V], -inf
    outside the subset (its tokens are never drafted, and a sampled draft gives them probability 0); vocab not a
    DraftVocab: the whole vocabulary's."""
    if not isinstance(vocab, DraftVocab):
        return ex.gather_vocab(module.lm_logits(hidden, pad_small=False, ex=ex))
    sub = ex.gather_vocab(_logits(module, vocab, hidden, ex))  # [..., Vd]
    full = jnp.full(hidden.shape[:-1] + (module.cfg.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., vocab.ids].set(sub)
