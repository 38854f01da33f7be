"""`python -m lingjax.train.dspark`: train a DSpark drafter for a target checkpoint by distillation
(docs/dspark.md).

    python -m lingjax.train.dspark --target TARGET_DIR --out RUN_DIR [--steps N] [--time-limit-s S]
        [--batch B] [--seq-len T] [--anchors A] [--block-size G] [--layers L] [--markov-rank R]
        [--intermediate I] [--lr LR] [--seed K] [--init DRAFT_DIR] [--export DIR] [--roots LABEL=PATH ...]

The target is frozen: its training forward (lingjax.train.forward, bf16) gives, for each sequence of a batch,
the residual streams after the drafter's target layers (its context) and the target's next-token distribution at
every position. Each sequence takes `anchors` blocks at distinct random positions a: the block [x_a, MASK...] at
positions a..a+γ-1 sees the context before a (lingjax.spec.dspark_model, the network inference runs). Row j of a
block (j = 0..γ-1) is scored against x_{a+j+1} and the target's distribution p_t at position a+j; its Markov input
is the ground-truth x_{a+j} (teacher forcing).

    loss = 0.1·CE + 0.9·L1 + 1.0·BCE - ACCEPT_WEIGHT·E/γ

CE, L1 = ||p_d - p_t||_1 (twice the total variation) and BCE are DSpark's, weighted by exp(-j/4) per row; the
confidence head's target is 1 - L1/2 (the probability that speculative sampling accepts the row's draft given
the rows before it were accepted), detached. E = Σ_k Π_{j<k} (1 - L1_j/2), per block, is the expected number of
drafts speculative sampling accepts from the block when every row's draft follows the row's own distribution: the
acceptance-aware term optimises it directly, which DSpark's per-row terms only bound (an early row's error costs
every later row's tokens; E prices that).

Repeating the command with the same --out resumes the run to --steps (the run's options must match); the final
step writes the drafter in its checkpoint layout (lingjax.spec.dspark_io.save_dspark) to --export (default
RUN_DIR/export) and loads it back beside the target. The command's scaffolding (the parser base, the reporter,
the error path, the time-limit rule, saving and evaluation) is lingjax.train.command's and lingjax.train.report's,
shared with `python -m lingjax.train`; its data comes from lingjax.train.prepare's corpus, encoding and cache.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lingjax
from lingjax.checkpoint import load_safetensors
from lingjax.config import VERIFY_ROWS, LingConfig
from lingjax.shipped import default_checkpoint
from lingjax.spec.dspark import DSpark, abstract_draft, default_config
from lingjax.spec.dspark_io import load_dspark, save_dspark
from lingjax.spec.dspark_model import DSparkDraft
from lingjax.train import bpe, checkpointing, command, corpus, data, forward, optim, prepare
from lingjax.train.command import EXPORT_DIR, SMOKE_PROMPT, CommandError
from lingjax.train.report import Reporter

PROG = "lingjax.train.dspark"
F32 = jnp.float32
CE_WEIGHT, L1_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0  # DSpark's
ACCEPT_WEIGHT = 0.5
ROW_DECAY = 4.0  # row j weighs exp(-j / ROW_DECAY)


@dataclasses.dataclass(frozen=True)
class DraftRunConfig:
    """Everything that decides a drafter run's trajectory; a resume must match it."""

    target_sha: str  # the target's weights (sha256 of its safetensors index or file)
    block_size: int = 8
    num_layers: int = 3
    markov_rank: int = 64
    intermediate_size: int = 512
    mask_token_id: int | None = None  # None: lingjax.spec.dspark.default_config's
    batch: int = 32
    seq_len: int = 1024
    anchors: int = 64
    seed: int = 0
    optim: optim.OptimConfig = optim.OptimConfig(lr=1e-3, warmup_steps=100, total_steps=2000, weight_decay=0.01)
    accept_weight: float = ACCEPT_WEIGHT
    init_sha: str = ""  # the drafter the run starts from (--init: sha256 of its weights); "" for a fresh one

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def draft_config(rc: DraftRunConfig, target_cfg):
    cfg = default_config(target_cfg, block_size=rc.block_size, num_layers=rc.num_layers, markov_rank=rc.markov_rank,
                         mask_token_id=rc.mask_token_id)
    return dataclasses.replace(cfg, intermediate_size=rc.intermediate_size)


# ---- the target, frozen --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    cfg: object  # LingConfig
    params: dict  # bf16 compute copies (forward.cast_params), lm_head included
    biases: jax.Array


jax.tree_util.register_dataclass(Target, data_fields=["params", "biases"], meta_fields=["cfg"])


def load_target(directory: Path) -> Target:
    cfg = LingConfig.from_file(directory / "config.json")
    model = load_safetensors(directory, cfg, F32)
    params, biases = forward.from_model(model, tied=False)
    return Target(cfg=cfg, params=forward.cast_params(params, cfg, jnp.bfloat16), biases=biases)


def weights_sha(directory: Path) -> str:
    """16 hex digits of sha256 over a checkpoint directory's safetensors files (names and contents)."""
    h = hashlib.sha256()
    for f in sorted(directory.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


# ---- the objective ---------------------------------------------------------------------------------------
def sample_anchors(key, batch: int, seq_len: int, anchors: int, block: int) -> jax.Array:
    """int32 [batch, anchors]: per sequence, distinct positions a with a + block <= seq_len (every row's label
    x_{a+j+1} lies inside the window of seq_len + 1 tokens), sorted."""
    keys = jax.random.split(key, batch)
    pick = lambda k: jnp.sort(jax.random.choice(k, seq_len - block + 1, (anchors,), replace=False))  # noqa: E731
    return jax.vmap(pick)(keys).astype(jnp.int32)


def block_terms(graphdef, draft_params, target: Target, batch, anchors, block_cfg):
    """The per-row quantities of every block: batch int32 [B, T + 1], anchors [B, nb] -> dict of [B, nb, γ]
    arrays: ce, l1, bce, conf (the confidence logit), match (draft argmax == target argmax)."""
    tcfg, cfg = target.cfg, block_cfg
    g = cfg.block_size
    t = batch.shape[1] - 1
    inputs = batch[:, :t]
    hidden, _, features = forward.forward_features(target.params, target.biases, inputs, tcfg,
                                                   capture=cfg.target_layer_ids)
    hidden, features = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(features)
    net = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(jnp.bfloat16) if p.ndim > 1 else p, draft_params))
    embed, head = target.params["embed"], forward.head_weight(target.params)
    rows = anchors[..., None] + jnp.arange(g)  # [B, nb, γ]: positions a+j

    def one(feats, tokens, a, pos):
        k_ctx, v_ctx = net.context_kv(feats, jnp.arange(t, dtype=jnp.int32))
        blk = jnp.full(pos.shape, cfg.mask_token_id, jnp.int32).at[:, 0].set(tokens[a])
        visible = jnp.arange(t)[None, :] < a[:, None]
        return net.blocks(embed[blk], pos, k_ctx, v_ctx, visible)

    h = jax.vmap(one)(features, batch, anchors, rows)  # [B, nb, γ, D]
    take = jax.vmap(lambda x, r: x[r])
    prev, labels = take(batch, rows), take(batch, rows + 1)  # x_{a+j}, x_{a+j+1}
    code = net.markov_code(prev)
    logits = jnp.einsum("bnjd,vd->bnjv", h, head, preferred_element_type=F32) + net.markov_bias(code)
    # the target's distribution once per position (overlapping blocks share positions), then each row's
    t_probs = jax.nn.softmax(jnp.einsum("btd,vd->btv", hidden, head, preferred_element_type=F32), -1)
    p_t = take(t_probs, rows)  # [B, nb, γ, V]
    logp_d = jax.nn.log_softmax(logits, -1)
    p_d = jnp.exp(logp_d)
    l1 = jnp.sum(jnp.abs(p_d - p_t), -1)
    ce = -jnp.take_along_axis(logp_d, labels[..., None], -1)[..., 0]
    conf = net.confidence_logit(h, code)
    c_target = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    bce = jnp.maximum(conf, 0) - conf * c_target + jnp.log1p(jnp.exp(-jnp.abs(conf)))
    match = jnp.argmax(logits, -1) == jnp.argmax(p_t, -1)
    return {"ce": ce, "l1": l1, "bce": bce, "conf": conf, "match": match}


def loss_and_metrics(draft_params, graphdef, target: Target, batch, anchors, block_cfg, accept_weight: float):
    terms = block_terms(graphdef, draft_params, target, batch, anchors, block_cfg)
    g = block_cfg.block_size
    w = jnp.exp(-jnp.arange(g, dtype=F32) / ROW_DECAY)
    mean_w = lambda x: jnp.mean(jnp.sum(x * w, -1) / jnp.sum(w))  # noqa: E731
    accept_p = jnp.clip(1.0 - 0.5 * terms["l1"], 0.0, 1.0)
    expected = jnp.sum(jnp.cumprod(accept_p, -1), -1)  # [B, nb]: E, drafts accepted by speculative sampling
    greedy = jnp.sum(jnp.cumprod(terms["match"].astype(F32), -1), -1)  # teacher-forced argmax agreement run
    loss = (CE_WEIGHT * mean_w(terms["ce"]) + L1_WEIGHT * mean_w(terms["l1"]) + BCE_WEIGHT * mean_w(terms["bce"])
            - accept_weight * jnp.mean(expected) / g)
    survival = jnp.cumprod(jax.nn.sigmoid(terms["conf"]), -1)
    return loss, {"loss": loss, "ce": mean_w(terms["ce"]), "l1": mean_w(terms["l1"]), "bce": mean_w(terms["bce"]),
                  "expected_accept": 1 + jnp.mean(expected), "greedy_run": 1 + jnp.mean(greedy),
                  "predicted_accept": 1 + jnp.mean(jnp.sum(survival, -1))}


@functools.lru_cache(maxsize=4)
def programs(rc: DraftRunConfig, block_cfg, graphdef):
    """(train step, evaluation), jitted: step(state, target, batch) -> (state, metrics); evaluate(params, target,
    batch, anchors) -> metrics."""
    tx = optim.build(rc.optim)

    def step(state, target, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        anchors = sample_anchors(key, batch.shape[0], batch.shape[1] - 1, rc.anchors, block_cfg.block_size)
        (_, metrics), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(
            state["params"], graphdef, target, batch, anchors, block_cfg, rc.accept_weight)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
        metrics["grad_norm"] = optim.optax.tree.norm(grads)
        return {**state, "params": params, "opt": opt, "step": state["step"] + 1}, metrics

    def evaluate(params, target, batch, anchors):
        return loss_and_metrics(params, graphdef, target, batch, anchors, block_cfg, rc.accept_weight)[1]

    return jax.jit(step, donate_argnums=0), jax.jit(evaluate)


def init_state(rc: DraftRunConfig, block_cfg) -> tuple[object, dict]:
    """(graphdef, state): f32 masters of a fresh drafter, the optimizer's state, the step and the rng."""
    graphdef, st = nnx.split(DSparkDraft(block_cfg, dtype=F32, rngs=nnx.Rngs(rc.seed)))
    params = nnx.to_pure_dict(st)
    key = jax.random.fold_in(jax.random.key(rc.seed), 7)
    return graphdef, {"params": params, "opt": optim.build(rc.optim).init(params), "step": jnp.int32(0),
                      "biases": jnp.zeros((1,), F32),  # unused: the checkpoint format has biases
                      "rng": jax.random.key_data(key)}


# ---- the command ---------------------------------------------------------------------------------------
def parse_args(argv):
    """The command line -> (namespace, DraftRunConfig); every check that needs no data (CommandError on the first
    failure). The namespace's target is resolved (the shipped model by default) and its roots parsed."""
    d = DraftRunConfig(target_sha="")
    p = command.Parser(PROG, "Train a DSpark drafter for a target (docs/dspark.md).")
    p.add_argument("--target", type=Path, default=None, help="the target checkpoint (default: the shipped model)")
    p.add_common("--out", help="the run directory (resumed when it holds a checkpoint)")
    p.add_common("--steps", default=d.optim.total_steps)
    p.add_common("--time-limit-s", help="stop early enough to save within this")
    p.add_common("--batch", default=d.batch)
    p.add_common("--seq-len", default=d.seq_len)
    p.add_argument("--anchors", type=int, default=d.anchors, help="blocks per sequence")
    p.add_argument("--block-size", type=int, default=d.block_size, help="γ, drafts a block proposes")
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--markov-rank", type=int, default=d.markov_rank)
    p.add_argument("--intermediate", type=int, default=d.intermediate_size)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_common("--lr", default=d.optim.lr)
    p.add_common("--warmup-steps", default=d.optim.warmup_steps)
    p.add_argument("--accept-weight", type=float, default=d.accept_weight)
    p.add_common("--seed")
    p.add_common("--log-every", default=50)
    p.add_argument("--init", type=Path, default=None, help="start from this drafter (a DSpark draft checkpoint of "
                   "the run's shape, its block size aside: no weight depends on it), e.g. to train the shipped one "
                   "further, or for longer blocks")
    p.add_common("--export", help="write the drafter here at the end of this call (default: RUN_DIR/export, at the "
                 "final step only)")
    p.add_common("--roots")
    a = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "anchors", "block_size", "layers", "markov_rank", "intermediate",
                 "log_every"):
        command.at_least(f"--{name.replace('_', '-')}", getattr(a, name))
    if a.block_size + 1 > VERIFY_ROWS:
        raise CommandError(f"--block-size {a.block_size}: the engine verifies at most {VERIFY_ROWS} rows (the "
                           f"anchor and {VERIFY_ROWS - 1} drafts); give --block-size <= {VERIFY_ROWS - 1}")
    if a.anchors > a.seq_len - a.block_size + 1:
        raise CommandError(f"--anchors {a.anchors} does not fit a sequence of {a.seq_len} with blocks of "
                           f"{a.block_size}")
    command.positive("--lr", a.lr)
    if a.target is None:
        a.target = default_checkpoint()
    if not (a.target / "config.json").is_file() or not (a.target / "tokenizer.json").is_file():
        raise CommandError(f"--target {a.target}: needs config.json and tokenizer.json (an HF checkpoint)")
    command.not_a_file("--out", a.out)
    command.not_a_file("--export", a.export)
    a.roots = command.parse_roots(a.roots)
    if a.init is not None and not (a.init / "config.json").is_file():
        raise CommandError(f"--init {a.init}: no config.json (not a DSpark draft checkpoint)")
    rc = DraftRunConfig(
        target_sha=weights_sha(a.target), block_size=a.block_size, num_layers=a.layers, markov_rank=a.markov_rank,
        intermediate_size=a.intermediate, mask_token_id=a.mask_token_id, batch=a.batch, seq_len=a.seq_len,
        anchors=a.anchors, seed=a.seed, accept_weight=a.accept_weight,
        init_sha=weights_sha(a.init) if a.init is not None else "",
        optim=dataclasses.replace(d.optim, lr=a.lr, warmup_steps=a.warmup_steps, total_steps=a.steps))
    return a, rc


def streams(a, rep: Reporter) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams of the corpus under the target's tokenizer, cached in RUN_DIR/cache
    (lingjax.train.prepare's cache, under a key of its own); CommandError when either is under one window."""
    tok_sha = hashlib.sha256((a.target / "tokenizer.json").read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps({"tokenizer": tok_sha, "seed": a.seed, "format": "dspark/1",
                                     "roots": {k: str(Path(v).resolve()) for k, v in sorted(a.roots.items())}},
                                    sort_keys=True).encode()).hexdigest()
    cached = prepare.load_cache(a.out, key)
    if cached is not None:
        rep.say(f"data: cached streams: {len(cached['train'])} train tokens, {len(cached['held_out'])} held out")
        train, held = cached["train"], cached["held_out"]
    else:
        found = prepare.collect_corpus(a.roots, rep)
        tok = bpe.load_tokenizer(a.target)
        train = prepare.encode_stream(tok, data.shuffled_files(found.train, seed=a.seed), "train", rep).tokens
        held = prepare.encode_stream(tok, found.held_out, "held-out", rep).tokens
        prepare.save_cache(a.out, key, train, held, {})
    for name, tokens in (("train", train), ("held-out", held)):
        if tokens.size < a.seq_len + 1:
            raise CommandError(f"the {name} stream holds {tokens.size} tokens, under one window of {a.seq_len + 1}: "
                               f"give --roots with more source (held out: the stdlib packages "
                               f"{', '.join(corpus.HELD_OUT_PACKAGES)})")
    return train, held


def initial_params(init: Path, target_cfg, block_cfg) -> dict:
    """--init's drafter as f32 masters; CommandError when it is of another shape than the run's (block size
    aside)."""
    start = load_dspark(init, "float32", target_cfg)
    if dataclasses.replace(start.cfg, block_size=block_cfg.block_size) != block_cfg:
        raise CommandError(f"--init {init} is a drafter of another shape ({start.cfg}) than this run's ({block_cfg})")
    return jax.tree.map(lambda p: jnp.asarray(p, F32), nnx.to_pure_dict(start.params))


def train(a, rc: DraftRunConfig, rep: Reporter, step_fn, state: dict, target: Target, batches, start: int):
    """The steps of this call, from start to the final step or the time limit (command.TimeBudget: the time at
    the last sync, the steps in flight and the next one at the step time measured between syncs, then the
    evaluation, save and export that follow); a log line every --log-every steps. -> (state, the step reached)."""
    total = rc.optim.total_steps
    budget = command.TimeBudget(a.time_limit_s)
    exports = a.export is not None or total > start
    reserve_s = command.save_reserve_s(state) + (command.EXPORT_RESERVE_S if exports else 0.0)
    step = start
    step_s, synced_s, synced_step = 0.0, rep.elapsed(), start  # the step time, as of the last sync
    log_t, log_step = time.perf_counter(), start

    def end_s() -> float:  # the steps in flight, the next one, and an evaluation (about a step) with the reserve
        return synced_s + (step - synced_step + 2) * step_s + reserve_s

    while step < total and not budget.exhausted(step - start, end_s):
        state, metrics = step_fn(state, target, jnp.asarray(batches.batch(step)))
        step += 1
        logs = step % a.log_every == 0 or step == total
        if not logs and step - start > 2:  # the first two steps are synced alone: compile, then a steady step
            continue
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now_s = rep.elapsed()
        step_s, synced_s, synced_step = (now_s - synced_s) / (step - synced_step), now_s, step
        if logs:
            now = time.perf_counter()
            rate = (step - log_step) * rc.batch * rc.seq_len / (now - log_t)
            rep.report("train", f"step {step}: loss {m['loss']:.4f} ce {m['ce']:.3f} l1 {m['l1']:.3f} bce "
                       f"{m['bce']:.3f} E[accept] {m['expected_accept']:.2f} greedy run {m['greedy_run']:.2f} "
                       f"predicted {m['predicted_accept']:.2f} | {rate / 1e3:.0f}k tok/s", step=step, **m)
            log_t, log_step = now, step
    return state, step


def export(a, block_cfg, params, rep: Reporter) -> Path:
    """The drafter in its checkpoint layout (bf16), loaded back beside the target as a check."""
    out = a.export or a.out / EXPORT_DIR
    bf16_graphdef, abstract = nnx.split(abstract_draft(block_cfg, jnp.bfloat16))
    pure = jax.tree.map(lambda p, want: jnp.asarray(p, want.dtype), params, nnx.to_pure_dict(abstract))
    save_dspark(DSpark(nnx.merge(bf16_graphdef, pure)), out)
    model = lingjax.load(a.target, draft=out)
    result = lingjax.generate(model, SMOKE_PROMPT, 24, spec="dspark")
    rep.say(f"export: {out}; greedy DSpark completion of {SMOKE_PROMPT!r}: {result.text!r}, mean accept length "
            f"{result.mean_accept_len:.2f}")
    return out


@command.one_line_errors(PROG)
def main(argv=None) -> int:
    """The command (module docstring); -> exit status: 0, or 2 after one `lingjax.train.dspark: error:` line."""
    t0 = time.perf_counter()
    a, rc = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rep = Reporter(a.out, t0)
    target = load_target(a.target)
    block_cfg = draft_config(rc, target.cfg)
    graphdef, state = init_state(rc, block_cfg)
    if a.init is not None:
        state["params"] = initial_params(a.init, target.cfg, block_cfg)
    record = {"run": {**rc.to_json(), "optim": dataclasses.asdict(rc.optim)}}
    if checkpointing.latest(a.out) is not None:
        at, restored, _ = checkpointing.restore(a.out, state, expect={**record, "data": {}})
        # the step on the device the restored arrays are on (committed, as every later step's is: an uncommitted
        # step would make the second call's arguments differ from the first's, and compile the step again)
        state = {**restored, "step": jax.device_put(jnp.int32(at), restored["rng"].sharding)}
    train_tokens, held_tokens = streams(a, rep)
    batches = data.PackedBatches(train_tokens, rc.batch, rc.seq_len - 1, rc.seed)  # [B, seq_len + 1] windows
    step_fn, eval_fn = programs(rc, block_cfg, graphdef)
    held = data.PackedBatches(held_tokens, rc.batch, rc.seq_len - 1, rc.seed + 1).batch(0)
    held_anchors = sample_anchors(jax.random.key(rc.seed + 1), rc.batch, rc.seq_len, rc.anchors, rc.block_size)
    start = int(jax.device_get(state["step"]))
    rep.say(f"drafter: {block_cfg}; {sum(x.size for x in jax.tree.leaves(state['params']))} parameters; "
            f"step {start} of {rc.optim.total_steps}")
    state, step = train(a, rc, rep, step_fn, state, target, batches, start)
    (ev,), _ = command.evaluate(eval_fn, [(state["params"], target, jnp.asarray(held), held_anchors)])
    ev = {k: float(v) for k, v in ev.items()}
    rep.report("eval", "held out: " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()), step=step, **ev)
    command.save(rep, a.out, step, state, {**record, "data": {}, "progress": {"held_out": ev}})
    if step >= rc.optim.total_steps or a.export is not None:
        export(a, block_cfg, state["params"], rep)
    rep.last_line({"step": step, "total": rc.optim.total_steps, "held_out": ev, "seconds": round(rep.elapsed(), 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
