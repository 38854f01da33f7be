"""moe_align on the pair axis: the (token, slot) pairs sorted into blocks of `block_m` rows that share one
expert, for the grouped expert GEMMs (lingjax/pallas/moe_experts.py), in one launch whose work does not grow
with the number of experts.

At batch 1 there are only NP = T·k pairs, so one program compares every pair with every other ([NP, NP]):
each pair's stable rank inside its expert's bucket and the bucket's size; a bucket's rank-0 pair, its
representative, gives the bucket's padded size and its offset (buckets in expert-id order); the published
total and every block's expert follow from the representatives; each pair is scattered to its slot and the
sentinel NP to the rest (docs/kernels/moe.md). The result equals the sort-based `align_reference` bit for
bit; past PAIR_LIMIT pairs moe_align is that reference.

Outputs (S = n_blocks · block_m slots, padding slots hold the sentinel NP):
  sorted_ids [S] int32    pair index (token·k + slot) in each slot
  block_expert [NB] int32 expert of each block, −1 past the published total
  pos [NP] int32          slot of each pair (inverse of sorted_ids)
  meta [2] int32          (total padded slots, number of used blocks)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import pallas_call, resolve_interpret

PAIR_LIMIT = 64  # the [NP, NP] comparison runs in one program up to here; larger NP sorts
BLOCK_M = 16  # rows per block of the expert GEMMs (the Triton dot minimum); ≥ T keeps each expert in one block
_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class AlignTuning:
    """The align launch's static choices."""

    num_warps: int = 8  # of the one program


def n_blocks_for(num_pairs: int, block_m: int, num_experts: int | None = None) -> int:
    """Static upper bound on used blocks: Σ ceil(c_b / bm) ≤ (NP + buckets·(bm−1)) / bm, and ≤ NP."""
    buckets = num_pairs if num_experts is None else min(num_experts, num_pairs)
    return max(1, min(num_pairs, (num_pairs + buckets * (block_m - 1)) // block_m))


def align_reference(experts: jax.Array, block_m: int, n_blocks: int | None = None):
    """Sort-based moe_align (the reference, and the path for NP > PAIR_LIMIT). experts: [T, k] or [NP] int32."""
    flat = experts.reshape(-1).astype(_I32)
    npairs = flat.shape[0]
    nb = n_blocks or n_blocks_for(npairs, block_m)
    idx = jnp.arange(npairs, dtype=_I32)
    order = jnp.argsort(flat, stable=True).astype(_I32)
    se = flat[order]
    # scan_unrolled: the default method's binary search is a while loop, which the GPU runs step by step with
    # the host, several times slower (docs/kernels/moe.md)
    first = jnp.searchsorted(se, se, side="left", method="scan_unrolled").astype(_I32)  # bucket start, per sorted pos
    end = jnp.searchsorted(se, se, side="right", method="scan_unrolled").astype(_I32)
    start = first == idx  # the bucket's first pair
    rank = idx - first
    padded = (end - first + block_m - 1) // block_m * block_m
    rep_padded = jnp.where(start, padded, 0)
    offset = (jnp.cumsum(rep_padded) - rep_padded)[first]
    total = rep_padded.sum()
    pos = jnp.zeros((npairs,), _I32).at[order].set(offset + rank)
    sorted_ids = jnp.full((nb * block_m,), npairs, _I32).at[pos].set(idx)
    block_start = jnp.arange(nb, dtype=_I32) * block_m
    head = sorted_ids[block_start]
    block_expert = jnp.where(block_start < total, flat[jnp.minimum(head, npairs - 1)], -1)
    meta = jnp.stack([total, total // block_m]).astype(_I32)
    return sorted_ids, block_expert.astype(_I32), pos, meta


def _align_kernel(e_ref, ids_ref, blk_ref, pos_ref, meta_ref, *, npairs, block_m):
    # e_ref: [≥ NPP] int32 expert per pair (NPP = NP rounded up to a power of 2; entries past NP ignored)
    # ids_ref: [S] int32; blk_ref: [NB] int32; pos_ref: [NPP] int32; meta_ref: [2] int32
    npp = pos_ref.shape[0]
    i = jax.lax.broadcasted_iota(_I32, (npp, npp), 0)  # this pair
    j = jax.lax.broadcasted_iota(_I32, (npp, npp), 1)  # the other pair
    valid = jnp.arange(npp, dtype=_I32) < npairs
    e = jnp.where(valid, e_ref[pl.ds(0, npp)], jnp.iinfo(_I32).max)  # [NPP]
    ei, ej = e[:, None], e[None, :]
    same = (ei == ej) & valid[:, None] & valid[None, :]
    rank = jnp.where(same & (j < i), 1, 0).sum(axis=1)  # stable rank inside the bucket
    count = jnp.where(same, 1, 0).sum(axis=1)  # bucket size
    padded = (count + block_m - 1) // block_m * block_m
    rep = (rank == 0) & valid  # one representative per bucket
    # Bucket-ordered exclusive offset: padded sizes of the buckets with a smaller expert id.
    offset = jnp.where(rep[None, :] & (ej < ei), padded[None, :], 0).sum(axis=1)
    pos = jnp.where(valid, offset + rank, 0)
    total = jnp.where(rep, padded, 0).sum()
    pos_ref[...] = pos
    meta_ref[...] = jnp.where(jnp.arange(2, dtype=_I32) == 0, total, total // block_m)

    # Every block's bucket: the representative whose padded range holds the block's first slot.
    nb = blk_ref.shape[0]
    bstart = jax.lax.broadcasted_iota(_I32, (nb, npp), 0) * block_m
    hit = rep[None, :] & (offset[None, :] <= bstart) & (bstart < (offset + padded)[None, :])  # [NB, NPP]
    found = jnp.where(hit, 1, 0).sum(axis=1) > 0

    def bucket_value(v):  # [NPP] -> [NB]: v of each block's bucket (0 past the total)
        return jnp.where(hit, v[None, :], 0).sum(axis=1)

    blk_ref[...] = jnp.where(found, bucket_value(e), -1)

    # Slot -> pair by scatter: pair p into slot pos[p], and the sentinel NP into every other slot (the
    # slots past its bucket's count in each block, every slot of an unused block). The two stores touch
    # disjoint slots, so neither needs to wait for the other: one pass, no [S, NP] match.
    slot = (jax.lax.broadcasted_iota(_I32, (nb, block_m), 0) * block_m
            + jax.lax.broadcasted_iota(_I32, (nb, block_m), 1))  # [NB, BM]
    in_bucket = slot - bucket_value(offset)[:, None] < bucket_value(count)[:, None]
    pltriton.store(ids_ref.at[slot], jnp.full((nb, block_m), npairs, _I32), mask=~(found[:, None] & in_bucket))
    # The NPP - NP padding pairs repeat pair 0's store (same slot, same value) rather than being masked out:
    # interpret mode stores a masked lane's old value, which would race pair 0's store to slot 0.
    pairs = jnp.arange(npp, dtype=_I32)
    pos0 = jnp.where(pairs == 0, pos, 0).sum()
    ids_ref[jnp.where(valid, pos, pos0)] = jnp.where(valid, pairs, 0)


@functools.partial(jax.jit, static_argnames=("block_m", "n_blocks", "tokens", "tuning", "interpret"))
def moe_align(experts, *, block_m=BLOCK_M, n_blocks=None, tokens=None, tuning: AlignTuning = AlignTuning(),
              interpret=None):
    """Pair-axis moe_align, one launch; NP > PAIR_LIMIT falls back to `align_reference`.

    experts: [R, k] int32, of which the first `tokens` rows (default all) are aligned: NP = tokens·k. The
    kernel reads the rows in place, so a verify's zero-padded rows (lingjax/model.py, row invariance)
    need no slicing launch. Returns (sorted_ids [S], block_expert [NB], pos [NP], meta [2]); S and NB
    may be padded past NP·block_m and NP (to powers of 2): the extra blocks read −1 and the extra slots NP.
    block_m must be a power of 2 (a Triton block dimension).
    """
    interpret = resolve_interpret(interpret)
    flat = experts.reshape(-1).astype(_I32)
    npairs = (experts.shape[0] if tokens is None else tokens) * experts.shape[1]
    if npairs > PAIR_LIMIT:
        return align_reference(flat[:npairs], block_m, n_blocks)
    npp = pl.next_power_of_2(npairs)
    nb = pl.next_power_of_2(n_blocks or n_blocks_for(npairs, block_m))
    slots = nb * block_m
    if flat.shape[0] < npp:
        flat = jnp.pad(flat, (0, npp - flat.shape[0]))
    ids, blk, pos, meta = pallas_call(
        functools.partial(_align_kernel, npairs=npairs, block_m=block_m),
        out_shape=(
            jax.ShapeDtypeStruct((slots,), _I32),
            jax.ShapeDtypeStruct((nb,), _I32),
            jax.ShapeDtypeStruct((npp,), _I32),
            jax.ShapeDtypeStruct((2,), _I32),
        ),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
        interpret=interpret,
        name="moe_align_pairs",
    )(flat)
    return ids, blk, pos[:npairs] if npp != npairs else pos, meta

