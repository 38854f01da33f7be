"""Ling-3's thinking and tool calls split from a reply (lingjax.serve.reasoning): strings in the format Ling-3's
chat template writes, pushed in every split, and a scripted model stand-in behind the real app and the openai
client, so no chat-trained model is needed."""

import dataclasses
import itertools
import json
import random
import socket

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import ThreadServer, get, post  # noqa: E402

from lingjax.detokenize import TextStream  # noqa: E402
from lingjax.serve.app import create_app  # noqa: E402
from lingjax.serve.backend import Cancelled, Prompt  # noqa: E402
from lingjax.serve.reasoning import ReplyParser, opens_thinking, parse_tool_call  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"file": {"type": "string"}, "pattern": {"type": "string"},
                                     "start_line": {"type": "integer"}}}}}
TOOLS = [WEATHER, SEARCH]


def _split(text, thinking=True, tools=TOOLS, pieces=None):
    """The parser's events over text pushed in the given piece lengths, merged by kind:
    [(kind, text or [(name, arguments)])]."""
    parser = ReplyParser(thinking, tools)
    events, at = [], 0
    for n in pieces or [len(text)]:
        events += parser.push(text[at:at + n])
        at += n
    events += parser.push(text[at:]) + parser.finish()
    merged = []
    for kind, group in itertools.groupby(events, key=lambda e: e[0]):
        values = [v for _, v in group]
        merged.append((kind, [(c.name, json.loads(c.arguments)) for c in values] if kind == "tool_call"
                       else "".join(values)))
    return merged


def _every_split(text, **kwargs):
    """The same events for the whole text, one character at a time, and random pieces."""
    want = _split(text, **kwargs)
    rng = random.Random(len(text))
    for pieces in ([1] * len(text), [rng.randint(1, 6) for _ in range(len(text))], [2] * len(text)):
        assert _split(text, pieces=pieces, **kwargs) == want
    return want


CASES = [
    # thinking, then the answer after </think> (its newlines are the format's)
    ("I should add.</think>\n\nIt is 4.", True, [("reasoning", "I should add."), ("content", "It is 4.")]),
    # a tool call opened before </think> ends the thinking; arguments with no separator between them
    ("Need the weather.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", True,
     [("reasoning", "Need the weather."), ("tool_call", [("get_weather", {"city": "Rome", "days": 3})])]),
    # closed thinking, prose, two calls, trailing prose; a string parameter keeps "100" as text
    ("Plan.</think>Looking.<tool_call>search\n<arg_key>file</arg_key>\n<arg_value>app.log</arg_value>\n"
     "<arg_key>pattern</arg_key>\n<arg_value>100</arg_value>\n<arg_key>start_line</arg_key>\n<arg_value>100"
     "</arg_value>\n</tool_call><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
     "</tool_call>\nDone.", True,
     [("reasoning", "Plan."), ("content", "Looking."),
      ("tool_call", [("search", {"file": "app.log", "pattern": "100", "start_line": 100}),
                     ("get_weather", {"city": "Oslo"})]), ("content", "\nDone.")]),
    # a value that holds the closing tag as text
    ("</think><tool_call>search\n<arg_key>pattern</arg_key>\n<arg_value>use </arg_value> in docs</arg_value>\n"
     "</tool_call>", True, [("tool_call", [("search", {"pattern": "use </arg_value> in docs"})])]),
    # thinking off (the prompt closed the block): all content; a reply that opens <think> itself
    ("Just the answer.", False, [("content", "Just the answer.")]),
    ("<think>hmm</think>\nYes.", False, [("reasoning", "hmm"), ("content", "Yes.")]),
    # malformed calls stay content, as written
    ("</think>A<tool_call>\n<arg_key>city</arg_key></tool_call>B", True,
     [("content", "A<tool_call>\n<arg_key>city</arg_key></tool_call>B")]),
    ("</think><tool_call>launch_rockets\n<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>", True,
     [("content", "<tool_call>launch_rockets\n<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>")]),
    ("</think><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Ro", True,
     [("content", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Ro")]),
    # a stray byte (decoded as U+FFFD) is text like any other
    ("a\ufffdb</think>c\ufffd<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>\ufffd</arg_value>"
     "</tool_call>", True,
     [("reasoning", "a\ufffdb"), ("content", "c\ufffd"), ("tool_call", [("get_weather", {"city": "\ufffd"})])]),
    # text that merely starts like a marker
    ("x <tool y</think>a <thinkable> b", True, [("reasoning", "x <tool y"), ("content", "a <thinkable> b")]),
]


@pytest.mark.parametrize("text,thinking,want", CASES)
def test_official_format_in_every_split(text, thinking, want):
    assert _every_split(text, thinking=thinking) == want


def test_without_tools_tool_text_is_content():
    text = "</think><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value></tool_call>"
    assert _every_split(text, tools=None) == [("content", text[len("</think>"):])]


def test_parse_tool_call_refuses_what_is_not_a_call():
    assert parse_tool_call("get_weather").name == "get_weather"  # a call without arguments
    for body in ("", "two words", "f<arg_key>k</arg_key>v", "f<arg_key>k</arg_key><arg_value>1",
                 "f<arg_key>k</arg_key><arg_value>1</arg_value><arg_key>k</arg_key><arg_value>2</arg_value>"):
        assert parse_tool_call(body) is None, body


def test_where_the_reply_starts():
    assert opens_thinking("<role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role>\n<think>")
    assert not opens_thinking("<role>ASSISTANT</role>\n<think></think>")
    assert not opens_thinking("no template markers")


# ---- a scripted model behind the real app ------------------------------------------------------------------
LING_TEMPLATE_END = {True: "<role>ASSISTANT</role>\n<think>", False: "<role>ASSISTANT</role>\n<think></think>"}


@dataclasses.dataclass
class _Result:
    tokens: list
    prompt_len: int
    stop_reason: str


class ScriptedBackend:
    """A model stand-in that emits given token ids (the shipped tokenizer's, so bytes split across tokens), in
    bursts of `burst` tokens as a speculative round brings them, through the engine's own TextStream."""

    name = "scripted"

    def __init__(self, tokenizer, reply: str, burst: int = 3):
        self.tokenizer, self.burst = tokenizer, burst
        self.reply_ids = tokenizer.encode(reply)

    def completion_prompt(self, req):
        return Prompt([1, 2, 3], req.prompt)

    def chat_prompt(self, req):
        thinking = req.template_kwargs.get("enable_thinking", True)
        text = "".join(f"<role>{m['role'].upper()}</role>{m['content']}<|role_end|>" for m in req.messages)
        return Prompt(self.tokenizer.encode(text), text + LING_TEMPLATE_END[bool(thinking)])

    def plan(self, prompt, sampling, chat):
        return {"max_new_tokens": sampling.max_new_tokens or 1024}

    def run(self, prompt, kwargs, on_text, cancelled):
        stream = TextStream(self.tokenizer)
        ids = self.reply_ids[:kwargs["max_new_tokens"]]
        for at in range(0, len(ids), self.burst):
            if cancelled():
                raise Cancelled
            if at and "FAIL" in (prompt.text or ""):
                raise RuntimeError("the device fell over")
            text = stream.push(ids[at:at + self.burst])
            if text:
                on_text(text)
        rest = stream.flush()
        if rest:
            on_text(rest)
        return _Result(ids, len(prompt.ids), "stop")


REPLY = ("The user wants Rome's weather; ünïcode 🙂 thoughts.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
         "<arg_value>Rome</arg_value><arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")


SCRIPTED_TOKENS = [0]


@pytest.fixture(scope="module")
def scripted():
    from lingjax.loading import resolve, source_tokenizer
    from lingjax.shipped import default_checkpoint

    cfg, directory = resolve(default_checkpoint())
    tokenizer = source_tokenizer(cfg, directory, "shipped")
    backend = ScriptedBackend(tokenizer, REPLY)
    SCRIPTED_TOKENS[:] = [len(backend.reply_ids)]
    with ThreadServer(create_app(backend)) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_scripted_reasoning_and_tool_calls_not_streamed(scripted):
    _, client = scripted
    reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Rome?"}],
                                           tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "The user wants Rome's weather; ünïcode 🙂 thoughts."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome", "days": 2}
    assert not choice.message.content
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens == SCRIPTED_TOKENS[0]


def test_scripted_reasoning_and_tool_calls_streamed(scripted):
    _, client = scripted
    chunks = list(client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Rome?"}], tools=TOOLS, stream=True,
        stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "The user wants Rome's weather; ünïcode 🙂 thoughts."
    assert sum(bool(d.model_extra.get("reasoning_content")) for d in deltas) > 1  # streamed, not at the end
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Rome", "days": 2})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > chunks[-1].usage.completion_tokens > 0


def test_scripted_thinking_off_and_tool_choice_none_give_content(scripted):
    server, client = scripted
    reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Rome?"}],
                                           tools=TOOLS, tool_choice="none",
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content == REPLY and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.tool_calls is None
    status, body = post(server.url + "/v1/chat/completions", {"model": "scripted", "tool_choice": "required",
                                                               "messages": [{"role": "user", "content": "x"}],
                                                               "tools": TOOLS})
    assert status == 400 and body["error"]["param"] == "tool_choice"


def test_an_earlier_calls_arguments_reach_the_template_as_a_mapping():
    from lingjax.serve.protocol import ApiError, chat_request

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    body = {"model": "m", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Rome?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    req = chat_request(body, "m")
    assert req.messages[1]["content"] == "" and req.messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Rome"}
    assert req.messages[2]["tool_call_id"] == "call_1" and req.tool_choice == "auto"
    call["function"]["arguments"] = "[1, 2"
    with pytest.raises(ApiError, match="arguments must be a JSON object"):
        chat_request(body, "m")


def test_serve_refuses_a_bad_command_line_before_loading(capsys):
    from lingjax import cli

    for argv, error in ((["--port", "70000"], "--port must be in [1, 65535]"),
                        (["--steps", "3"], "--steps (drafts per speculative round) has no effect without spec"),
                        (["--draft", "none"], "--draft has no effect without --spec dspark"),
                        (["--draft-vocab", "25%"], "--draft-vocab has no effect without --spec"),
                        (["--spec", "nextn", "--draft-vocab", "0"], "--draft-vocab: ")):
        assert cli.main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lingjax: error: ") and error in err and err.count("\n") == 1
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
        assert f"lingjax: error: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_generation_that_fails_midway_is_reported_and_frees_the_engine(scripted):
    server, client = scripted
    before = get(server.url + "/health")["generations"]
    with pytest.raises(openai.InternalServerError, match="the device fell over"):
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "FAIL"}])
    with pytest.raises(openai.APIError, match="the device fell over"):
        list(client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "FAIL"}],
                                            stream=True))
    reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Rome?"}],
                                           tools=TOOLS)
    assert reply.choices[0].finish_reason == "tool_calls"
    after = get(server.url + "/health")["generations"]
    assert after["failed"] == before["failed"] + 2 and after["completed"] == before["completed"] + 1


def test_the_worker_runs_one_generation_at_a_time_first_come_first_served():
    import asyncio
    import threading

    from lingjax.serve.backend import Worker

    order, running, overlap = [], [], []
    gate = threading.Event()

    def job(name):
        def run(on_text, cancelled):
            running.append(name)
            overlap.append(len(running))
            if name == "a":
                gate.wait(timeout=60)  # the first holds the engine while the others queue
            order.append(name)
            on_text(name)
            running.remove(name)
            return name
        return run

    async def main():
        worker = Worker()

        async def ask(name):
            j = await worker.submit(job(name))
            events = []
            while not events or events[-1][0] == "text":
                events.append(await j.events.get())
            return events

        tasks = [asyncio.create_task(ask(n)) for n in "abcd"]
        await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(*tasks), worker.counts

    results, counts = asyncio.run(main())
    assert order == list("abcd") and max(overlap) == 1
    assert results == [[("text", n), ("done", n)] for n in "abcd"] and counts["completed"] == 4
