"""DSpark's verify width chosen on the host each round (generate(..., widths=...)): the width that maximises the
expected tokens per unit of time, from the drafter's survival probabilities of an earlier round and a cost per width
(a byte model of the target's round, or measured times). The choice depends on earlier rounds only, so sampling stays
lossless (docs/dspark.md)."""

from __future__ import annotations

import dataclasses

import numpy as np

from lingjax.config import MOE
from lingjax.model import abstract_model, param_count

# What a round costs besides its bytes (launches, the host's share): the default of WidthSchedule.for_model, in
# seconds, and the bandwidth that turns bytes into seconds. A schedule built from measured round times replaces
# both (WidthSchedule(widths, costs)).
ROUND_OVERHEAD_S = 2e-4
READ_BYTES_PER_S = 4.0e12


def round_bytes(cfg, width: int, dtype_bytes: int = 2) -> float:
    """The bytes a verify of `width` rows reads of a target (lingjax.config.LingConfig) at batch 1: every weight
    but the embeddings and the MTP layer, with each MoE layer's routed experts counted at the expected number a
    width of rows touches under uniform routing, E·(1 - (1 - k/E)^width): the term that makes a wider verify cost
    more."""
    d, e, k, i = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    moe_layers = sum(m == MOE for m in cfg.mlp_types)
    expert = 3 * i * d
    # every parameter but the embedding rows and the routed experts (the head stays)
    dense = param_count(abstract_model(cfg, with_mtp=False)) - cfg.vocab_size * d - moe_layers * e * expert
    distinct = e * (1 - (1 - k / e) ** width) if e else 0.0
    return (dense + moe_layers * distinct * expert) * dtype_bytes


@dataclasses.dataclass(frozen=True)
class WidthSchedule:
    """The verify widths a DSpark generation may use (each compiled once) and each one's cost (a round's time, any
    unit). Before each call the host takes the width w maximising (1 + Σ_{k<w} a_k) / cost(w), the expected tokens a
    round emits per unit of time, from the latest survival probabilities a_k it has read: those of the round two
    before (the host runs one call ahead). The width depends on earlier rounds only, so sampling stays lossless."""

    widths: tuple[int, ...]
    costs: tuple[float, ...]

    def __post_init__(self):
        if not self.widths or len(self.widths) != len(self.costs):
            raise ValueError(f"a width schedule needs one cost per width, got {self.widths} and {self.costs}")
        if any(w < 2 for w in self.widths) or list(self.widths) != sorted(set(self.widths)):
            raise ValueError(f"verify widths are distinct, increasing and at least 2, got {self.widths}")
        if any(not c > 0 for c in self.costs):
            raise ValueError(f"costs must be > 0, got {self.costs}")

    @classmethod
    def for_model(cls, target_cfg, widths, overhead_s: float = ROUND_OVERHEAD_S,
                  bandwidth: float = READ_BYTES_PER_S) -> WidthSchedule:
        """Costs from the byte model (round_bytes at `bandwidth`) plus a fixed overhead a round."""
        widths = tuple(sorted(set(int(w) for w in widths)))
        return cls(widths, tuple(overhead_s + round_bytes(target_cfg, w) / bandwidth for w in widths))

    def choose(self, survival) -> int:
        """The width for the next call: the widest before any survival probabilities have been read."""
        if survival is None:
            return self.widths[-1]
        gain = np.concatenate([[1.0], 1.0 + np.cumsum(np.asarray(survival, np.float64))])
        return max(self.widths, key=lambda w: gain[min(w - 1, len(gain) - 1)] / self.costs[self.widths.index(w)])
