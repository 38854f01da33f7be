"""The model behind the server: a request's prompt ids, its checks (lingjax.requests, before any model work), and
its generation, one at a time.

`ModelBackend` wraps a loaded lingjax.Model and the server's speculation settings; the app calls only `name`,
`completion_prompt`, `chat_prompt`, `plan` and `run`, so a test can put a scripted stand-in in its place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from lingjax import requests
from lingjax.chat_template import ChatError, render_for
from lingjax.fim import fim_prompt
from lingjax.serve.protocol import ApiError, ChatRequest, CompletionRequest, Sampling

DEFAULT_CHAT_MAX_TOKENS = 1024  # a chat request without max_tokens: this, or what the context has left if less
ROLE_END = "<|role_end|>"  # Ling-3's turn end, which the model sometimes writes as plain text


# check_generation's arguments a request sets (the others, steps and widths, are the server's own options)
REQUEST_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


class Cancelled(Exception):
    """The client went away: the generation stops at its next token."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str | None  # the rendered text (chat), for where the reply starts (inside a thinking block or not)


class ModelBackend:
    def __init__(self, model, name: str, spec: str | None = None, steps: int | None = None, widths=None):
        self.model, self.name, self.spec, self.steps, self.widths = model, name, spec, steps, widths
        self.tokenizer = model.tokenizer

    def completion_prompt(self, req: CompletionRequest) -> Prompt:
        try:
            if isinstance(req.prompt, list):
                return Prompt(requests.check_prompt_ids(req.prompt, self.model.cfg.vocab_size).tolist(), None)
            if self.tokenizer is None:
                raise ValueError(f"{self.name} has no tokenizer: give the prompt as token ids")
            if req.suffix is not None:
                return Prompt(fim_prompt(self.tokenizer, self.name, req.prompt, req.suffix), None)
            return Prompt(self.tokenizer.encode(req.prompt), req.prompt)
        except ValueError as e:
            raise ApiError(str(e), param="suffix" if req.suffix is not None else "prompt",
                           code="invalid_value") from None

    def chat_prompt(self, req: ChatRequest) -> Prompt:
        variables = dict(req.template_kwargs)
        if req.tools is not None:
            variables["tools"] = req.tools
        try:
            text = render_for(self.tokenizer, self.name, req.messages, **variables)
        except ChatError as e:
            raise ApiError(str(e), param="messages", code="invalid_value") from None
        return Prompt(self.tokenizer.encode(text), text)

    def stop_strings(self, chat: bool) -> tuple[str, ...]:
        """Stop strings every request of this kind adds: a chat turn ends at a plain-text turn end too."""
        return (ROLE_END,) if chat and self.tokenizer is not None and self.tokenizer.token_id(ROLE_END) is not None \
            else ()

    def plan(self, prompt: Prompt, sampling: Sampling, chat: bool) -> dict:
        """lingjax.generate's keyword arguments for this request, checked by lingjax.requests -> ApiError."""
        cfg = self.model.cfg
        max_new = sampling.max_new_tokens
        if max_new is None:
            max_new = max(1, min(DEFAULT_CHAT_MAX_TOKENS, cfg.max_position_embeddings - len(prompt.ids)))
        seed = sampling.seed if sampling.seed is not None else (secrets.randbelow(2**63) if sampling.temperature
                                                                else 0)
        draft = self.model.draft.cfg.block_size if self.model.draft is not None else None
        try:
            requests.check_generation(cfg, prompt_len=len(prompt.ids), max_new_tokens=max_new,
                                      temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                      spec=self.spec, steps=self.steps, widths=self.widths,
                                      has_mtp=self.model.has_mtp, draft_block=draft, seed=seed)
        except ValueError as e:
            message = str(e).replace("max_new_tokens", "max_tokens")
            name = requests.argument_of(str(e))
            param = {"max_new_tokens": "max_tokens"}.get(name, name) if name in REQUEST_FIELDS else (
                "max_tokens" if "max_tokens" in message else None)  # the prompt plus max_tokens past the length
            raise ApiError(message, param=param, code="invalid_value") from None
        return dict(max_new_tokens=max_new, temperature=sampling.temperature, top_k=sampling.top_k,
                    top_p=sampling.top_p, seed=seed, stop=sampling.stop + self.stop_strings(chat), spec=self.spec,
                    steps=self.steps, widths=self.widths, ignore_eos=sampling.ignore_eos)

    def run(self, prompt: Prompt, kwargs: dict, on_text: Callable[[str], None],
            cancelled: Callable[[], bool]):
        """Generates (blocking; the worker thread calls it) -> lingjax.engine.GenerationResult; Cancelled when
        cancelled() turns true (checked at every token)."""
        from lingjax.engine import generate

        def on_token(_):
            if cancelled():
                raise Cancelled

        return generate(self.model, prompt.ids, on_text=on_text, on_token=on_token, **kwargs)


class Worker:
    """Batch 1: generations run one at a time in one worker thread, first come first served (asyncio.Lock is
    FIFO). submit() waits for the turn, starts the generation and returns a Job whose events are
    ("text", str)... then ("done", result) or ("error", exception); the turn passes on when the thread is done, so
    a cancelled generation has settled (lingjax.engine waits for the call it ran ahead) before the next starts."""

    def __init__(self):
        self._lock = asyncio.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="lingjax-generate")
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}  # generations so far, by how they ended

    async def submit(self, run: Callable[[Callable[[str], None], Callable[[], bool]], object]) -> Job:
        await self._lock.acquire()
        loop = asyncio.get_running_loop()
        job = Job()

        def put(event):
            loop.call_soon_threadsafe(job.events.put_nowait, event)

        def work():
            try:
                result = run(lambda text: put(("text", text)), job.cancel_event.is_set)
            except BaseException as e:  # noqa: BLE001 - handed to the request, which answers it
                self.counts["cancelled" if isinstance(e, Cancelled) else "failed"] += 1
                put(("error", e))
            else:
                self.counts["completed"] += 1
                put(("done", result))

        try:
            future = loop.run_in_executor(self._thread, work)
        except BaseException:
            self._lock.release()
            raise
        future.add_done_callback(lambda _: self._lock.release())
        return job


class Job:
    def __init__(self):
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel_event = threading.Event()

    def cancel(self) -> None:
        self.cancel_event.set()
