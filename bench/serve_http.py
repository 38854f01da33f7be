"""serve_bench's --url mode: the same requests sent to a running `lingjax serve` over HTTP, one after another,
streamed; TTFT and TPOT measured at the client with the write-up's definitions (TPOT = (latency - TTFT) / (output
tokens - 1), TPOT excludes TTFT; the output tokens are the server's usage count, since a speculative round brings
several tokens in one chunk). Also what a client needs to start one: a free port, and waiting until it answers."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process=None, timeout_s: float = 300.0) -> None:
    """Polls GET url/health until it answers (or the process exits, or timeout_s passes: generous, never timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            said = process.stderr.read() if process.stderr is not None else "(its stderr went to a file)"
            raise RuntimeError(f"the server exited with status {process.returncode}:\n{said}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server at {url} did not answer in {timeout_s} s")


@dataclasses.dataclass(frozen=True)
class HttpResult:
    ttft_s: float  # request sent -> first chunk with text
    total_s: float  # request sent -> the last chunk
    tokens: int  # usage.completion_tokens

    @property
    def tpot_s(self) -> float:
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else float("nan")


def served_model(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=60) as r:
        return json.loads(r.read())["data"][0]["id"]


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 600) -> HttpResult:
    """One streamed greedy completion of token ids, EOS ignored -> its client-side times and token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = tokens = None
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed the request: {chunk['error']['message']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - start
        total = time.perf_counter() - start
    if tokens is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return HttpResult(ttft_s=first if first is not None else total, total_s=total, tokens=tokens)
