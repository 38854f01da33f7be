"""The HTTP app (FastAPI): GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Each request is parsed and checked (lingjax.serve.protocol, then the backend's lingjax.requests checks) before it
queues for the model; a bad one is a 400 with OpenAI's error body and never reaches the engine. Replies follow the
OpenAI API: usage counts the engine's tokens (a speculative round brings several at once, so chunks are not
tokens); a stream is server-sent events, every chunk with the same id, `created` and `model`, the first chat delta
carrying the role, then the finish reason, then (stream_options.include_usage) a usage chunk, then `data: [DONE]`.
A client that goes away mid-stream cancels its generation at the next token.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lingjax.serve import protocol
from lingjax.serve.backend import Worker
from lingjax.serve.protocol import ApiError
from lingjax.serve.reasoning import ReplyParser, opens_thinking


def _usage(result) -> dict:
    return {"prompt_tokens": result.prompt_len, "completion_tokens": len(result.tokens),
            "total_tokens": result.prompt_len + len(result.tokens)}


def _failure(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    return ApiError(f"the generation failed: {type(error).__name__}: {error}", status=500, kind="server_error",
                    code="generation_failed")


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(backend) -> FastAPI:
    """The app over a backend (lingjax.serve.backend.ModelBackend or a stand-in with its methods)."""
    app = FastAPI(title="lingjax", docs_url=None, redoc_url=None)
    worker = Worker()
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": backend.name, "generations": dict(worker.counts)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": backend.name, "object": "model", "created": started,
                                            "owned_by": "lingjax"}]}

    async def events(job):
        """The job's events until it ends, as (kind, value); cancels the job if the caller stops early."""
        try:
            while True:
                kind, value = await job.events.get()
                yield kind, value
                if kind != "text":
                    return
        finally:
            job.cancel()

    def reply_head(id_prefix: str, kind: str) -> dict:
        """What every chunk (or the reply) of one request carries: its id, object, creation time and model."""
        return {"id": id_prefix + uuid.uuid4().hex, "object": kind, "created": int(time.time()), "model": backend.name}

    async def start(prompt, kwargs):
        return await worker.submit(lambda on_text, cancelled: backend.run(prompt, kwargs, on_text, cancelled))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = protocol.completion_request(protocol.parse_json(await request.body()), backend.name)
        prompt = backend.completion_prompt(req)
        kwargs = backend.plan(prompt, req.sampling, chat=False)
        head = reply_head("cmpl-", "text_completion")
        job = await start(prompt, kwargs)
        if not req.stream:
            text = []
            async for kind, value in events(job):
                if kind == "text":
                    text.append(value)
                elif kind == "error":
                    raise _failure(value)
                else:
                    choice = {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": value.stop_reason}
                    return {**head, "choices": [choice], "usage": _usage(value)}

        async def stream():
            async for kind, value in events(job):
                if kind == "text":
                    yield _sse({**head, "choices": [{"index": 0, "text": value, "logprobs": None,
                                                     "finish_reason": None}]})
                elif kind == "error":
                    yield _sse(_failure(value).body())
                else:
                    yield _sse({**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                     "finish_reason": value.stop_reason}]})
                    if req.include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(value)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = protocol.chat_request(protocol.parse_json(await request.body()), backend.name)
        prompt = backend.chat_prompt(req)
        kwargs = backend.plan(prompt, req.sampling, chat=True)
        head = reply_head("chatcmpl-", "chat.completion")
        parser = ReplyParser(opens_thinking(prompt.text or ""), req.tools, parse_tools=req.tool_choice == "auto")
        job = await start(prompt, kwargs)

        def finish_reason(result) -> str:
            return "tool_calls" if parser.tool_calls else result.stop_reason

        if not req.stream:
            parts = {"content": [], "reasoning": []}
            async for kind, value in events(job):
                if kind == "error":
                    raise _failure(value)
                pieces = parser.push(value) if kind == "text" else parser.finish()
                for what, piece in pieces:
                    if what != "tool_call":
                        parts[what].append(piece)
                if kind == "done":
                    message = {"role": "assistant", "content": "".join(parts["content"]) or
                               (None if parser.tool_calls else "")}
                    if parts["reasoning"]:
                        message["reasoning_content"] = "".join(parts["reasoning"])
                    if parser.tool_calls:
                        message["tool_calls"] = [c.as_dict() for c in parser.tool_calls]
                    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(value)}
                    return {**head, "choices": [choice], "usage": _usage(value)}

        chunk = {**head, "object": "chat.completion.chunk"}

        def delta(d: dict, finish=None) -> str:
            return _sse({**chunk, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]})

        async def stream():
            yield delta({"role": "assistant", "content": ""})
            calls = 0
            async for kind, value in events(job):
                if kind == "error":
                    yield _sse(_failure(value).body())
                    break
                for what, piece in parser.push(value) if kind == "text" else parser.finish():
                    if what == "content":
                        yield delta({"content": piece})
                    elif what == "reasoning":
                        yield delta({"reasoning_content": piece})
                    else:
                        yield delta({"tool_calls": [{"index": calls, **piece.as_dict()}]})
                        calls += 1
                if kind == "done":
                    yield delta({}, finish_reason(value))
                    if req.include_usage:
                        yield _sse({**chunk, "choices": [], "usage": _usage(value)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app
