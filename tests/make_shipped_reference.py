"""Make tests/fixtures/shipped_reference: HF transformers' f32 logits for the shipped checkpoint
(checkpoints/ling-code-tiny) on make_train_fixture.PROMPT_TEXT, which tests/test_shipped.py compares with
lingjax's. Run with the HF reference interpreter, from the repository root, whenever the shipped checkpoint
changes:

    /work/hfref/bin/python tests/make_shipped_reference.py

Writes hf_logits.npz {prompt_ids [L], logits f32 [LAST_ROWS, V] of the last rows, argmax [L]: every row's
greedy token} and reference.json (versions, HF's loading report, the smallest router decision gap on the
prompt, and the checkpoint's weight-file hash, so the test can tell a stale reference from a wrong model).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_train_fixture  # noqa: E402

CHECKPOINT = HERE.parent / "checkpoints" / "ling-code-tiny"
OUT = HERE / "fixtures" / "shipped_reference"
LAST_ROWS = 16  # 16 x 8192 f32 logits: 512 KB


def weights_sha256(directory: Path) -> str:
    """sha256 over the checkpoint's safetensors files, in name order."""
    h = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")):
        h.update(path.read_bytes())
    return h.hexdigest()


def main() -> int:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).encode(make_train_fixture.PROMPT_TEXT).ids
    if len(ids) < make_train_fixture.MIN_PROMPT_TOKENS:
        raise SystemExit(f"the prompt is {len(ids)} tokens, under {make_train_fixture.MIN_PROMPT_TOKENS}")
    OUT.mkdir(parents=True, exist_ok=True)
    make_train_fixture.hf_reference(CHECKPOINT, out=OUT, ids=ids, last_rows=LAST_ROWS)
    ref_path = OUT / make_train_fixture.REFERENCE_FILE
    reference = json.loads(ref_path.read_text())
    reference["weights_sha256"] = weights_sha256(CHECKPOINT)
    reference["checkpoint"] = "checkpoints/ling-code-tiny"
    ref_path.write_text(json.dumps(reference, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
