"""The OpenAI API's request bodies, checked into plain requests before any model work; and the error body.

A bad request raises ApiError, which the app answers with its status and OpenAI's error shape
(`{"error": {"message", "type", "param", "code"}}`). Sampling and length checks are lingjax.requests' and
lingjax.stops' own (one home for request validation); this module checks only the API's spelling of them. Fields
the engine cannot honour (n > 1, logprobs, penalties, echo, a required or named tool_choice) are errors, not
silently dropped; fields with no effect on a local server (user, metadata, store, ...) are accepted.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

from lingjax.requests import is_int, is_real
from lingjax.stops import check_stop_strings

DEFAULT_MAX_TOKENS = 16  # the completions API's default
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "modalities",
           "reasoning_effort", "web_search_options", "audio"}


class ApiError(Exception):
    """A request the server refuses: status, message, the field at fault (param) and an OpenAI error code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The generation parameters of a request (lingjax.generate's names)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool = False  # an extension (as SGLang's and vLLM's): generate past the stop tokens, for benchmarks


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    suffix: str | None
    sampling: Sampling
    stream: bool
    include_usage: bool


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    tool_choice: str  # "auto" or "none"
    template_kwargs: dict
    sampling: Sampling
    stream: bool
    include_usage: bool


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_json")
    return body


def _unsupported(body: Mapping, known: set[str]) -> None:
    for name in body:
        if name not in known and name not in IGNORED:
            raise ApiError(f"{name} is not supported by this server", param=name, code="unsupported_parameter")


def _no_effect(body: Mapping, name: str, neutral, why: str) -> None:
    """A field the engine cannot honour is allowed only at its neutral value."""
    value = body.get(name)
    if value is not None and value not in neutral:
        raise ApiError(f"{name}={value!r} is not supported: {why}", param=name, code="unsupported_parameter")


def check_model(body: Mapping, served: str) -> None:
    model = body.get("model")
    if model is None:
        raise ApiError("model is required", param="model", code="missing_required_parameter")
    if model != served:
        raise ApiError(f"the model {model!r} does not exist on this server; it serves {served!r}", param="model",
                       code="model_not_found")


def _number(body: Mapping, name: str, default, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    ok = is_int(value) if integer else is_real(value) and math.isfinite(value)
    if not ok:
        raise ApiError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", param=name,
                       code="invalid_value")
    return value


def _sampling(body: Mapping, max_tokens_names: tuple[str, ...]) -> Sampling:
    _no_effect(body, "n", (1,), "this server generates one choice per request (batch 1)")
    _no_effect(body, "best_of", (1,), "this server generates one choice per request (batch 1)")
    _no_effect(body, "presence_penalty", (0, 0.0), "penalties are not implemented")
    _no_effect(body, "frequency_penalty", (0, 0.0), "penalties are not implemented")
    _no_effect(body, "repetition_penalty", (1, 1.0), "penalties are not implemented")
    _no_effect(body, "logprobs", (False, 0), "log probabilities are not returned")
    _no_effect(body, "top_logprobs", (0,), "log probabilities are not returned")
    if body.get("logit_bias"):
        raise ApiError("logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
    max_tokens = None
    for name in max_tokens_names:
        value = _number(body, name, None, integer=True)
        if value is not None:
            if value < 1:
                raise ApiError(f"{name} must be an integer >= 1, got {value!r}", param=name, code="invalid_value")
            max_tokens = value
    seed = _number(body, "seed", None, integer=True)
    if seed is not None and seed < 0:
        seed = seed % 2**63  # clients send any 64-bit integer
    try:
        stop = check_stop_strings(body.get("stop"))
    except ValueError as e:
        raise ApiError(str(e), param="stop", code="invalid_value") from None
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(f"ignore_eos must be true or false, got {ignore_eos!r}", param="ignore_eos",
                       code="invalid_value")
    return Sampling(max_new_tokens=max_tokens, temperature=_number(body, "temperature", 1.0),
                    top_p=_number(body, "top_p", 1.0), top_k=_number(body, "top_k", 0, integer=True), seed=seed,
                    stop=stop, ignore_eos=ignore_eos)


def _stream(body: Mapping) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(f"stream must be true or false, got {stream!r}", param="stream", code="invalid_value")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError(f"stream_options takes include_usage only, got {options!r}", param="stream_options",
                       code="invalid_value")
    if options and not stream:
        raise ApiError("stream_options needs stream: true", param="stream_options", code="invalid_value")
    return stream, bool(options.get("include_usage"))


COMPLETION_FIELDS = {"model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                     "stream", "stream_options", "best_of", "echo", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logprobs", "logit_bias", "ignore_eos"}


def completion_request(body: Mapping, served: str) -> CompletionRequest:
    check_model(body, served)
    _unsupported(body, COMPLETION_FIELDS)
    _no_effect(body, "echo", (False,), "the prompt is not echoed")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(is_int(t) for t in prompt):
            raise ApiError("prompt must be a string, or a non-empty list of token ids (one prompt: batch 1)",
                           param="prompt", code="invalid_value")
    elif not isinstance(prompt, str):
        raise ApiError("prompt is required: a string or a list of token ids", param="prompt",
                       code="missing_required_parameter" if prompt is None else "invalid_value")
    suffix = body.get("suffix")
    if suffix is not None and (not isinstance(suffix, str) or not isinstance(prompt, str)):
        raise ApiError("suffix must be a string, after a text prompt", param="suffix", code="invalid_value")
    if suffix == "":
        suffix = None
    if prompt == "" and suffix is None:
        raise ApiError("the prompt is empty", param="prompt", code="invalid_value")
    sampling = _sampling(body, ("max_tokens",))
    if sampling.max_new_tokens is None:
        sampling = dataclasses.replace(sampling, max_new_tokens=DEFAULT_MAX_TOKENS)
    stream, usage = _stream(body)
    return CompletionRequest(prompt, suffix, sampling, stream, usage)


CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "n", "stream", "stream_options", "tools", "tool_choice", "chat_template_kwargs",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
               "logit_bias", "response_format", "ignore_eos"}


def _message(i: int, m) -> dict:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise ApiError(f"messages[{i}] must be an object with a role", param=f"messages[{i}]", code="invalid_value")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{i}].content: only text parts are supported, got {part!r}",
                               param=f"messages[{i}].content", code="invalid_value")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None and (m.get("tool_calls") or m["role"] == "assistant"):
        content = ""
    if not isinstance(content, str):
        raise ApiError(f"messages[{i}].content must be a string or text parts", param=f"messages[{i}].content",
                       code="invalid_value")
    out["content"] = content
    if m.get("tool_calls") is not None:
        out["tool_calls"] = [_past_call(i, j, call) for j, call in enumerate(m["tool_calls"])] \
            if isinstance(m["tool_calls"], list) else _past_call(i, 0, None)
    return out


def _past_call(i: int, j: int, call) -> dict:
    """An assistant message's earlier tool call, its arguments as a mapping: OpenAI clients send them as a JSON
    string, and templates in Ling-3's format iterate them (`arguments.items()`), as transformers passes them."""
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ApiError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}",
                       param=where, code="invalid_value")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    if not isinstance(args, Mapping):
        raise ApiError(f"{where}.function.arguments must be a JSON object", param=f"{where}.function.arguments",
                       code="invalid_value")
    return {**call, "function": {**fn, "arguments": dict(args)}}


def _tools(body: Mapping) -> tuple[list[dict] | None, str]:
    tools = body.get("tools")
    if tools is not None:
        ok = isinstance(tools, list) and all(
            isinstance(t, Mapping) and t.get("type", "function") == "function" and isinstance(t.get("function"),
                                                                                             Mapping)
            and isinstance(t["function"].get("name"), str) for t in tools)
        if not ok:
            raise ApiError("tools must be a list of {'type': 'function', 'function': {'name': ..., 'parameters': "
                           "...}}", param="tools", code="invalid_value")
        tools = [dict(t) for t in tools] or None
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice not in ("auto", "none"):
        raise ApiError(f"tool_choice {choice!r} is not supported: only 'auto' and 'none' (this server does not "
                       "constrain decoding)", param="tool_choice", code="unsupported_parameter")
    return tools, choice


def chat_request(body: Mapping, served: str) -> ChatRequest:
    check_model(body, served)
    _unsupported(body, CHAT_FIELDS)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError("response_format: only {'type': 'text'} is supported", param="response_format",
                       code="unsupported_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages",
                       code="missing_required_parameter" if messages is None else "invalid_value")
    messages = [_message(i, m) for i, m in enumerate(messages)]
    tools, choice = _tools(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ApiError("chat_template_kwargs must be an object of template variables", param="chat_template_kwargs",
                       code="invalid_value")
    reserved = {"messages", "tools", "add_generation_prompt"} & set(kwargs)
    if reserved:
        raise ApiError(f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs",
                       code="invalid_value")
    stream, usage = _stream(body)
    return ChatRequest(messages, tools, choice, dict(kwargs), _sampling(body, ("max_tokens", "max_completion_tokens")),
                       stream, usage)
