"""The train loop of one `python -m lingjax.train` call (docs/training.md, Loop to Stop and save):

    trainer = Trainer(opts, run_data, state, start, restored, prior, rep)
    reason = trainer.run()          # "final_step" or "time_limit"; trainer.state, trainer.p: where it stopped

The train step and the evaluation are compiled before the first step, so the first step's time is a step's.
Batch k is PackedBatches.batch(k), a function of the stream, the seed and k, so a resumed run reads the
batches an uninterrupted one would. Evaluations and saves aside, the host reads the device only at log points
(every --log-every steps, the means of the steps since the last) and after each of the first two steps, which
are timed alone for the time limit's estimates. An evaluation (the summed next-token NLL of every held-out
window, as bits per byte) runs every --eval-every steps, a save every --save-every-s seconds; at the stop, each
runs once more unless this step had it. The loop stops at the final step or when command.TimeBudget says so,
its estimate of the call's end being the steps in flight, one more, and the evaluation, save and (at the final
step or with --export) export that follow, each timed at its last run in this call, or before that estimated
from lingjax.train.command's constants.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import jax
import numpy as np

from lingjax.train import bpe, command, data, optim, step
from lingjax.train.command import CommandError
from lingjax.train.options import Options
from lingjax.train.prepare import RunData
from lingjax.train.report import Reporter, since


def eval_batches(windows: data.EvalWindows, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The windows in (rows int32 [batch, T + 1], mask bool [batch, T]) pieces, the last padded with masked
    EOS rows, so one program shape serves them all."""
    n = len(windows.windows)
    padded = -(-n // batch) * batch
    rows = np.full((padded, windows.windows.shape[1]), bpe.EOS_ID, np.int32)
    rows[:n] = windows.windows
    mask = np.zeros((padded, windows.mask.shape[1]), bool)
    mask[:n] = windows.mask
    return [(rows[i : i + batch], mask[i : i + batch]) for i in range(0, padded, batch)]


def evaluate(fn, state: dict, pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int, float]:
    """(summed next-token NLL in nats, scored targets, seconds) over every piece (eval_batches) with fn
    (step.eval_fn's program); one device read at the end (command.evaluate)."""
    host, secs = command.evaluate(fn, [(state["params"], state["biases"], rows, mask) for rows, mask in pieces])
    return float(sum(float(nll) for nll, _ in host)), int(sum(int(c) for _, c in host)), secs


@dataclasses.dataclass
class CallProgress:
    """This call's counters and the estimates the time limit uses (seconds)."""

    start_step: int
    step: int
    steady_s: float = 0.0  # time in measured step windows (no compile, eval or save)
    steady_steps: int = 0
    step_s: float | None = None  # one step, latest estimate
    save_s: float | None = None
    eval_s: float | None = None
    last_bpb: float | None = None
    last_eval_step: int | None = None
    saved_step: int | None = None
    loop_t0: float | None = None  # when this call's loop began
    loop_s: float | None = None  # how long it ran, once it has ended

    @property
    def steps_done(self) -> int:
        return self.step - self.start_step


class Trainer:
    """The train loop of one call over a restored or fresh state (module docstring)."""

    def __init__(self, opts: Options, run_data: RunData, state: dict, start: int, restored: bool, prior: dict,
                 rep: Reporter):
        self.opts, self.rc, self.d, self.state, self.rep = opts, opts.rc, run_data, state, rep
        self.prior = prior  # the checkpoint record's "progress" ({} for a fresh run)
        self.p = CallProgress(start_step=start, step=start, saved_step=start if restored else None)
        self.p.last_bpb = prior.get("last_bpb")
        try:
            self.batches = data.PackedBatches(run_data.train_tokens, self.rc.batch, self.rc.seq_len, self.rc.seed)
        except ValueError as e:
            raise CommandError(f"the train stream is too short for --seq-len {self.rc.seq_len}: {e}") from None
        self.windows = data.eval_windows(run_data.held_out_tokens, self.rc.seq_len)
        self.eval_pieces = eval_batches(self.windows, self.rc.batch)
        self.train_program = self.eval_program = None  # compiled by _compile
        self.schedule = optim.lr_schedule(self.rc.optim)
        self.budget = command.TimeBudget(opts.time_limit_s)
        self.tokens_per_step = self.rc.batch * self.rc.seq_len

    # -- time limit
    def _reserve(self, exports: bool) -> float:
        """Seconds the work after the last step needs: an evaluation, a save and, when one follows, the export."""
        step_s = self.p.step_s or 0.0
        eval_s = self.p.eval_s if self.p.eval_s is not None else step_s * len(self.eval_pieces) / 2
        save_s = self.p.save_s if self.p.save_s is not None else command.save_reserve_s(self.state)
        return eval_s + save_s + (command.EXPORT_RESERVE_S if exports else 0.0)

    def _end_s(self, synced_at: float, synced_step: int) -> float:
        """When the call would end (seconds since its start) after one more step: the steps dispatched since the
        last sync and that one, then the reserve."""
        queued = self.p.step - synced_step + 1
        exports = self.opts.export is not None or self.p.step + 1 >= self.rc.optim.total_steps
        return synced_at - self.rep.t0 + queued * (self.p.step_s or 0.0) + self._reserve(exports)

    # -- the loop
    def run(self) -> str:
        """Steps until the final step or the time limit; -> why it stopped ("final_step" or "time_limit")."""
        total = self.rc.optim.total_steps
        t_loop = self.p.loop_t0 = time.perf_counter()
        if self.p.step < total:
            self._compile()
        fn = self.train_program
        last_save = t_loop
        window: list = []
        synced_at, synced_step = time.perf_counter(), self.p.step
        reason = "final_step"
        while self.p.step < total:
            end_s = functools.partial(self._end_s, synced_at, synced_step)  # read now, at this step
            if self.budget.exhausted(self.p.steps_done, end_s):
                reason = "time_limit"
                break
            self.state, metrics = fn(self.state, self.batches.batch(self.p.step))
            self.p.step += 1
            window.append(metrics)
            n = self.p.steps_done
            if n <= 2:  # the first two steps are timed alone: the first step's estimate, then a steady one
                jax.block_until_ready(metrics)
                now = time.perf_counter()
                self.p.step_s = now - synced_at
                if n == 1:
                    self.rep.say(f"step {self.p.step}: the first step ran in {self.p.step_s:.2f} s")
                else:
                    self.p.steady_s += now - synced_at
                    self.p.steady_steps += 1
                synced_at, synced_step = now, self.p.step
            if self.p.step % self.opts.log_every == 0 or self.p.step == total:
                synced_at, synced_step = self._log(window, synced_at, synced_step)
                window = []
            if self.p.step % self.opts.eval_every == 0:
                self._eval()
                synced_at, synced_step = time.perf_counter(), self.p.step
            if time.perf_counter() - last_save >= self.opts.save_every_s:
                self._save()
                last_save = synced_at = time.perf_counter()
                synced_step = self.p.step
        if window:
            self._log(window, synced_at, synced_step)
        if self.p.last_eval_step != self.p.step:
            self._eval()
        if self.p.saved_step != self.p.step:
            self._save()
        self.p.loop_s = time.perf_counter() - t_loop
        return reason

    def _compile(self) -> None:
        """Compile the train step and the evaluation ahead of the first step (jax's persistent cache serves a
        program compiled before), so that the first step's time is a step's and the time limit can use it."""
        t = time.perf_counter()
        self.train_program = step.train_step_fn(self.rc).lower(self.state, self.batches.batch(self.p.step)).compile()
        rows, mask = self.eval_pieces[0]
        self.eval_program = step.eval_fn(self.rc).lower(self.state["params"], self.state["biases"], rows,
                                                         mask).compile()
        self.rep.say(f"compile: the train step and the evaluation in {since(t)}")

    def _log(self, window: list, synced_at: float, synced_step: int) -> tuple[float, int]:
        """One log line over the steps since the last sync (means of their metrics) -> the new sync point."""
        host = jax.device_get(window)
        now = time.perf_counter()
        steps = self.p.step - synced_step
        if steps > 0 and synced_step > self.p.start_step:  # a window after the first step (timed alone)
            self.p.steady_s += now - synced_at
            self.p.steady_steps += steps
            self.p.step_s = (now - synced_at) / steps
        mean = {k: float(np.mean([m[k] for m in host])) for k in host[0]} if host else {}
        rate = steps * self.tokens_per_step / max(now - synced_at, 1e-9) if steps else None
        lr = float(self.schedule(self.p.step - 1))
        fields = {"step": self.p.step, "loss": mean.get("loss"), "main_ce": mean.get("main_ce"),
                  "mtp_ce": mean.get("mtp_ce"), "balance": mean.get("balance"),
                  "load_imbalance_max": mean.get("load_imbalance_max"), "grad_norm": mean.get("grad_norm"),
                  "lr": lr, "tokens_per_s": rate, "elapsed_s": self.rep.elapsed()}
        if host:
            self.rep.report("train", f"step {self.p.step:>7}/{self.rc.optim.total_steps}  loss {mean['loss']:.4f}  "
                            f"ce {mean['main_ce']:.4f}  mtp {mean['mtp_ce']:.4f}  lr {lr:.3e}  "
                            f"grad_norm {mean['grad_norm']:.3f}  tok/s {'-' if rate is None else f'{rate:,.0f}'}",
                            **fields)
        return now, self.p.step

    def _eval(self) -> None:
        if self.eval_program is None:  # a call that takes no step still evaluates its state
            self.eval_program = step.eval_fn(self.rc)
        nll, count, self.p.eval_s = evaluate(self.eval_program, self.state, self.eval_pieces)
        bpb = data.bits_per_byte(nll, self.d.held_out_bytes)
        self.p.last_bpb, self.p.last_eval_step = bpb, self.p.step
        per_token = nll / max(count, 1)
        self.rep.report("eval", f"eval step {self.p.step}: held-out {bpb:.4f} bits/byte (lzma "
                        f"{self.d.lzma_bpb:.4f}), {per_token:.4f} nats/token over {count} tokens in "
                        f"{self.p.eval_s:.1f} s",
                        step=self.p.step, bpb=bpb, lzma_bpb=self.d.lzma_bpb, nats_per_token=per_token, tokens=count,
                        bytes=self.d.held_out_bytes)

    def record(self) -> dict:
        """The checkpoint record of the current state (checkpointing.save)."""
        return {"run": run_identity(self.rc),
                "data": {"seed": self.rc.seed, "position": self.p.step, "fingerprint": self.d.fingerprint,
                         "train_tokens": int(len(self.d.train_tokens)), "held_out_bytes": self.d.held_out_bytes},
                "progress": self.progress()}

    def progress(self) -> dict:
        if self.p.loop_s is not None:
            loop_s = self.p.loop_s
        else:
            loop_s = time.perf_counter() - self.p.loop_t0 if self.p.loop_t0 is not None else 0.0
        return {"tokens_seen": self.p.step * self.tokens_per_step, "device_s": self.prior.get("device_s", 0.0)
                + loop_s, "calls": self.prior.get("calls", 0) + 1, "last_bpb": self.p.last_bpb,
                "last_eval_step": self.p.last_eval_step}

    def _save(self) -> None:
        self.p.save_s = command.save(self.rep, self.opts.out, self.p.step, self.state, self.record())
        self.p.saved_step = self.p.step


def run_identity(rc: step.RunConfig) -> dict:
    """The RunConfig as the checkpoint record holds it (a JSON round trip, so comparisons see JSON values)."""
    return json.loads(json.dumps(rc.to_json()))
