"""Text <-> token ids: a checkpoint's own tokenizer files, or a byte-level tokenizer for the random presets.

`Tokenizer.from_dir` reads the Hugging Face layout: `tokenizer.json` (run by the `tokenizers` library), and the
special tokens from tokenizer_config.json, then generation_config.json, then config.json (the first file that
names a value wins, as transformers resolves them). The stop set is the generation config's EOS ids (config.json's
when there is no generation_config.json) plus the tokenizer's EOS token: Ling-3 stops at both `<|endoftext|>` and
the chat turn's end `<|role_end|>`. The chat template is tokenizer_config.json's `chat_template` (or a
`chat_template.jinja` beside it); lingjax.chat_template renders it.

`Tokenizer.byte_level(cfg)` is the presets' tokenizer: ids 0..255 are the bytes of UTF-8 text, the config's EOS
ids are `<|endoftext|>`; any other id decodes as the byte `id % 256`, so every id a random
model can draw has a text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from lingjax.config import LingConfig

log = logging.getLogger("lingjax")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
EOS_TEXT = "<|endoftext|>"


class TokenizerError(ValueError):
    """Tokenizer files that do not fit the checkpoint, or text asked of a checkpoint without a tokenizer."""


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None


def _token_text(value) -> str | None:
    """tokenizer_config spells a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _chat_template(config: dict, directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not template and (directory / "chat_template.jinja").exists():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return template or None


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, the special and stop ids, the chat template.

    decode skips special tokens unless asked (a stop token is not text); text that ends inside a multi-byte
    character decodes its partial bytes as U+FFFD (lingjax.detokenize holds those back when streaming)."""

    def __init__(self, backend, *, stop_ids: Iterable[int], special_ids: Iterable[int], chat_template: str | None,
                 special_tokens: dict[str, str], source: str):
        self._backend = backend
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.special_ids = frozenset(int(i) for i in special_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)  # "eos_token", "bos_token", "pad_token" -> text
        self.source = source

    def __repr__(self) -> str:
        return f"Tokenizer({self.source}, {self.vocab_size} ids, stops {sorted(self.stop_ids)})"

    @property
    def vocab_size(self) -> int:
        """One past the largest id this tokenizer can produce."""
        return self._backend.vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special tokens written in the text (`<|role_end|>`) become their ids; no BOS
        is added (a chat template writes what the model expects)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates: bytes that were not UTF-8, decoded with surrogateescape
            bad = text[e.start].encode("utf-8", "surrogateescape") if "\udc80" <= text[e.start] <= "\udcff" else None
            what = f"byte 0x{bad[0]:02x}" if bad else f"character {text[e.start]!r}"
            raise TokenizerError(f"the text is not valid UTF-8 ({what} at character {e.start})") from None
        return self._backend.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self._backend.token_id(text)

    @classmethod
    def from_dir(cls, directory: str | Path, cfg: LingConfig) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
        directory = Path(directory)
        if not (directory / "tokenizer.json").exists():
            return None
        import tokenizers

        try:
            hf = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise TokenizerError(f"{directory / 'tokenizer.json'}: cannot be read by tokenizers ({e})") from None
        backend = _HFBackend(hf)
        tok_cfg = _read_json(directory / "tokenizer_config.json")
        gen_cfg = _read_json(directory / "generation_config.json")
        model_cfg = _read_json(directory / "config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        special: dict[str, str] = {}
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            text = _token_text(tok_cfg.get(name)) or _token_text(special_map.get(name))
            if text is None:  # fall back to the id the generation config or the model config names
                key = name.replace("_token", "_token_id")
                ids = _ids(gen_cfg.get(key, model_cfg.get(key)))
                text = backend.id_token(ids[0]) if ids else None
            if text is not None:
                special[name] = text
        stops = _ids(gen_cfg["eos_token_id"]) if "eos_token_id" in gen_cfg else list(cfg.eos_token_ids)
        eos = backend.token_id(special["eos_token"]) if "eos_token" in special else None
        if eos is not None:
            stops.append(eos)
        if backend.vocab_size > cfg.vocab_size:
            raise TokenizerError(f"{directory / 'tokenizer.json'} has ids up to {backend.vocab_size - 1}, past "
                                 f"the model's vocabulary of {cfg.vocab_size}")
        bad = [i for i in stops if not 0 <= i < cfg.vocab_size]
        if bad:
            raise TokenizerError(f"{directory}: stop ids {bad} are outside the vocabulary [0, {cfg.vocab_size})")
        return cls(backend, stop_ids=stops, special_ids=backend.special_ids(), chat_template=_chat_template(
            tok_cfg, directory), special_tokens=special, source=str(directory))

    @classmethod
    def byte_level(cls, cfg: LingConfig, source: str = "byte-level") -> Tokenizer:
        """The presets' tokenizer (module docstring); its chat template is the Ling-3 turn layout."""
        special = {int(i): EOS_TEXT for i in cfg.eos_token_ids}
        backend = _ByteBackend(cfg.vocab_size, special)
        tokens = {"eos_token": EOS_TEXT} if cfg.eos_token_ids else {}
        return cls(backend, stop_ids=cfg.eos_token_ids, special_ids=special, chat_template=BYTE_CHAT_TEMPLATE,
                   special_tokens=tokens, source=source)


# The presets' chat layout: Ling-3's turns (<role>NAME</role> text, then a turn end), written as plain text
# because a byte-level vocabulary has no room for the role tokens.
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% set role = {'user': 'HUMAN', 'assistant': 'ASSISTANT', 'system': 'SYSTEM'}.get(m['role'], m['role'] | upper) %}"
    "<role>{{ role }}</role>{{ m['content'] }}<|role_end|>"
    "{% endfor %}{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}"
)


class _HFBackend:
    def __init__(self, hf):
        self._hf = hf
        added = hf.get_added_tokens_decoder()
        self._special = {i for i, t in added.items() if t.special}
        self.vocab_size = max([hf.get_vocab_size(with_added_tokens=True) - 1, *added]) + 1

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self._hf.token_to_id(text)

    def id_token(self, i: int) -> str | None:
        return self._hf.id_to_token(i)

    def special_ids(self) -> set[int]:
        return set(self._special)


class _ByteBackend:
    def __init__(self, vocab_size: int, special: dict[int, str]):
        self.vocab_size = vocab_size
        self._special = dict(special)
        self._by_text = {t: i for i, t in sorted(special.items(), reverse=True)}  # the lowest id per text

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        rest = text
        while rest:
            cut = min(((rest.find(t), t) for t in self._by_text if t in rest), default=None)
            if cut is None:
                ids += rest.encode("utf-8")
                break
            at, token = cut
            ids += rest[:at].encode("utf-8")
            ids.append(self._by_text[token])
            rest = rest[at + len(token):]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        out, run = [], bytearray()
        for i in ids:
            if i in self._special:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                if not skip_special_tokens:
                    out.append(self._special[i])
            else:
                run.append(i % 256)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_id(self, text: str) -> int | None:
        return self._by_text.get(text)

    def id_token(self, i: int) -> str | None:
        return self._special.get(i)

    def special_ids(self) -> set[int]:
        return set(self._special)
