"""Helpers of the server tests: a free port and waiting for a server (bench/serve_http.py's), a server in a thread of
this process, and raw HTTP requests beside the openai client."""

import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from serve_http import free_port, wait_ready  # noqa: E402, F401  (the bench's client side, shared)


def post(url: str, body: bytes | dict, timeout_s: float = 120.0) -> tuple[int, dict]:
    """(status, JSON body) of a POST; body as given (bytes) or as JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


class ThreadServer:
    """An app served by uvicorn in a thread of this process, on a free port of 127.0.0.1."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self):
        self._thread.start()
        wait_ready(self.url)
        return self

    def __exit__(self, *exc):
        self._server.should_exit = True
        self._thread.join(timeout=30)
