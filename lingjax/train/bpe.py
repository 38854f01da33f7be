"""The byte-level BPE tokenizer of the embedded code model, trained with the `tokenizers` library, and
its Hugging Face files (docs/corpus.md).

    tok = train_tokenizer(f.text for f in corpus.train)        # vocab 8192, ids 0..7 special
    save_tokenizer_files(tok, out_dir, model_max_length=4096)  # tokenizer.json + HF config files
    tok = load_tokenizer(out_dir)

Byte-level: every string encodes (no unknown token) and decode(encode(s)) == s for any Unicode text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# Ids 0..7, in this order, at the start of the vocabulary. Names as in the Ling-3 tokenizer; the FIM
# tokens are reserved (no training data uses them).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|role_end|>",
    "<role>",
    "</role>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
)
EOS = "<|endoftext|>"
EOS_ID = SPECIAL_TOKENS.index(EOS)  # 0
ROLE_END = "<|role_end|>"

# The split before the byte mapping (no merge crosses a piece boundary). In order: an identifier or word
# (letters, marks, "_", then digits too) with at most one leading space or punctuation char ("(self",
# ".append"); 1-3 digits with at most one leading space; a run of punctuation with at most one leading
# space; newlines together with the indentation after them; other runs of spaces or tabs, leaving the
# last space to the piece after it (GPT-2's \s+(?!\S)). Newline + indentation is one piece so that BPE
# learns "\n" + 4k spaces as single tokens: the start of a Python line costs one token.
SPLIT_PATTERN = (
    r"[^\r\n\p{L}\p{M}\p{N}_]?[\p{L}\p{M}_][\p{L}\p{M}\p{N}_]*"
    r"| ?\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{M}\p{N}_]+"
    r"|[\r\n]+[ \t]*"
    r"|[^\S\r\n]+(?!\S)"
    r"|[^\S\r\n]+"
)

# A Ling-3-shaped chat template: <role>ROLE</role>content<|role_end|> per message, roles SYSTEM, HUMAN
# (for "user") and ASSISTANT; enable_thinking=false without a system message adds a SYSTEM turn
# "detailed thinking off"; add_generation_prompt opens an ASSISTANT turn.
CHAT_TEMPLATE = (
    "{%- set names = {'system': 'SYSTEM', 'user': 'HUMAN', 'human': 'HUMAN', 'assistant': 'ASSISTANT'} -%}"
    "{%- set ns = namespace(has_system=false) -%}"
    "{%- for m in messages if m['role'] == 'system' -%}{%- set ns.has_system = true -%}{%- endfor -%}"
    "{%- if enable_thinking is defined and not enable_thinking and not ns.has_system -%}"
    "<role>SYSTEM</role>detailed thinking off<|role_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "<role>{{ names.get(m['role'], m['role'] | upper) }}</role>"
    "{{ m['content'] if m['content'] is not none else '' }}<|role_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<role>ASSISTANT</role>{%- endif -%}"
)


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer: SPLIT_PATTERN, then the byte-to-unicode map (no regex of
    its own, no prefix space), and the matching decoder. No normalizer, so no text is altered."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, *, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly vocab_size ids, trained on texts: SPECIAL_TOKENS at ids
    0..7 (added as special tokens, each encodes as one id), then the 256 byte symbols, then merges.
    Raises ValueError when texts hold too few pairs seen min_frequency times to fill vocab_size."""
    base = len(SPECIAL_TOKENS) + 256
    if vocab_size <= base or vocab_size > 65536:
        raise ValueError(f"vocab_size must be in ({base}, 65536], got {vocab_size}")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(f"the texts fill only {got} of {vocab_size} ids at min_frequency={min_frequency}")
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def _added_token(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast: EOS as eos and pad, no BOS,
    every special token in added_tokens_decoder, and CHAT_TEMPLATE."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != EOS],
        "added_tokens_decoder": {str(i): _added_token(t) for i, t in enumerate(SPECIAL_TOKENS)},
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != EOS]}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def save_tokenizer_files(tok: Tokenizer, out_dir: Path, *, model_max_length: int) -> None:
    """Writes the Hugging Face layout to out_dir: tokenizer.json (compact, one line), tokenizer_config.json
    and special_tokens_map.json (small, indented)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    _write_json(out / "tokenizer_config.json", tokenizer_config(model_max_length))
    _write_json(out / "special_tokens_map.json", special_tokens_map())


def load_tokenizer(path: Path | str) -> Tokenizer:
    """The tokenizer in path: a directory holding tokenizer.json, or the tokenizer.json file itself."""
    path = Path(path)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
