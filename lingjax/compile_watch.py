"""Which of lingjax's programs is being compiled, and for how long, from jax's own monitoring events.

A program's first call traces it, lowers it and compiles it (or loads it from the persistent compilation cache),
which on a big model takes seconds to minutes. `watch()` starts counting: `seconds()` is the compile time so far
(generate reports what its run spent), and with `show(stream)` a status line ("compiling the decode step… 12 s")
is redrawn on a terminal while one compiles and erased when it is done (a plain line after it, elsewhere).
Programs compiled together (lingjax.precompile) are one piece of work: `together(names)` around it.
"""

from __future__ import annotations

import contextlib
import threading
import time

import jax

# the top-level step programs (their traced functions' names) and what a user calls them
PROGRAMS = {
    "_prefill_impl": "the prefill",
    "_decode_impl": "the decode step",
    "_extend_logits_impl": "the forward",
    "_prefill_chunk": "the speculative prefill",
    "_rounds": "the speculative round",
}
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
SHOW_AFTER_S = 1.0  # a status line only for work this long


def _program(fun_name: str) -> str | None:
    return PROGRAMS.get(fun_name.removeprefix("jit(").removesuffix(")"))


class _Watch:
    def __init__(self):
        self.lock = threading.Lock()
        self.total_s = 0.0  # seconds spent compiling (or loading) lingjax's programs
        self.current: tuple[str, float] | None = None  # (program, start) while one is traced or compiled
        self.cached = False
        self.together = 0  # while > 0, programs compiled together: their own events are that one piece of work's
        self.hits = 0  # persistent-cache hits during it
        self.stream = None
        self.quiet = lambda: False  # while true the status line is not drawn (text on the current line)
        self.shown = False
        self.ticker: threading.Thread | None = None

    # ---- jax.monitoring listeners ----
    def on_start(self, event: str, value: float, fun_name: str = "", **_) -> None:
        if self.together:
            return
        if event == _TRACE and (name := _program(fun_name)) is not None:
            with self.lock:
                self.current, self.cached = (name, time.perf_counter()), False

    def on_event(self, event: str, **_) -> None:
        if event == _CACHE_HIT and self.current is not None:
            with self.lock:
                self.hits += 1
            if not self.together:  # together() decides from the hits at its end
                self.cached = True

    def on_end(self, event: str, seconds: float, fun_name: str = "", **_) -> None:
        if self.together or event != _COMPILE or _program(fun_name) is None:
            return
        with self.lock:
            current, self.current = self.current, None
        if current is None:
            return
        name, start = current
        spent = time.perf_counter() - start
        self.total_s += spent
        self._finish(name, spent)

    # ---- the status line ----
    def _finish(self, name: str, spent: float) -> None:
        try:
            self._erase_or_say(name, spent)
        except (OSError, ValueError):  # the stream went away: a status line is never worth an error
            self.stream = None

    def _erase_or_say(self, name: str, spent: float) -> None:
        stream = self.stream
        if stream is None:
            return
        what = "loaded" if self.cached else "compiled"
        with self.lock:
            if stream.isatty():
                if self.shown:
                    stream.write("\r\033[K")
                    stream.flush()
            elif spent >= SHOW_AFTER_S:
                stream.write(f"{what} {name} in {spent:.1f} s\n")
                stream.flush()
            self.shown = False

    def _tick(self) -> None:
        while True:
            time.sleep(0.25)
            try:
                self._draw()
            except (OSError, ValueError):
                self.stream = None

    def _draw(self) -> None:
        with self.lock:
            stream, current = self.stream, self.current
            if stream is None or current is None or not stream.isatty() or self.quiet():
                return
            name, start = current
            spent = time.perf_counter() - start
            if spent >= SHOW_AFTER_S:
                verb = "loading" if self.cached else "compiling"
                stream.write(f"\r\033[K{verb} {name}… {spent:.0f} s")
                stream.flush()
                self.shown = True


_watch: _Watch | None = None


def watch() -> _Watch:
    """Start counting (once per process; idempotent)."""
    global _watch
    if _watch is None:
        _watch = _Watch()
        jax.monitoring.register_scalar_listener(_watch.on_start)
        jax.monitoring.register_event_listener(_watch.on_event)
        jax.monitoring.register_event_duration_secs_listener(_watch.on_end)
    return _watch


@contextlib.contextmanager
def together(names: list[str]):
    """Counts the work inside as one piece, named by the programs it compiles (one name each, ["the speculative
    prefill", "the speculative prefill", "the speculative round"]): one status line, "loaded" when the persistent
    cache held every one of them."""
    w = watch()
    unique = list(dict.fromkeys(names))
    label = unique[0] if len(unique) == 1 else ", ".join(unique[:-1]) + " and " + unique[-1]
    with w.lock:
        w.together += 1
        w.current, w.cached, w.hits = (label, time.perf_counter()), False, 0
    try:
        yield
    finally:
        with w.lock:
            w.together -= 1
            current, w.current = w.current, None
            w.cached = w.hits >= len(names)
        spent = time.perf_counter() - current[1]
        w.total_s += spent
        w._finish(label, spent)


def seconds() -> float:
    """Seconds spent compiling or loading lingjax's programs since watch() (0 before it)."""
    return _watch.total_s if _watch is not None else 0.0


def show(stream, quiet=None) -> None:
    """Draw the status line on `stream` (stderr): redrawn in place on a terminal while `quiet()` is false, a plain
    line after each program elsewhere; None stops drawing (the command that asked for it is done)."""
    w = watch()
    with w.lock:
        w.stream = stream
        w.quiet = quiet or (lambda: False)
        w.shown = False
    if stream is not None and w.ticker is None and stream.isatty():
        w.ticker = threading.Thread(target=w._tick, name="lingjax-compile-status", daemon=True)
        w.ticker.start()
