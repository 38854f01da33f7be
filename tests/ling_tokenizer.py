"""A small tokenizer in the official Ling-3 layout, written by the tests: a byte-level BPE tokenizer.json
whose special tokens (`<|endoftext|>`, `<|role_end|>`, `<role>`, `</role>`) come after the ordinary
vocabulary, a tokenizer_config.json naming the EOS token and carrying a Ling-style chat template
(SYSTEM/HUMAN/ASSISTANT turns, `enable_thinking`), and a generation_config.json whose eos_token_id lists
both stops."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ("<|endoftext|>", "<|role_end|>", "<role>", "</role>")

CHAT_TEMPLATE = (
    "{%- set names = {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': 'ASSISTANT'} -%}"
    "{%- if enable_thinking is defined and not enable_thinking and messages[0]['role'] != 'system' -%}"
    "<role>SYSTEM</role>detailed thinking off<|role_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] not in names -%}{{ raise_exception('unknown role ' ~ m['role']) }}{%- endif -%}"
    "<role>{{ names[m['role']] }}</role>{{ m['content'] }}<|role_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<role>ASSISTANT</role>{%- endif -%}"
)

TRAINING_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. ",
    "naïve café, Übergröße, 日本語のテキスト, emoji 🙂🚀, ",
    "for i in range(10):\n    print(i * i)\n",
] * 50


def write(directory: Path, vocab_size: int) -> dict[str, int]:
    """Writes the tokenizer files into directory (a model of at least vocab_size ids); returns the special
    tokens' ids."""
    ordinary = vocab_size - len(SPECIALS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=ordinary, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    tok.add_special_tokens(list(SPECIALS))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert max(ids.values()) < vocab_size, ids
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(i): {"content": s, "special": True} for s, i in ids.items()},
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|endoftext|>"], ids["<|role_end|>"]], "pad_token_id": ids["<|endoftext|>"]}))
    return ids
