"""Generation: jitted prefill chunks, then a jitted step (a T=1 decode, or a speculative round; or
several of either in one call: rounds_per_call), driven by a host loop that never waits on the step
it just launched.

The loop runs one step ahead: step k+1 is dispatched with step k's outputs still on the device
(each step takes the previous step's device values as inputs), and the host reads step k's
output through an asynchronous copy started at dispatch. Every device-to-host read goes through
`host_read`, so a test can prove nothing else reads. Stops (EOS, stop ids, max_new_tokens) are
applied on the host to tokens read one step late; a stop inside an accepted draft cuts the
tokens after it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lingjax import compile_watch, requests
from lingjax.chat_template import render_for
from lingjax.detokenize import TextStream
from lingjax.fim import fim_prompt
from lingjax.precompile import Job, compile_together
from lingjax.requests import PREFILL_CHUNK
from lingjax.runtime import Model
from lingjax.sampling import NONFINITE, SamplingParams
from lingjax.spec.drafters import NextnDrafter
from lingjax.spec.step import SpecState, read_output_row, spec_program
from lingjax.spec.width_schedule import WidthSchedule
from lingjax.stops import StopCutter, check_stop_strings

MIN_CAPACITY = 256


class NonFiniteLogits(RuntimeError):
    """A generation stopped because the logits a token would come from were NaN or infinite."""


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # new token ids (a stop token, when hit, is the last one)
    stop_reason: str  # "stop" (a stop/EOS id or a stop string) or "length" (max_new_tokens)
    prompt_len: int
    ttft_s: float  # submit -> first new token on the host
    tpot_mean_s: float  # (latency - TTFT) / (tokens - 1): excludes TTFT
    tpot_median_s: float  # median inter-token gap (a step bringing k tokens counts as k equal gaps)
    total_s: float  # submit -> last token on the host
    token_times_s: list[float]  # per token, from submit (tokens of one step share its gap evenly)
    accept_lens: list[int] = dataclasses.field(default_factory=list)  # per speculative round read
    text: str | None = None  # the new tokens but a stop token as text (special tokens left out), cut before a
    # stop string; None: no tokenizer
    compile_s: float = 0.0  # of total_s, the seconds spent compiling (or loading) programs

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else float("nan")

    @property
    def mean_accept_len(self) -> float:
        return statistics.fmean(self.accept_lens) if self.accept_lens else float("nan")


def start_host_copy(x: jax.Array) -> None:
    """Start the asynchronous device-to-host copy of a step's output right after its dispatch."""
    with jax.transfer_guard_device_to_host("allow"):
        x.copy_to_host_async()


def host_read(x: jax.Array) -> np.ndarray:
    """The one place the generation loop reads a device value (tests watch it). It is allowed under
    jax.transfer_guard_device_to_host("disallow"), so a run under that guard proves the loop makes
    no other device-to-host transfer (on GPU; the CPU backend's guard sees no such transfers)."""
    with jax.transfer_guard_device_to_host("allow"):
        return np.asarray(x)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_bucket(n: int) -> int:
    """Padded length of a prompt chunk: a power of two above VERIFY_ROWS, so a padded chunk always takes
    the chunked path (the decode-shaped path assumes every row is valid)."""
    return max(requests.MIN_PREFILL_CHUNK, _pow2(n))


def cache_capacity(prompt_len: int, max_new_tokens: int, step_width: int = 1, chunk: int = PREFILL_CHUNK) -> int:
    """Slots for the (chunk-padded) prompt, every new token and the run-ahead step's writes (a
    verify writes step_width slots past the committed length), rounded to a power of two so few
    capacities (and so few compiled programs) ever exist."""
    full, rest = divmod(prompt_len, chunk)
    padded = full * chunk + (prefill_bucket(rest) if rest else 0)
    return max(MIN_CAPACITY, _pow2(max(padded, prompt_len + max_new_tokens + 2 * step_width) + 1))


def _prompt_chunks(prompt: np.ndarray, size: int) -> Iterator[tuple[int, np.ndarray, int, bool]]:
    """(start, padded chunk, real length, is last) over the prompt, in chunks of `size` tokens."""
    for start in range(0, prompt.size, size):
        chunk = prompt[start : start + size]
        padded = np.zeros(prefill_bucket(chunk.size), np.int32)
        padded[: chunk.size] = chunk
        yield start, padded, chunk.size, start + size >= prompt.size


def plain_prefill(model: Model, prompt: np.ndarray, max_new_tokens: int, sampling, key, rounds_per_call: int = 1,
                  chunk: int = PREFILL_CHUNK, then=None):
    """The prompt through the target in chunks -> (first new token, cache sized for max_new_tokens and
    decode calls of rounds_per_call steps). then(cache) -> the jobs (lingjax.precompile.Job) of the programs that
    follow the prefill, compiled together with its own before it runs."""
    prefill, _ = model.step_programs(sampling)
    cache = model.new_cache(cache_capacity(prompt.size, max_new_tokens, rounds_per_call, chunk))
    chunks = [model.put((tokens, np.int32(start), np.int32(n_valid)))
              for start, tokens, n_valid, _ in _prompt_chunks(prompt, chunk)]
    jobs = [Job("the prefill", prefill, (model.weights, cache, *chunks[i], key)) for i in (0, -1)]
    compile_together(model.compiled, jobs + (then(cache) if then is not None else []))
    for host in chunks:
        token, cache = prefill(model.weights, cache, *host, key)
    return token, cache


def _plain_steps(model: Model, prompt, max_new_tokens, sampling, base_key, rounds_per_call,
                 chunk) -> Iterator[list[int]]:
    """Yields each call's new tokens (the prefill's one, then rounds_per_call per decode call), reading
    one call behind the device."""
    _, decode = model.step_programs(sampling, rounds_per_call)
    token_like, pos = model.put((np.int32(0), np.int32(prompt.size)))  # token_like: the prefill's token's stand-in

    def then(cache):
        if max_new_tokens == 1:  # no decode call
            return []
        return [Job("the decode step", decode, (model.weights, cache, token_like, pos, base_key))]

    token, cache = plain_prefill(model, prompt, max_new_tokens, sampling, jax.random.fold_in(base_key, 0),
                                 rounds_per_call, chunk, then)
    pending, produced = token, 0
    start_host_copy(pending)
    new = None
    try:
        while True:
            if produced + 1 < max_new_tokens:  # run ahead: launch the next call before reading this one
                new, token, pos, cache = decode(model.weights, cache, token, pos, base_key)
                start_host_copy(new)
            else:
                new = None
            tokens = np.atleast_1d(host_read(pending)).tolist()
            yield tokens
            produced += len(tokens)
            if new is None:
                return
            pending = new
    finally:
        settle(new)


def settle(in_flight) -> None:
    """Wait for the call a generation launched ahead and will not read (the one after a stop), through its output
    (a program's outputs are ready together): a process that exits with a computation still running aborts in the
    runtime's teardown. One step's wait, after the last token has reached the caller."""
    if in_flight is not None:
        jax.block_until_ready(in_flight)


def spec_prefill(model: Model, program, drafter, prompt: np.ndarray, max_new_tokens: int, base_key,
                 chunk: int = PREFILL_CHUNK, then=None):
    """The prompt through the target and the drafter -> (first token b, the state of round 1). then(state) -> the
    jobs (lingjax.precompile.Job) of the programs that follow the prefill, given a stand-in of round 1's state,
    compiled together with the prefill's before it runs."""
    # a call of rounds_per_call rounds advances s by up to that many verify widths
    capacity = cache_capacity(prompt.size, max_new_tokens, (drafter.steps + 1) * program.rounds_per_call, chunk)
    cache, draft = model.new_cache(capacity), model.put(drafter.init(model.module, capacity))
    chunks = [model.put((tokens, np.int32(start), np.int32(n_valid), np.int32(0 if last else prompt[start + n_valid]),
                         np.bool_(last)))
              for start, tokens, n_valid, last in _prompt_chunks(prompt, chunk)]
    jobs = [Job("the speculative prefill", program.prefill_program,
                (program.weights, cache, draft, *chunks[i], base_key)) for i in (0, -1)]
    s, round_ = model.put((np.int32(prompt.size), np.int32(0)))  # round 1's committed length and round count
    if then is not None:
        # round 1's state: the cache and drafter state as the prefill leaves them, its scalars, its own key
        jobs += then(SpecState(cache=cache, draft=draft, s=s, bonus=model.put(np.int32(0)), round=round_,
                               key=jax.random.clone(base_key)))
    compile_together(model.compiled, jobs)
    for host in chunks:
        bonus, cache, draft = program.prefill_program(program.weights, cache, draft, *host, base_key)
    # the state is donated to the first round: it gets its own copies of the token the host reads
    # and of the caller's key
    state = SpecState(cache=cache, draft=draft, s=s, bonus=jnp.copy(bonus), round=round_,
                      key=jax.random.clone(base_key))
    return bonus, state


def _spec_steps(model: Model, prompt, max_new_tokens, sampling, base_key, drafters: dict, choose, accept_lens,
                rounds_per_call, chunk):
    """Yields each call's new tokens (the prefill's first token, then d_1..d_n, b' of each round the
    call ran), appending each round's accept length to accept_lens. drafters: verify width -> drafter (one for a
    fixed width); choose(report) -> the width of the next call, from the last report read (None before any)."""
    programs = {w: spec_program(model, d, sampling, rounds_per_call) for w, d in drafters.items()}
    widest = max(drafters)

    def then(state):
        if max_new_tokens == 1:  # no round
            return []
        return [Job("the speculative round", p.round_program, (p.weights, state)) for p in programs.values()]

    bonus, state = spec_prefill(model, programs[widest], drafters[widest], prompt, max_new_tokens, base_key, chunk,
                                then)
    pending, pending_width, produced, report = bonus, None, 0, None
    start_host_copy(pending)
    out = None
    try:
        while True:
            if produced + 1 < max_new_tokens:  # run ahead (a round yields at least one token)
                width = choose(report)
                state, out = programs[width].round(programs[width].weights, state)
                start_host_copy(out)
            else:
                out = width = None
            value = host_read(pending)
            if pending_width is None:
                tokens = [int(value)]
            else:
                tokens = []
                for row in value:  # one row per round (lingjax.spec.step.output_row)
                    new, report = read_output_row(row, pending_width - 1)
                    tokens += new
                    accept_lens.append(len(new))
                report = report if report.size else None
            yield tokens
            produced += len(tokens)
            if out is None:
                return
            pending, pending_width = out, width
    finally:
        settle(out)


def generate(model: Model, prompt, max_new_tokens: int = 32, temperature: float = 0.0, seed: int = 0,
             stop_ids: Sequence[int] = (), *, top_k: int = 0, top_p: float = 1.0, ignore_eos: bool = False,
             on_token: Callable[[int], None] | None = None, on_text: Callable[[str], None] | None = None,
             spec: str | None = None, steps: int | None = None, drafter=None, rounds_per_call: int = 1,
             prefill_chunk: int = PREFILL_CHUNK, widths: Sequence[int] | None = None, stop=None,
             suffix: str | None = None) -> GenerationResult:
    """Generate up to max_new_tokens after `prompt`: text (encoded with model.tokenizer) or token ids.

    stop: strings (or one) that end the generation where the text first holds one: the text is cut before it, the
    tokens end with the one that completed it (lingjax.stops; streamed text holds back only what could still start
    one). suffix: fill in the middle between the text prompt and this text, through the tokenizer's FIM tokens
    (lingjax.fim; ValueError when it has none).

    Stops at any of stop_ids or the tokenizer's stop ids (the config's EOS ids without a tokenizer) unless
    ignore_eos. on_token(id) is called as each token reaches the host; on_text(str) with the new text of each
    device call (streamed exactly: lingjax.detokenize), so under speculation text arrives in bursts of accepted
    tokens. spec="nextn" speculates with the MTP layer, `steps` drafts a round (lingjax.config.DEFAULT_STEPS unless
    given; greedy output is identical to spec=None); spec="dspark" with the model's DSpark drafter (model.draft;
    `steps` drafts of its block are verified, all of them unless given; or, with `widths` (verify widths, each
    compiled once), the host picks each call's width from the drafter's confidences of earlier rounds:
    lingjax.spec.width_schedule.WidthSchedule);
    `drafter` plugs in any other drafter object. rounds_per_call > 1 runs that many
    speculative rounds (or plain decode steps) per device call: the host's fixed cost per call is shared and
    the tokens are the same either way. prefill_chunk: prompt tokens per prefill program, a power of two of at
    least 2 * VERIFY_ROWS. Every argument is checked (lingjax.requests) before the prompt reaches the device.
    """
    requests.check_callback("on_token", on_token)
    requests.check_callback("on_text", on_text)
    tokenizer = model.tokenizer
    stop_texts = check_stop_strings(stop)
    if (stop_texts or suffix is not None) and tokenizer is None:
        raise ValueError(f"{model.source or 'this model'} has no tokenizer (no tokenizer.json): stop strings and a "
                         "suffix need one")
    if suffix is not None and not isinstance(suffix, str):
        raise ValueError(f"suffix must be a string, got {type(suffix).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{model.source or 'this model'} has no tokenizer (no tokenizer.json): give token ids")
        if not prompt and suffix is None:
            raise ValueError("the prompt is empty")
        prompt = (tokenizer.encode(prompt) if suffix is None
                  else fim_prompt(tokenizer, model.source or "this model", prompt, suffix))
    elif suffix is not None:
        raise ValueError("a suffix (fill in the middle) needs a text prompt, not token ids")
    prompt = requests.check_prompt_ids(prompt, model.cfg.vocab_size)
    if drafter is not None and spec is not None:
        raise ValueError("give spec or drafter, not both")
    plan = requests.check_generation(model.cfg, prompt_len=prompt.size, max_new_tokens=max_new_tokens,
                                     temperature=temperature, top_k=top_k, top_p=top_p, spec=spec, steps=steps,
                                     widths=widths, rounds_per_call=rounds_per_call, has_mtp=model.has_mtp,
                                     draft_block=_draft_block(model), seed=seed, prefill_chunk=prefill_chunk)
    stops = stop_set(model, stop_ids, ignore_eos)
    sampling = SamplingParams(plan.temperature, plan.top_k, plan.top_p)
    base_key = model.put(jax.random.key(plan.seed))
    accept_lens: list[int] = []
    if plan.scheduled:
        schedule = make_schedule(model, plan.widths)
        drafters = {w: model.draft.drafter(w - 1) for w in schedule.widths}
        choose = schedule.choose
    else:
        if plan.spec is not None:
            drafter = make_drafter(model, plan.spec, plan.steps)
        drafters = {drafter.steps + 1: drafter} if drafter is not None else {}
        choose = lambda report: next(iter(drafters))  # noqa: E731
    stream = TextStream(tokenizer) if tokenizer is not None else None
    if on_text is not None and stream is None:
        raise ValueError(f"on_text needs a tokenizer, and {model.source or 'this model'} has none")
    cutter = StopCutter(stop_texts) if stop_texts else None

    def emit(new: str) -> bool:
        """Passes new text on (through the stop strings' cutter); whether a stop string ended it."""
        hit = False
        if cutter is not None:
            new, hit = cutter.push(new)
        if on_text and new:
            on_text(new)
        return hit

    compiling = compile_watch.watch().total_s
    t0 = time.perf_counter()
    if not drafters:
        steps_iter = _plain_steps(model, prompt, max_new_tokens, sampling, base_key, plan.rounds_per_call,
                                  plan.prefill_chunk)
    else:
        steps_iter = _spec_steps(model, prompt, max_new_tokens, sampling, base_key, drafters, choose, accept_lens,
                                 plan.rounds_per_call, plan.prefill_chunk)
    tokens: list[int] = []
    times: list[float] = []
    stop_reason = "length"
    try:  # the generator's own cleanup (the call launched ahead) also runs on an error or Ctrl-C
        for step_tokens in steps_iter:
            now = time.perf_counter() - t0
            last = times[-1] if times else 0.0
            kept = 0
            for j, value in enumerate(step_tokens, 1):
                if value == NONFINITE:
                    raise NonFiniteLogits(
                        f"the logits of {model.source or 'this model'} hold NaN or infinite values at new token "
                        f"{len(tokens) + 1}: its weights or activations overflow in {jnp.dtype(model.dtype).name}; "
                        "no token is taken from them")
                tokens.append(value)
                kept += 1
                times.append(last + (now - last) * j / len(step_tokens))
                if on_token:
                    on_token(value)
                if value in stops:
                    stop_reason = "stop"
                    break
                if len(tokens) >= max_new_tokens:
                    break
            if stream is not None:  # the stop token is not text
                texts = step_tokens[:kept - 1] if stop_reason == "stop" else step_tokens[:kept]
                if cutter is None:
                    emit(stream.push(texts))
                else:  # token by token, to know which token completed a stop string
                    for j, value in enumerate(texts):
                        if emit(stream.push([value])):
                            cut = len(tokens) - kept + j + 1
                            del tokens[cut:], times[cut:]
                            stop_reason = "stop"
                            break
            if stop_reason == "stop" or len(tokens) >= max_new_tokens:
                break
    finally:
        steps_iter.close()
    if stream is not None:
        if not (cutter is not None and cutter.stopped):
            emit(stream.flush())
        if cutter is not None and not cutter.stopped:
            rest = cutter.flush()
            if on_text and rest:
                on_text(rest)
    # rounds the device ran past the last kept token (a stop, max_new_tokens, the rest of a call) do
    # not count: keep the shortest prefix of rounds that covers the tokens after the first
    covered = np.cumsum(accept_lens)
    del accept_lens[int(np.searchsorted(covered, len(tokens) - 1)) + 1 if len(tokens) > 1 else 0:]
    gaps = np.diff(times).tolist()
    return GenerationResult(
        tokens=tokens,
        stop_reason=stop_reason,
        prompt_len=int(prompt.size),
        ttft_s=times[0],
        tpot_mean_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan"),
        tpot_median_s=statistics.median(gaps) if gaps else float("nan"),
        total_s=times[-1],
        token_times_s=times,
        accept_lens=accept_lens,
        text=(cutter.text if cutter is not None else stream.text) if stream is not None else None,
        compile_s=compile_watch.seconds() - compiling,
    )


def stop_set(model: Model, stop_ids: Sequence[int] = (), ignore_eos: bool = False) -> set[int]:
    """The ids that end a generation: stop_ids (checked against the vocabulary) and, unless ignore_eos, the
    tokenizer's stop ids (the config's EOS ids without a tokenizer)."""
    stops = requests.check_stop_ids(stop_ids, model.cfg.vocab_size)
    if not ignore_eos:
        stops |= set(model.tokenizer.stop_ids if model.tokenizer is not None else model.cfg.eos_token_ids)
    return stops


def chat(model: Model, messages, max_new_tokens: int = 256, *, add_generation_prompt: bool = True,
         template_kwargs: dict | None = None, **kwargs) -> GenerationResult:
    """The assistant's next turn after `messages` ([{"role": "user", "content": "..."}, ...]): the model's chat
    template renders them (lingjax.chat_template.render; template_kwargs such as {"enable_thinking": False} reach the
    template), then generate(model, prompt, max_new_tokens, **kwargs)."""

    text = render_for(model.tokenizer, model.source or "this model", messages,
                      add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    return generate(model, text, max_new_tokens, **kwargs)


def _draft_block(model: Model) -> int | None:
    return model.draft.cfg.block_size if model.draft is not None else None


def make_schedule(model: Model, widths: Sequence[int]):
    """The WidthSchedule of a DSpark generation over these checked verify widths (costs from the byte model)."""

    return WidthSchedule.for_model(model.cfg, tuple(widths))


def make_drafter(model: Model, spec: str, steps: int | None = None):
    """The drafter object of a spec method at `steps` drafts a round (None: lingjax.requests.default_steps), for a
    request checked by lingjax.requests.check_generation: NEXTN's MTP chain, or the model's DSpark drafter
    (model.draft)."""
    steps = requests.default_steps(spec, _draft_block(model)) if steps is None else steps
    if spec == "dspark":
        return model.draft.drafter(steps)

    return NextnDrafter(steps=steps)
