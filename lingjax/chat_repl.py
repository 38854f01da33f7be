"""`lingjax chat`: an interactive multi-turn session over one loaded model.

Each turn renders the whole conversation with the model's chat template and generates the reply, streaming
its text. Ctrl-C while a reply streams stops that reply and keeps what was shown as the assistant's turn;
Ctrl-C at the prompt clears the line; Ctrl-D (end of input) or /exit ends the session; /reset forgets the
conversation. A turn that cannot run (the conversation past the model's maximum length) is one error line
and the session goes on.
"""

from __future__ import annotations

from lingjax import engine
from lingjax.chat_template import ChatError

PROMPT = "> "
COMMANDS = "/reset forgets the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply"


class ChatSession:
    def __init__(self, model, *, system: str | None = None, template_kwargs: dict | None = None,
                 generation_kwargs: dict | None = None, generate=None):
        """generate(model, messages, on_text=..., **generation_kwargs) -> result with .text; lingjax.chat
        by default (a seam for tests)."""
        if generate is None:
            generate = engine.chat
        self.model = model
        self.system = system
        self.template_kwargs = dict(template_kwargs or {})
        self.generation_kwargs = dict(generation_kwargs or {})
        self.generate = generate
        self.messages: list[dict] = []
        self.streaming = False  # a reply's text is on the current line (no status line may be drawn over it)
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    def reply(self, user: str, write) -> str:
        """Generate the reply to one user turn, streaming its text through write(str); returns the text kept
        in the conversation (all of it, or what was shown when Ctrl-C stopped it)."""
        shown: list[str] = []

        def on_text(piece: str) -> None:
            shown.append(piece)
            self.streaming = True
            write(piece)

        self.messages.append({"role": "user", "content": user})
        try:
            self.generate(self.model, self.messages, on_text=on_text, template_kwargs=self.template_kwargs,
                          **self.generation_kwargs)
        except KeyboardInterrupt:
            write(" [stopped]")
        except (ValueError, ChatError):
            self.messages.pop()
            raise
        finally:
            self.streaming = False
        text = "".join(shown)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def run(self, stdin, stdout, stderr) -> int:
        interactive = stdin.isatty()

        def write(text: str) -> None:
            stdout.write(text)
            stdout.flush()

        if interactive:
            stderr.write(f"lingjax chat with {self.model.source}: {COMMANDS}\n")
        while True:
            try:
                if interactive:
                    line = input(PROMPT)
                else:
                    line = stdin.readline()
                    if not line:
                        return 0
                    line = line.rstrip("\n")
            except EOFError:
                if interactive:
                    stderr.write("\n")
                return 0
            except KeyboardInterrupt:
                stderr.write("\n")
                continue
            command = line.strip()
            if not command:
                continue
            if command == "/exit":
                return 0
            if command == "/reset":
                self.reset()
                stderr.write("(conversation cleared)\n")
                continue
            try:
                self.reply(line, write)
            except (ValueError, ChatError) as e:
                stderr.write(f"lingjax: error: {e}\n")
                continue
            write("\n")
