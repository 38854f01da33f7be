"""Ling-3's reply format, split while it streams: thinking -> reasoning, tool calls -> structured calls, the rest
-> content.

As Ling-3's chat template writes a turn (docs/serve.md): the generation prompt ends `<role>ASSISTANT</role>\\n<think>`
with thinking on (the model writes its thinking, then `</think>`, then the answer) and `...\\n<think></think>` with
thinking off. A tool call is

    <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>...</tool_call>

where the model often writes the next `<arg_key>` straight after `</arg_value>`, with no separator, and may open a
tool call before closing `</think>` (the call then ends the thinking). A value may itself hold `</arg_value>`: a
close counts only where the next non-space text is `<arg_key>` or the call's end. A call that does not parse (no
name, a stray tag, a name the request did not offer) is passed on as content, never dropped.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object
    id: str = dataclasses.field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves a thinking block open (its last `<think>` comes after its last `</think>`):
    the reply then starts inside it."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def _param_types(tools: Sequence[Mapping] | None) -> dict[str, dict[str, str]] | None:
    """{tool name: {parameter: JSON-schema type}} of a request's tools; None without tools."""
    if tools is None:
        return None
    out = {}
    for tool in tools:
        fn = tool.get("function", tool)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn["name"]] = {k: (v.get("type") if isinstance(v, Mapping) else None) for k, v in props.items()}
    return out


def _value(text: str, kind) -> object:
    """An argument's value: kept as text for a string parameter, else JSON when it parses (numbers, booleans,
    objects), else the text."""
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_tool_call(body: str, tools: Sequence[Mapping] | None = None) -> ToolCall | None:
    """The text between `<tool_call>` and `</tool_call>` -> a ToolCall, or None when it does not parse."""
    at = body.find(KEY_OPEN)
    name = (body if at < 0 else body[:at]).strip()
    if not name or "<" in name or ">" in name or any(c.isspace() for c in name):
        return None
    types = _param_types(tools)
    if types is not None and name not in types:
        return None
    kinds = (types or {}).get(name, {})
    args: dict[str, object] = {}
    rest = "" if at < 0 else body[at:]
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(KEY_OPEN):
            return None
        end = rest.find(KEY_CLOSE)
        if end < 0:
            return None
        key = rest[len(KEY_OPEN):end].strip()
        if not key or "<" in key:
            return None
        rest = rest[end + len(KEY_CLOSE):].lstrip()
        if not rest.startswith(VALUE_OPEN):
            return None
        rest = rest[len(VALUE_OPEN):]
        close = rest.find(VALUE_CLOSE)
        while close >= 0:  # a close followed by another key or the end; any other is part of the value
            after = rest[close + len(VALUE_CLOSE):].lstrip()
            if not after or after.startswith(KEY_OPEN):
                break
            close = rest.find(VALUE_CLOSE, close + 1)
        if close < 0 or key in args:
            return None
        args[key] = _value(rest[:close], kinds.get(key))
        rest = rest[close + len(VALUE_CLOSE):]
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _held(text: str, markers: Sequence[str]) -> int:
    """Characters at the end of text that could start one of markers."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ReplyParser:
    """push(text) -> events; finish() -> the last events. An event is ("reasoning", text), ("content", text) or
    ("tool_call", ToolCall). thinking: the reply starts inside a thinking block (opens_thinking(prompt)); a reply
    that starts with `<think>` opens one too. tools: the request's tools, whose names and parameter types a call is
    checked against; parse_tools=False (or no tools): tool-call text is content."""

    def __init__(self, thinking: bool, tools: Sequence[Mapping] | None = None, parse_tools: bool = True):
        self.state = "reasoning" if thinking else "content"
        self.tools = tools
        self.parse_tools = parse_tools and tools is not None
        self.tool_calls: list[ToolCall] = []
        self._pending = ""
        self._start = not thinking  # at the reply's start, where a <think> may open
        self._trim = False  # content right after </think>: its leading newlines are the format's, not text

    def _markers(self) -> tuple[str, ...]:
        tool = (TOOL_OPEN,) if self.parse_tools else ()
        if self.state == "reasoning":
            return (THINK_CLOSE, *tool)
        if self.state == "tool":
            return (TOOL_CLOSE,)
        return tool

    def push(self, text: str) -> list[tuple[str, object]]:
        self._pending += text
        events: list[tuple[str, object]] = []
        while True:
            if self._start:
                head = self._pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self._pending, self.state, self._start = head[len(THINK_OPEN):], "reasoning", False
                    continue
                if THINK_OPEN.startswith(head):  # may still become <think>
                    return events
                self._start = False
            markers = self._markers()
            found = [(self._pending.find(m), m) for m in markers if self._pending.find(m) >= 0]
            if not found:
                if self.state != "tool":
                    keep = _held(self._pending, markers) if markers else 0
                    self._emit(events, self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                return events
            at, marker = min(found)
            before, self._pending = self._pending[:at], self._pending[at + len(marker):]
            if self.state == "tool":
                call = parse_tool_call(before, self.tools)
                self.state = "content"
                if call is None:
                    self._emit(events, TOOL_OPEN + before + TOOL_CLOSE)
                else:
                    self.tool_calls.append(call)
                    events.append(("tool_call", call))
                continue
            self._emit(events, before)
            if marker == THINK_CLOSE:
                self.state, self._trim = "content", True
            else:  # a tool call (it ends any thinking)
                self.state = "tool"

    def _emit(self, events: list, text: str) -> None:
        kind = "reasoning" if self.state == "reasoning" else "content"
        if kind == "content" and self._trim:
            text = text.lstrip("\n")
            self._trim = not text
        if not text:
            return
        if events and events[-1][0] == kind:
            events[-1] = (kind, events[-1][1] + text)
        else:
            events.append((kind, text))

    def finish(self) -> list[tuple[str, object]]:
        """The held-back text: an unfinished tool call is content, as written."""
        events: list[tuple[str, object]] = []
        rest, self._pending = self._pending, ""
        if self.state == "tool":
            self.state, rest = "content", TOOL_OPEN + rest
        self._start = False
        self._emit(events, rest)
        return events
