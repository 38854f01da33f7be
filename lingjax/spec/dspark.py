"""DSpark block drafting (docs/dspark.md): a drafter that proposes a block of γ tokens from one parallel forward of
its own small network (lingjax.spec.dspark_model), conditioned on the target's residual streams.

Per round, inside the jitted round of lingjax.spec.step:
- propose: the block [b, MASK × (γ-1)] at positions s..s+γ-1 attends to the context cache (rows < s) and to
  itself; U_k = lm_head(h_{k-1}); the Markov head adds W1[x_{k-1}]·W2 left to right (x_0 = b), each x_k the argmax
  (greedy) or a sample at the request's temperature; the confidence head gives c_k and the survival a_k = Π c_i.
  The first `steps` drafts are verified; of those, the leading ones with a_k >= min_survival count (`limit`).
- extend: the verify's rows' target features become context rows at s..s+S (each layer's k/v projections):
  rows past the accepted ones are stale and hidden by position (the next block attends to rows < s' only),
  then rewritten by a later round. Prefill writes the prompt's rows the same way.
The KDA state of the target is staged and committed by the round as for NEXTN: no replay.

`DSpark` holds a loaded drafter (config, the network, its weights); `Model.draft` carries one beside a target,
and `lingjax.generate(..., spec="dspark")` uses it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.sampling import SamplingParams, processed_logits
from lingjax.sharding import path_keys
from lingjax.spec.drafters import Proposal, TargetRows
from lingjax.spec.dspark_model import DSparkConfig, DSparkConfigError, DSparkDraft, abstract_draft

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DSparkState:
    k: jax.Array  # [L, capacity, G, d]: each draft layer's context keys (normed, roped) by position
    v: jax.Array  # [L, capacity, G, d]: its context values


@functools.lru_cache(maxsize=16)
def _graphdef(cfg: DSparkConfig, dtype: str):
    return nnx.split(abstract_draft(cfg, DTYPES[dtype]))[0]


@dataclasses.dataclass(frozen=True)
class DSparkDrafter:
    """The DSpark drafter of lingjax.spec.drafters' interface. steps: drafts verified a round (1..block_size);
    min_survival: of those, the leading ones whose survival probability is at least this count (the limit is a
    stopping time of the draft's own confidences, so sampled rounds stay lossless: docs/dspark.md)."""

    cfg: DSparkConfig
    dtype: str = "bfloat16"
    steps: int = 0  # 0: block_size
    min_survival: float = 1e-6

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        steps = self.steps or self.cfg.block_size
        if not 1 <= steps <= self.cfg.block_size:
            raise ValueError(f"a DSpark round verifies 1..{self.cfg.block_size} drafts (its block size), got {steps}")
        object.__setattr__(self, "steps", steps)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    def params_of(self, model):
        draft = getattr(model, "draft", None)
        if draft is None:
            raise ValueError(f"{model.source or 'this model'} has no DSpark drafter: lingjax.load(..., draft=DIR)")
        if draft.cfg != self.cfg or draft.dtype != self.dtype:
            raise ValueError("this DSparkDrafter was made for another drafter than the model's")
        return draft.params

    def _net(self, params) -> DSparkDraft:
        return nnx.merge(_graphdef(self.cfg, self.dtype), params)

    def init(self, module, capacity: int) -> DSparkState:
        c = self.cfg
        shape = (c.num_layers, capacity, c.num_kv_heads, c.head_dim)
        return DSparkState(k=jnp.zeros(shape, DTYPES[self.dtype]), v=jnp.zeros(shape, DTYPES[self.dtype]))

    def _write_context(self, params, state: DSparkState, rows: TargetRows) -> DSparkState:
        positions = rows.start + jnp.arange(rows.features.shape[0], dtype=jnp.int32)
        k, v = self._net(params).context_kv(rows.features, positions)

        def put(cache, new):
            return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), rows.start, 1)

        return DSparkState(k=put(state.k, k), v=put(state.v, v))

    def prefill(self, module, params, state, rows: TargetRows, next_token, ex):
        return self._write_context(params, state, rows)

    def extend(self, module, params, state, rows: TargetRows, n, ex):
        return self._write_context(params, state, rows)

    def propose(self, module, params, state: DSparkState, bonus, s, key, sampling: SamplingParams, ex):
        net, c = self._net(params), self.cfg
        tokens = jnp.full((c.block_size,), c.mask_token_id, jnp.int32).at[0].set(bonus)
        positions = s + jnp.arange(c.block_size, dtype=jnp.int32)
        visible = jnp.arange(state.k.shape[1]) < s
        h = net.blocks(module.embed_tokens(tokens)[None], positions[None], state.k, state.v, visible[None])[0]
        base = ex.gather_vocab(module.lm_logits(h, pad_small=False, ex=ex))  # [γ, V] f32: U_1..U_γ
        drafts, probs, conf = markov_chain(net, base, h, bonus, key, sampling, c.markov_topk)
        survival = jnp.cumprod(jax.nn.sigmoid(conf))  # [γ]: a_k
        s_ = self.steps
        limit = jnp.sum(survival[:s_] >= self.min_survival).astype(jnp.int32)  # a_k does not increase with k
        return Proposal(drafts=drafts[:s_], probs=None if probs is None else probs[:s_], limit=limit,
                        report=survival), state


def markov_chain(net: DSparkDraft, base, h, first, key, sampling: SamplingParams, topk: int = 0):
    """The Markov head and the confidence head, left to right over a block: base [γ, V] f32 (U_k), h [γ, D]
    (the block's final hidden rows), first: x_0 (the anchor); topk > 0: each draft from the topk best base logits
    alone (DSparkConfig.markov_topk). -> (drafts [γ] int32, the distributions they were drawn from [γ, V] f32 or
    None when greedy, confidence logits [γ] f32). Only the drafts are sequential: the confidences, which need
    x_{k-1} alone, are one batched product after them."""
    if sampling.greedy and 0 < topk <= TABLE_CANDIDATES:
        drafts, probs = greedy_topk_chain(net, base, first, topk), None
    else:
        drafts, probs = _sequential_chain(net, base, first, key, sampling, topk)
    prev = jnp.concatenate([jnp.reshape(first, (1,)).astype(jnp.int32), drafts[:-1]])
    return drafts, probs, net.confidence_logit(h, net.markov_code(prev))


# greedy with at most this many candidates a row: the chain's choices tabulated in parallel (γ·K² scores)
TABLE_CANDIDATES = 64


def greedy_topk_chain(net: DSparkDraft, base, first, topk: int):
    """Greedy drafts over each row's topk best base logits, the sequential argmax chain replaced by a table:
    best[k, i] = the candidate of row k that follows candidate i of row k-1 (one batched product of every pair's
    Markov term), then γ - 1 lookups. The same drafts as the sequential chain (up to the rounding of ties), in a
    few kernels instead of several per row. base [γ, V] f32, first: x_0 -> drafts [γ] int32."""
    gamma = base.shape[0]
    candidates = jax.lax.top_k(base, topk)[1]  # [γ, K]
    cand_base = jnp.take_along_axis(base, candidates, 1)  # [γ, K]
    first_scores = cand_base[0] + net.markov_bias(net.markov_code(first), candidates[0])
    # [γ-1, K, K]: candidate i of row k-1 (its code) against candidate j of row k
    pair = net.markov_bias(net.markov_code(candidates[:-1]), candidates[1:, None, :])
    best = jnp.argmax(cand_base[1:, None, :] + pair, -1).astype(jnp.int32)  # [γ-1, K]
    picks = [jnp.argmax(first_scores).astype(jnp.int32)]
    for k in range(gamma - 1):
        picks.append(best[k, picks[-1]])
    return candidates[jnp.arange(gamma), jnp.stack(picks)].astype(jnp.int32)


def _sequential_chain(net: DSparkDraft, base, first, key, sampling: SamplingParams, topk: int):
    """markov_chain's drafts one row after another -> (drafts [γ] int32, distributions [γ, V] or None)."""
    prev, drafts, probs = first, [], []
    keys = jax.random.split(key, base.shape[0])
    if topk:
        candidates = jax.lax.top_k(base, topk)[1]  # [γ, K]
    for k in range(base.shape[0]):
        code = net.markov_code(prev)
        if topk:  # the candidates' logits [K]; the full vocabulary only for a sample's distribution
            chosen = base[k][candidates[k]] + net.markov_bias(code, candidates[k])
            if sampling.greedy:
                prev = candidates[k][jnp.argmax(chosen)].astype(jnp.int32)
                drafts.append(prev)
                continue
            logits = jnp.full_like(base[k], -jnp.inf).at[candidates[k]].set(chosen)
        else:
            logits = base[k] + net.markov_bias(code)
        if sampling.greedy:
            prev = jnp.argmax(logits).astype(jnp.int32)
        else:
            processed = processed_logits(logits, sampling)
            prev = jax.random.categorical(keys[k], processed).astype(jnp.int32)
            probs.append(jax.nn.softmax(processed))
        drafts.append(prev)
    return jnp.stack(drafts).astype(jnp.int32), (jnp.stack(probs) if probs else None)


# ---- a loaded drafter -------------------------------------------------------------------------------
class DSpark:
    """A DSpark drafter on the device: its config, network and weights (nnx.State, replicated under TP)."""

    def __init__(self, net: DSparkDraft, source: str = ""):
        self.cfg: DSparkConfig = net.cfg
        self.dtype = jnp.dtype(net.dtype).name
        self.source = source
        self.params = nnx.split(net)[1]

    @property
    def net(self) -> DSparkDraft:
        return nnx.merge(_graphdef(self.cfg, self.dtype), self.params)

    def with_markov_topk(self, topk: int) -> DSpark:
        """The same drafter (its weights shared) drafting from each row's `topk` best base logits (0: all)."""
        other = copy.copy(self)
        other.cfg = dataclasses.replace(self.cfg, markov_topk=topk)
        return other

    def drafter(self, steps: int = 0, min_survival: float = 1e-6) -> DSparkDrafter:
        return DSparkDrafter(self.cfg, self.dtype, steps, min_survival)

    def num_params(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self.params))


def random_dspark(cfg: DSparkConfig, dtype: str = "bfloat16", seed: int = 0) -> DSpark:
    return DSpark(DSparkDraft(cfg, dtype=DTYPES[dtype], rngs=nnx.Rngs(seed)), source=f"random (seed {seed})")


def default_config(target_cfg, block_size: int = 8, num_layers: int = 2, markov_rank: int = 64,
                   mask_token_id: int | None = None) -> DSparkConfig:
    """A drafter shaped for a target (lingjax.config.LingConfig): its hidden size, heads of 64, an MLP of 8/3 D
    (rounded to 64), target layers spread over the stack as DFlash spreads them (the first, the last, and
    evenly between), the mask token the last id unless given."""
    n = target_cfg.num_hidden_layers
    layers = sorted({round(1 + i * (n - 2) / 2) for i in range(3)}) if n > 2 else list(range(n))
    d = target_cfg.hidden_size
    heads = max(1, d // 64)
    return DSparkConfig(block_size=block_size, target_layer_ids=tuple(layers),
                        mask_token_id=target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
                        markov_rank=markov_rank, num_layers=num_layers, hidden_size=d, num_heads=heads,
                        num_kv_heads=heads, head_dim=d // heads, intermediate_size=max(64, (8 * d // 3) // 64 * 64),
                        vocab_size=target_cfg.vocab_size, rms_norm_eps=target_cfg.rms_norm_eps)


# ---- checkpoint: config.json + model.safetensors --------------------------------------------------
def tensor_names(cfg: DSparkConfig) -> dict[str, tuple[tuple, tuple[int, ...]]]:
    """checkpoint name -> (parameter path, shape): the one name table of a DSpark draft checkpoint."""
    d, g, h, hd, i = cfg.hidden_size, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    table = {
        "fc.weight": (("fc",), (d, cfg.feature_size)),
        "hidden_norm.weight": (("hidden_norm",), (d,)),
        "norm.weight": (("norm",), (d,)),
        "markov_head.markov_w1.weight": (("markov_w1",), (cfg.vocab_size, cfg.markov_rank)),
        "markov_head.markov_w2.weight": (("markov_w2",), (cfg.vocab_size, cfg.markov_rank)),
        "confidence_head.proj.weight": (("confidence_w",), (1, d + cfg.markov_rank)),
        "confidence_head.proj.bias": (("confidence_b",), (1,)),
    }
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        table.update({
            p + "input_layernorm.weight": (("layers", n, "input_norm"), (d,)),
            p + "self_attn.q_proj.weight": (("layers", n, "q_proj"), (h * hd, d)),
            p + "self_attn.k_proj.weight": (("layers", n, "k_proj"), (g * hd, d)),
            p + "self_attn.v_proj.weight": (("layers", n, "v_proj"), (g * hd, d)),
            p + "self_attn.o_proj.weight": (("layers", n, "o_proj"), (d, h * hd)),
            p + "self_attn.q_norm.weight": (("layers", n, "q_norm"), (hd,)),
            p + "self_attn.k_norm.weight": (("layers", n, "k_norm"), (hd,)),
            p + "post_attention_layernorm.weight": (("layers", n, "post_norm"), (d,)),
            p + "mlp.gate_proj.weight": (("layers", n, "gate_proj"), (i, d)),
            p + "mlp.up_proj.weight": (("layers", n, "up_proj"), (i, d)),
            p + "mlp.down_proj.weight": (("layers", n, "down_proj"), (d, i)),
        })
    return table


def save_dspark(draft: DSpark, out_dir: str | Path) -> Path:
    """Write config.json and model.safetensors (the name table's names; dtype as held)."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_path = {path: name for name, (path, _) in tensor_names(draft.cfg).items()}
    tensors = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(draft.params)):
        tensors[by_path[path_keys(path)]] = np.asarray(jax.device_get(leaf))
    (out / CONFIG_FILE).write_text(json.dumps({**draft.cfg.to_hf(), "torch_dtype": draft.dtype}, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE))
    return out


def read_dspark_config(directory: str | Path) -> DSparkConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise DSparkConfigError(f"{directory}: no {CONFIG_FILE} (not a DSpark draft checkpoint)")
    try:
        return DSparkConfig.from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise DSparkConfigError(f"{path}: not JSON ({e})") from None


def load_dspark(directory: str | Path, dtype: str = "bfloat16", target_cfg=None) -> DSpark:
    """A DSpark draft checkpoint -> DSpark. Every tensor is checked against the name table (missing, unexpected,
    mis-shaped, a dtype other than F32/BF16) before any is read; a problem raises lingjax.checkpoint.CheckpointError
    naming the tensor and the file. target_cfg: the target's config, checked against the draft's."""
    from safetensors import safe_open

    from lingjax.checkpoint import CheckpointError

    directory = Path(directory)
    cfg = read_dspark_config(directory)
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no .safetensors file")
    table = tensor_names(cfg)
    with contextlib.ExitStack() as stack:  # each file opened once: headers checked first, then the data read
        handles = {f: stack.enter_context(safe_open(str(f), framework="flax")) for f in files}
        where: dict[str, Path] = {}
        stored: dict[str, str] = {}  # name without a leading "model." -> the name in its file
        for f, handle in handles.items():
            for key in handle.keys():
                name = key.removeprefix("model.")
                if name in where:
                    raise CheckpointError(f"{name}: in both {where[name].name} and {f.name}")
                where[name], stored[name] = f, key
        # the shared embeddings and head may be stored with the draft: the target's are used
        extra = sorted(set(where) - set(table) - {"embed_tokens.weight", "lm_head.weight"})
        if extra:
            raise CheckpointError(f"{extra[0]} ({where[extra[0]].name}): not a tensor of this DSpark config")
        missing = sorted(set(table) - set(where))
        if missing:
            raise CheckpointError(f"{missing[0]}: missing from {directory}")
        for name, (_, shape) in table.items():
            sl = handles[where[name]].get_slice(stored[name])
            if tuple(sl.get_shape()) != shape or sl.get_dtype() not in ("F32", "BF16"):
                raise CheckpointError(f"{name} ({where[name].name}): {sl.get_dtype()} {sl.get_shape()}, expected "
                                      f"F32 or BF16 {list(shape)}")
        graphdef, state = nnx.split(abstract_draft(cfg, DTYPES[dtype]))
        name_of = {path: name for name, (path, _) in table.items()}
        pure = nnx.to_pure_dict(state)
        leaves = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(pure):
            name = name_of[path_keys(path)]
            leaves.append(jnp.asarray(handles[where[name]].get_tensor(stored[name]), leaf.dtype))
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(jax.tree.structure(pure), leaves))
    return DSpark(nnx.merge(graphdef, state), source=str(directory))


# ---- verify widths chosen on the host -------------------------------------------------------------------
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
    from lingjax.config import MOE
    from lingjax.model import abstract_model, param_count

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


def ling_shaped_config(target_cfg, block_size: int = 8, markov_topk: int = 0) -> DSparkConfig:
    """A drafter of the released Ling-3.0-flash DSpark draft's published shape (docs/dspark.md: 5 layers of 32
    heads of 128, MLP 6144, Markov rank 256, 8 drafts a block) for a target of any depth: the target layers are
    Ling's 1, 11, 23, 29, 35 on a 42-layer target, spread the same way over another. For timing rounds with
    random weights."""
    n = target_cfg.num_hidden_layers
    layers = (1, 11, 23, 29, 35) if n == 42 else tuple(sorted({min(n - 1, round(f * (n - 1))) for f in
                                                              (1 / 41, 11 / 41, 23 / 41, 29 / 41, 35 / 41)}))
    return DSparkConfig(block_size=block_size, target_layer_ids=layers, mask_token_id=target_cfg.vocab_size - 1,
                        markov_rank=256, num_layers=5, hidden_size=target_cfg.hidden_size, num_heads=32,
                        num_kv_heads=32, head_dim=128, intermediate_size=6144, vocab_size=target_cfg.vocab_size,
                        rms_norm_eps=target_cfg.rms_norm_eps, markov_topk=markov_topk)


def propose_bytes(cfg: DSparkConfig, ctx: int, itemsize: int = 2) -> float:
    """The bytes a DSpark propose reads at batch 1 besides the target's lm_head: its layers, fc and norms, the
    context keys and values of `ctx` positions, W1's rows of the γ previous tokens and W2's rows the Markov head
    reads (all of it per draft, or markov_topk rows)."""
    d, h, g, hd, i, r = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                         cfg.markov_rank)
    layer = (h * hd * d + 2 * g * hd * d + d * h * hd + 3 * i * d) + 2 * hd + 2 * d
    cache = cfg.num_layers * 2 * ctx * g * hd
    w2_rows = cfg.markov_topk or cfg.vocab_size
    return (cfg.num_layers * layer + d * cfg.feature_size + 2 * d + cache + cfg.block_size * (1 + w2_rows) * r) * itemsize
