"""Streaming detokenization: text as tokens arrive, exactly `decode(all tokens)` once flushed.

A token can end inside a multi-byte character (byte-level BPE, byte-fallback tokens), and some decoders treat a
window's first token specially (SentencePiece drops its leading space). So the stream decodes a window that
starts a few tokens back, emits what the window's text gained beyond what was already emitted, and holds back
only trailing U+FFFD characters: the bytes of a character still incomplete, which the next token may finish.
At every point the emitted text is a prefix of decode(tokens so far), short of those held-back characters only;
flush() emits them as they stand.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"
OVERLAP = 4  # tokens of context kept at a window's start


class TextStream:
    """push(ids) -> the new text; flush() -> the held-back rest. `text` is everything emitted."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._start = 0  # token index the decode window starts at
        self._done = 0  # characters of the window's text already emitted

    def _window(self) -> str:
        return self._tokenizer.decode(self.ids[self._start:], skip_special_tokens=self._skip)

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        window = self._window()
        stable = window.rstrip(REPLACEMENT)
        new = stable[self._done:]
        self._done = max(self._done, len(stable))
        self.text += new
        if len(stable) == len(window) and len(self.ids) - self._start > 2 * OVERLAP:
            # nothing pending: restart the window OVERLAP tokens back, its text so far counted as emitted
            self._start = len(self.ids) - OVERLAP
            self._done = len(self._window())
        return new

    def flush(self) -> str:
        new = self._window()[self._done:]
        self._done += len(new)
        self.text += new
        return new
