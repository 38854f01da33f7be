"""`lingjax serve` end to end: the server as a subprocess on 127.0.0.1 with the shipped model, driven by the real
openai client. Greedy text through the server equals lingjax.generate's; bad requests are 400s with OpenAI's error
body and leave the server usable; a client that goes away mid-stream cancels its generation."""

import functools
import json
import os
import subprocess
import sys
import threading

import jax
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import free_port, get, post, wait_ready  # noqa: E402

import lingjax  # noqa: E402

MODEL = "ling-code-tiny"
PROMPT = "def quicksort(xs):"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # the server computes as this process does (conftest: XLA_FLAGS, inherited, and the matmul precision)
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION=jax.config.jax_default_matmul_precision,
               PYTHONPATH=os.pathsep.join([str(os.path.dirname(os.path.dirname(lingjax.__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as err:
        process = subprocess.Popen([sys.executable, "-m", "lingjax.cli", "serve", "--port", str(port), "--no-cache"],
                                   stdout=subprocess.DEVNULL, stderr=err, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, process)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{log.read_text()}") from None
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


@functools.cache
def _model():
    # as the server loads it: the shipped model in bf16, without its drafter (loaded with --spec dspark only; a plain
    # program rounds alike with or without one: test_dspark.py)
    return lingjax.load(draft=None)


def _greedy(prompt, n, **kwargs):
    return lingjax.generate(_model(), prompt, n, **kwargs)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert get(server + "/health")["status"] == "ok"


def test_completion_greedy_equals_generate(client):
    want = _greedy(PROMPT, 12)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.choices[0].text == want.text and reply.choices[0].finish_reason == want.stop_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (want.prompt_len, len(want.tokens))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.stop_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)


def test_chat_greedy_equals_lingjax_chat(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list in Python."}]
    want = lingjax.chat(_model(), messages, 10, stop=["<|role_end|>"])
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == want.text and reply.usage.completion_tokens == len(want.tokens)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.stop_reason


def test_stop_strings_and_suffix(client):
    full = _greedy(PROMPT, 16).text
    stop = full[8:12]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=["zzz", stop])
    assert reply.choices[0].text == full[:full.index(stop)] and reply.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]
    want = _greedy("def f(x):\n", 8, suffix="    return y\n")
    reply = client.completions.create(model=MODEL, prompt="def f(x):\n", suffix="    return y\n", max_tokens=8,
                                      temperature=0)
    assert reply.choices[0].text == want.text and reply.usage.prompt_tokens == want.prompt_len


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9, seed=7)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text
    want = _greedy(PROMPT, 8, temperature=0.8, top_p=0.9, seed=7)
    assert client.completions.create(**kwargs).choices[0].text == want.text


BAD = [
    ({"model": "gpt-4", "prompt": "x"}, "model", "model_not_found"),
    ({"model": MODEL, "prompt": ""}, "prompt", "invalid_value"),
    ({"model": MODEL}, "prompt", "missing_required_parameter"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "temperature": 1, "top_p": 0}, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "n": 2}, "n", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "x", "logprobs": 3}, "logprobs", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "x", "echo": True}, "echo", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "x", "frobnicate": 1}, "frobnicate", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop", "invalid_value"),
    ({"model": MODEL, "prompt": [9999999]}, "prompt", "invalid_value"),
]


@pytest.mark.parametrize("body,param,code", BAD, ids=[f"{p}-{c}" for _, p, c in BAD])
def test_bad_completion_requests_are_400s(server, body, param, code):
    status, reply = post(server + "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == param and reply["error"]["code"] == code
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]


def test_bad_chat_requests_and_malformed_json(server, client):
    status, reply = post(server + "/v1/chat/completions", b'{"model": "ling-code-tiny", "messages": [')
    assert status == 400 and reply["error"]["code"] == "invalid_json"
    for body, param in (({"model": MODEL, "messages": []}, "messages"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                         "messages[0].content"),
                        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages")):
        status, reply = post(server + "/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == param, reply
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, n=2)
    assert e.value.status_code == 400
    # the engine is still usable
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text == \
        _greedy(PROMPT, 4).text


def test_disconnect_cancels_the_generation_and_the_next_request_runs(server, client):
    before = get(server + "/health")["generations"]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2000, temperature=0, stream=True)
    pieces = [c.choices[0].text for _, c in zip(range(3), stream)]
    assert len(pieces) == 3
    stream.close()  # the client goes away mid-stream
    want = _greedy("import os", 6)
    assert client.completions.create(model=MODEL, prompt="import os", max_tokens=6, temperature=0).choices[0].text \
        == want.text
    after = get(server + "/health")["generations"]
    assert after["cancelled"] == before["cancelled"] + 1 and after["completed"] == before["completed"] + 1


def test_concurrent_clients_each_get_their_own_answer(client):
    prompts = ["def add(a, b):", "import json\n", "class Stack:", "for i in range(10):"]
    want = {p: _greedy(p, 8).text for p in prompts}
    got, errors = {}, []

    def ask(p):
        try:
            got[p] = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and got == want, json.dumps([errors, got, want], default=str)


def test_serve_bench_over_http(server, tmp_path):
    from pathlib import Path

    root = Path(lingjax.__file__).resolve().parent.parent
    out = tmp_path / "http.md"
    run = subprocess.run([sys.executable, str(root / "bench" / "serve_bench.py"), "--url", server, "--prompt-len",
                          "12", "--output-len", "6", "--requests", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    report = out.read_text()
    assert f"over HTTP: {MODEL} at {server}" in report and "| requests measured | 2 (asked 2," in report
    for row in ("mean TPOT", "median TPOT", "output throughput", "mean TTFT"):
        assert f"| {row} | " in report


def test_raw_stream_shape(server):
    import urllib.request

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(server + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode() for line in r if line.strip()]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]\n"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
    *text, usage = chunks
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    for c in text:
        (choice,) = c["choices"]
        assert set(choice) >= {"index", "delta", "finish_reason"} and choice["index"] == 0
    assert [c["choices"][0]["finish_reason"] for c in text][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
