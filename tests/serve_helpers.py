"""Helpers of the server tests: a free port, a server (a subprocess, or the app in a thread of this process) and
raw HTTP requests beside the openai client."""

import json
import socket
import threading
import time
import urllib.error
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
