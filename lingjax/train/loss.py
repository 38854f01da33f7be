"""The training objective (docs/training.md): next-token cross entropy of the main model, the MTP layer's
next-next-token cross entropy (DeepSeek-V3's multi-token prediction, one depth) weighted by MTP_WEIGHT, and
a small sequence-wise balance loss; plus the auxiliary-loss-free bias update applied after each step.

A batch from lingjax.train.data.PackedBatches is int32 [B, T + 2]; with x = batch:

    inputs       x[:, 0:T]        what the main model reads at positions 0..T-1
    targets      x[:, 1:T+1]      main row t predicts token t+1
    next_tokens  x[:, 1:T+1]      MTP row t reads h_t and embed(token t+1) ...
    mtp_targets  x[:, 2:T+2]      ... and predicts token t+2

    loss = CE_main + MTP_WEIGHT · CE_mtp + BALANCE_WEIGHT · Σ_layers Σ_e f_e·P_e

MTP_WEIGHT is 0.3 for the whole run (DeepSeek-V3 uses 0.3 for most of its run, then 0.1); the MTP layer's
gradient reaches the main model through h_t and the shared embedding and head, as in DeepSeek-V3. Balance:
RouterStats.balance is Σ_e f_e·P_e per MoE layer (1 when balanced); α = BALANCE_WEIGHT = 1e-4 keeps it a
backstop, the selection biases do the balancing: after each step, outside the gradient,

    bias_e += BIAS_RATE · sign(mean_load - load_e)       (γ = 1e-3, per MoE layer, the MTP's included)

so an overloaded expert is picked less next step. The biases steer selection only, never the gate weights
(docs/model.md §6.1), which is why they are not trained.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lingjax.config import LingConfig
from lingjax.train import forward

F32 = jnp.float32
MTP_WEIGHT = 0.3
BALANCE_WEIGHT = 1e-4  # DeepSeek-V3's α
BIAS_RATE = 1e-3  # DeepSeek-V3's γ (bias update speed)


def split_batch(batch: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """int32 [B, T + 2] -> (inputs, targets, next_tokens, mtp_targets), each [B, T] (module docstring)."""
    t = batch.shape[1] - 2
    if t < 1:
        raise ValueError(f"a training batch is [B, T + 2] with T >= 1, got shape {batch.shape}")
    return batch[:, :t], batch[:, 1 : t + 1], batch[:, 1 : t + 1], batch[:, 2 : t + 2]


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """f32 logits [..., V], int targets [...] -> f32 [...]: -log softmax(logits)[target], the log-softmax in
    f32 whatever the logits' dtype."""
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def loss_and_metrics(params: dict, biases: jax.Array, batch: jax.Array, cfg: LingConfig, *,
                     compute_dtype=jnp.bfloat16, remat: bool = False, mtp_weight: float = MTP_WEIGHT,
                     balance_weight: float = BALANCE_WEIGHT) -> tuple[jax.Array, dict]:
    """The objective on f32 masters `params` (rounded to compute_dtype here, forward.cast_params), biases
    [M, E] f32 (main MoE layers, then the MTP's) and batch int32 [B, T + 2].

    Returns (loss f32 [], aux): aux holds the scalar metrics "loss", "main_ce", "mtp_ce" (0 without an MTP
    layer), "balance" (mean over MoE layers of Σ f·P), "load_imbalance_max" and "load_imbalance_mean" (max
    over experts of load / mean load: the worst layer, and the mean over layers; 1 is balanced), and
    "loads" f32 [M, E], the tokens that picked each expert (what update_biases reads)."""
    inputs, targets, next_tokens, mtp_targets = split_batch(batch)
    p = forward.cast_params(params, cfg, compute_dtype)
    hidden, stats = forward.forward(p, biases, inputs, cfg, remat=remat)
    main_ce = jnp.mean(token_nll(forward.logits(p, hidden), targets))
    loads, balance = [stats.loads], [stats.balance]
    mtp_ce = jnp.zeros((), F32)
    if cfg.num_nextn_predict_layers:
        z, mtp_stats = forward.mtp_forward(p, biases[-1], hidden, next_tokens, cfg, remat=remat)
        mtp_ce = jnp.mean(token_nll(forward.logits(p, z), mtp_targets))
        loads.append(mtp_stats.loads)
        balance.append(mtp_stats.balance)
    loads = jax.lax.stop_gradient(jnp.concatenate(loads))  # [M, E]
    balance = jnp.concatenate(balance)  # [M]
    loss = main_ce + mtp_weight * mtp_ce + balance_weight * jnp.sum(balance)
    ratio = jnp.max(loads, -1) / jnp.maximum(jnp.mean(loads, -1), 1e-9)
    aux = {"loss": loss, "main_ce": main_ce, "mtp_ce": mtp_ce, "balance": jnp.mean(jax.lax.stop_gradient(balance)),
           "load_imbalance_max": jnp.max(ratio), "load_imbalance_mean": jnp.mean(ratio), "loads": loads}
    return loss, aux


def update_biases(biases: jax.Array, loads: jax.Array, rate: float = BIAS_RATE) -> jax.Array:
    """The auxiliary-loss-free balancing step: biases [M, E] + rate · sign(mean_e load - load_e), per layer.
    An expert at exactly the mean load keeps its bias."""
    loads = jnp.asarray(loads, F32)
    return biases + rate * jnp.sign(jnp.mean(loads, -1, keepdims=True) - loads)
