"""`python -m lingjax.train`: the one command that starts or resumes a training run (docs/training.md).

    python -m lingjax.train --out RUN_DIR [--config embedded|small] [--steps N] [--time-limit-s S]
        [--batch B] [--seq-len T] [--lr LR] [--warmup-steps W] [--seed K] [--remat] [--eval-every N]
        [--log-every N] [--save-every-s S] [--export EXPORT_DIR] [--roots LABEL=PATH ...]

The same command, repeated with the same RUN_DIR and options, continues the run until it reaches --steps;
a call that reaches the final step exports the Hugging Face layout and checks it with lingjax.load. RUN_DIR:

    corpus_manifest.jsonl  the corpus (lingjax.train.corpus), written by the first call
    tokenizer/             the BPE tokenizer's HF files, trained on the train split by the first call
    lzma_bpb.json          lzma's bits per byte on the held-out bytes, computed once
    checkpoint/step_N/     the newest resume state (lingjax.train.checkpointing)
    log.jsonl              one JSON object per log line, evaluation and call summary
    cache/                 the encoded token streams: not carried between machines, rebuilt when absent
    export/                the HF checkpoint of the final step, unless --export names another directory

Everything but cache/ is small (under 60 MB for the embedded config), so the directory can be carried
between machines; the data fingerprint in the checkpoint makes a resume on a different corpus fail.
Errors before any work (bad flags, an --out that is a file, a resume with other options) are one line
`lingjax.train: error: ...` and exit status 2.

This module is the command: parse and check every flag (lingjax.train.options), then resume or start the
state, prepare the data (lingjax.train.prepare), train (lingjax.train.trainer), export (lingjax.train.export)
and print the summary. The scaffolding it shares with `python -m lingjax.train.dspark` (the parser base, the
reporter, the error path, the time-limit rule, saving and evaluation) is lingjax.train.command and
lingjax.train.report.
"""

from __future__ import annotations

import json
import os
import time

from lingjax import compilation_cache
from lingjax.train import bpe, checkpointing, command, model_config, optim, step
from lingjax.train.command import EXPORT_DIR
from lingjax.train.export import export_and_check, exported
from lingjax.train.options import PROG, Options, parse_args
from lingjax.train.prepare import LZMA_FILE, TOKENIZER_DIR, prepare_data
from lingjax.train.report import Reporter, mb, since
from lingjax.train.trainer import Trainer, run_identity


def _restore(opts: Options, found, rep: Reporter) -> tuple[int, dict, dict]:
    """The newest checkpoint, its run identity checked before any data work. -> (step, state, record)."""
    _, path = found
    record = checkpointing.read_record(path)
    checkpointing.check_identity(record, {"run": run_identity(opts.rc), "data": record.get("data", {})}, path)
    t = time.perf_counter()
    restored_step, state, record = checkpointing.restore(opts.out, step.abstract_state(opts.rc))
    rep.say(f"resume: step {restored_step} from {path} in {since(t)}")
    return restored_step, state, record


def run(opts: Options, t0: float) -> int:
    """One call of the command (module docstring) on parsed options; t0: when the call started (the time
    limit counts from it). -> exit status 0; CommandError or CheckpointMismatch for the one-line errors."""
    run_dir = opts.out
    run_dir.mkdir(parents=True, exist_ok=True)
    rep = Reporter(run_dir, t0)
    rc = opts.rc
    config = model_config.config_dict(rc.config)
    rep.say(f"run {run_dir}: config {rc.config}, batch {rc.batch} x {rc.seq_len}, {rc.optim.total_steps} steps, "
            f"lr {rc.optim.lr} (warm-up {rc.optim.warmup_steps})")
    found = checkpointing.latest(run_dir)
    if found is not None:
        start, state, record = _restore(opts, found, rep)
    else:
        start, state, record = 0, None, {}
    total = rc.optim.total_steps
    prior = record.get("progress", {})
    export_dir = opts.export or (run_dir / EXPORT_DIR)
    if start >= total:  # nothing to train: export if asked or not done yet, then the summary
        rep.say(f"the run is at its final step {start}")
        tok = bpe.load_tokenizer(run_dir / TOKENIZER_DIR)
        completion = None
        if opts.export is not None or not exported(export_dir):
            completion = export_and_check(export_dir, state, config, tok, rep)
        lzma = json.loads((run_dir / LZMA_FILE).read_text())["lzma_bpb"] if (run_dir / LZMA_FILE).exists() else None
        return _summary(rep, rc, start, 0, prior, None, prior.get("last_bpb"), lzma, "final_step",
                        export_dir if completion is not None else None, completion)
    run_data = prepare_data(opts, rep)
    if found is not None:  # the data part of the identity, now that the streams exist
        checkpointing.check_identity(record, {"run": run_identity(rc), "data": {"fingerprint": run_data.fingerprint}},
                                     found[1])
    else:
        t = time.perf_counter()
        state = step.init_state(rc)
        rep.say(f"init: fresh state ({mb(optim.tree_bytes(state))} resume state) in {since(t)}")
    trainer = Trainer(opts, run_data, state, start, found is not None, prior, rep)
    reason = trainer.run()
    p = trainer.p
    rep.say(f"stopped at step {p.step} ({reason}): {p.steps_done} steps this call in {p.loop_s:.1f} s")
    completion = None
    if opts.export is not None or p.step >= total:
        completion = export_and_check(export_dir, trainer.state, config, run_data.tokenizer, rep)
    rate = p.steady_steps * trainer.tokens_per_step / p.steady_s if p.steady_s > 0 else None
    return _summary(rep, rc, p.step, p.steps_done, trainer.progress(), rate, p.last_bpb, run_data.lzma_bpb, reason,
                    export_dir if completion is not None else None, completion)


def _summary(rep, rc, at, steps_done, progress, rate, bpb, lzma_bpb, reason, export_dir, completion) -> int:
    """The call's last line, one JSON object (also a "summary" event in log.jsonl). -> exit status 0."""
    summary = {"step": at, "total_steps": rc.optim.total_steps, "steps_this_call": steps_done,
               "tokens_seen": at * rc.batch * rc.seq_len, "device_s": round(progress.get("device_s", 0.0), 3),
               "tokens_per_s": rate, "bpb": bpb, "lzma_bpb": lzma_bpb, "stopped": reason,
               "export": str(export_dir) if export_dir is not None else None, "completion": completion}
    rep.event("summary", **summary)
    rep.last_line(summary)
    return 0


@command.one_line_errors(PROG)
def main(argv: list[str] | None = None) -> int:
    """The command (module docstring); -> exit status: 0, or 2 after one `lingjax.train: error:` line."""
    t0 = time.perf_counter()
    opts = parse_args(argv)
    compilation_cache.enable(os.environ.get("JAX_COMPILATION_CACHE_DIR") or None)
    return run(opts, t0)
