"""Chat templates: a checkpoint's jinja2 `chat_template`, rendered the way transformers renders it.

The environment matches transformers' apply_chat_template: a sandbox, `trim_blocks` and `lstrip_blocks`, the
loop-control extension, `raise_exception(msg)`, a `tojson` filter that keeps non-ASCII text, `strftime_now(fmt)`,
and the template variables `messages`, `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`,
...) and any keyword the caller passes (`enable_thinking=False`, `tools=[...]`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """Messages a template cannot take, or a template that fails to render."""


def check_messages(messages) -> list[dict]:
    """messages: a non-empty list of {"role": one of ROLES, "content": str}; returns plain dicts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ChatError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise ChatError(f"message {i}'s role must be one of {', '.join(ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ChatError(f"message {i}'s content must be a str, got {type(m['content']).__name__}")
        out.append(dict(m))
    return out


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatError(f"the chat template does not parse: {e}") from None


def render(template: str, messages, *, add_generation_prompt: bool = True,
           special_tokens: Mapping[str, str] | None = None, **kwargs) -> str:
    """The prompt text of a conversation; add_generation_prompt ends it where the assistant's reply starts."""
    import jinja2

    messages = check_messages(messages)
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          **dict(special_tokens or {}), **kwargs)
    except jinja2.exceptions.TemplateError as e:
        raise ChatError(f"the chat template failed: {e}") from None


def render_for(tokenizer, source: str, messages, *, add_generation_prompt: bool = True, **variables) -> str:
    """render() with a tokenizer's own template and special tokens; ChatError naming `source` when it has no
    chat template (no tokenizer, or tokenizer_config.json without `chat_template`)."""
    if tokenizer is None or tokenizer.chat_template is None:
        raise ChatError(f"{source} has no chat template (tokenizer_config.json chat_template): it is not a chat "
                        "model; complete text with `lingjax generate` instead")
    return render(tokenizer.chat_template, messages, add_generation_prompt=add_generation_prompt,
                  special_tokens=tokenizer.special_tokens, **variables)
