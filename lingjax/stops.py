"""Stop strings: text cut exactly before the earliest stop string, while it streams.

Tokens arrive in bursts (a speculative round brings several) and a stop string can span tokens and bursts, so the
cutter keeps the text that could still be the start of a stop string and emits the rest: at every point the
emitted text is a prefix of the final text. One implementation for lingjax.generate, the CLI (`--stop`) and the
server (`stop`).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 16


def check_stop_strings(stop) -> tuple[str, ...]:
    """None, a string, or a sequence of non-empty strings (at most MAX_STOP_STRINGS) -> a tuple of them."""
    if stop is None:
        return ()
    values = [stop] if isinstance(stop, str) else stop
    if not isinstance(values, Sequence) or isinstance(values, bytes):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    bad = [s for s in values if not isinstance(s, str) or not s]
    if bad:
        raise ValueError(f"stop strings must be non-empty strings, got {bad[0]!r}")
    if len(values) > MAX_STOP_STRINGS:
        raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(values)}")
    return tuple(dict.fromkeys(values))


class StopCutter:
    """push(text) -> (text safe to emit, whether a stop string ended the text); flush() -> the held-back rest.

    Holds back only the longest end of the text that is the start of some stop string (so `def` is held while
    `\\ndef` is a stop string and the text ends in `\\nde`); `text` is everything emitted."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.text = ""
        self.stopped = False
        self._held = ""

    def _hold(self, pending: str) -> int:
        """Characters at the end of `pending` that could start a stop string."""
        for n in range(min(len(pending), max(map(len, self.stops)) - 1), 0, -1):
            tail = pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        pending = self._held + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._held, self.stopped = pending[:min(hits)], "", True
        else:
            keep = self._hold(pending)
            out, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += out
        return out, self.stopped

    def flush(self) -> str:
        out, self._held = self._held, ""
        self.text += out
        return out
