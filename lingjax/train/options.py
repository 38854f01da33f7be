"""The flags of `python -m lingjax.train` (docs/training.md) and every check on them that needs no data:

    opts = parse_args(["--out", "runs/embedded", "--steps", "10000"])   # CommandError on the first bad one

Options holds the run's identity (a step.RunConfig: config, batch, sequence length, seed, optimizer, remat),
which a resume must match, beside how this call runs (time limit, evaluation, log and save cadence, export
directory, corpus roots), which may change from call to call.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lingjax.train import command, model_config, optim, step
from lingjax.train.command import CommandError, Parser, at_least, parse_roots

PROG = "lingjax.train"


def parser() -> Parser:
    defaults = optim.OptimConfig()
    p = Parser(PROG, "Start or resume a training run of the embedded code model (docs/training.md).")
    p.add_common("--out", help="the run directory (created; resumed when it holds a checkpoint)")
    p.add_argument("--config", default="embedded", choices=sorted(model_config.CONFIGS), help="model config")
    p.add_common("--steps", default=defaults.total_steps, help="total optimizer steps of the run (the schedule's "
                 "length)")
    p.add_common("--time-limit-s", help="stop this call early enough to save (and export) within this many seconds "
                 "of its start")
    p.add_common("--batch", default=step.RunConfig.batch, help="sequences per step")
    p.add_common("--seq-len", default=step.RunConfig.seq_len, help="tokens per sequence")
    p.add_common("--lr", default=defaults.lr, help="peak learning rate")
    p.add_common("--warmup-steps", default=defaults.warmup_steps)
    p.add_common("--seed", help="initialisation and data order")
    p.add_argument("--remat", action="store_true", help="recompute each layer's activations in the backward "
                   "pass (less memory, more time)")
    p.add_argument("--eval-every", type=int, default=500, help="held-out evaluation every N steps (and at "
                   "the end of each call)")
    p.add_common("--log-every", default=10, help="a log line every N steps")
    p.add_argument("--save-every-s", type=float, default=600.0, help="a checkpoint every S seconds (and at "
                   "the end of each call)")
    p.add_common("--export", metavar="EXPORT_DIR", help="export the HF layout here at the end of this call "
                 "(default: RUN_DIR/export, at the final step only)")
    p.add_common("--roots", help="corpus roots (default: this interpreter's stdlib and site-packages); the label "
                 "'stdlib' holds the held-out packages")
    return p


@dataclasses.dataclass(frozen=True)
class Options:
    """The parsed command: the run's identity (rc) and how this call runs."""

    rc: step.RunConfig
    out: Path
    roots: dict[str, Path]
    time_limit_s: float | None
    eval_every: int
    log_every: int
    save_every_s: float
    export: Path | None


def parse_args(argv: list[str] | None) -> Options:
    """The command line -> Options; every check that needs no data (CommandError on the first failure)."""
    a = parser().parse_args(argv)
    at_least("--steps", a.steps)
    at_least("--warmup-steps", a.warmup_steps, 0)
    at_least("--eval-every", a.eval_every)
    at_least("--log-every", a.log_every)
    command.positive("--lr", a.lr)
    if a.save_every_s <= 0:
        raise CommandError(f"--save-every-s must be > 0, got {a.save_every_s}")
    if a.time_limit_s is not None and not a.time_limit_s >= 0:
        raise CommandError(f"--time-limit-s must be >= 0, got {a.time_limit_s}")
    try:
        rc = step.RunConfig(config=a.config, batch=a.batch, seq_len=a.seq_len, seed=a.seed, remat=a.remat,
                            optim=optim.OptimConfig(lr=a.lr, warmup_steps=a.warmup_steps, total_steps=a.steps))
    except ValueError as e:
        raise CommandError(str(e)) from None
    max_len = model_config.config_dict(a.config)["max_position_embeddings"]
    if a.seq_len + 1 > max_len:
        raise CommandError(f"--seq-len {a.seq_len} does not fit the model's {max_len} positions")
    command.not_a_file("--out", a.out)
    command.not_a_file("--export", a.export)
    return Options(rc=rc, out=a.out, roots=parse_roots(a.roots), time_limit_s=a.time_limit_s,
                   eval_every=a.eval_every, log_every=a.log_every, save_every_s=a.save_every_s, export=a.export)
