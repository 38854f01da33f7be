"""What the bench scripts print: each line as it comes, and with a path, the same lines as a markdown
file rewritten after every line, so a run cut short (a device call's time limit) keeps what it printed."""

from __future__ import annotations

from pathlib import Path


class Report:
    def __init__(self, path: str | None = None):
        self.path, self.lines = path, []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)
        if self.path:
            Path(self.path).write_text("\n".join(self.lines) + "\n")
