"""Make tests/fixtures/train_small: a small-config checkpoint written by lingjax.train.export from a trained
state, and the HF reference's logits for it. Two interpreters, as tests/make_fixtures.py uses (the export
needs jax, the reference needs torch and transformers). From the repository root:

    .venv/bin/python tests/make_train_fixture.py                # both steps (the second through --hf-python)
    /work/hfref/bin/python tests/make_train_fixture.py --hf     # the second step alone, for the checkpoint there

Step 1 (lingjax venv): a BPE tokenizer of the small config's 512 ids trained on a few stdlib modules, the small
model trained TRAIN_STEPS steps on their token stream by the product's train step (lingjax.train.step), then
export.export with the tokenizer into tests/fixtures/train_small/ and PROMPT_TEXT's ids into prompt_ids.json
(more than 64 tokens, so HF's chunked KDA crosses a chunk).
Step 2 (HF env): BailingHybridForCausalLM.from_pretrained(dir, float32, eager attention and experts), one full
no-cache forward over the prompt -> hf_logits.npz {prompt_ids int32 [L], logits f32 [L, V]}; reference.json
records the versions, HF's loading report (only the MTP layer's tensors may be unexpected: HF has no MTP) and
the smallest router decision gap on the prompt (a gap near f32 rounding would make the comparison fragile).
The file is not named reference.npz, so the generic HF-parity tests (conftest.fixture_dirs) skip it:
tests/test_train_model.py compares its logits.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "train_small"
PROMPT_FILE = "prompt_ids.json"
LOGITS_FILE = "hf_logits.npz"
REFERENCE_FILE = "reference.json"
TRAIN_STEPS = 40
TEXT_MODULES = ("textwrap", "string", "bisect", "heapq", "functools", "fnmatch", "shlex")
PROMPT_TEXT = '''def quicksort(xs):
    """Return a sorted copy of xs."""
    if len(xs) <= 1:
        return list(xs)
    pivot, *rest = xs
    left = [x for x in rest if x < pivot]
    right = [x for x in rest if x >= pivot]
    return quicksort(left) + [pivot] + quicksort(right)
'''
MIN_PROMPT_TOKENS = 65
MIN_ROUTER_GAP = 2e-5  # a decision gap below this could flip between two f32 implementations (~1e-7 apart)


# ---- step 1: the lingjax side -----------------------------------------------------------------------
def _texts() -> list:
    import sysconfig

    from lingjax.train.corpus import SourceFile

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [SourceFile.from_text(f"stdlib/{m}.py", (stdlib / f"{m}.py").read_text(encoding="utf-8"))
            for m in TEXT_MODULES]


def make_checkpoint(out: Path) -> None:
    import jax

    from lingjax.train import bpe, data, export, model_config, optim, step

    files = _texts()
    tok = bpe.train_tokenizer([f.text for f in files], model_config.SMALL["vocab_size"])
    stream = data.encode_files(tok, data.shuffled_files(files, seed=0))
    rc = step.RunConfig(config="small", batch=4, seq_len=64,
                        optim=optim.OptimConfig(lr=3e-3, warmup_steps=4, total_steps=TRAIN_STEPS))
    batches = data.PackedBatches(stream.tokens, rc.batch, rc.seq_len, rc.seed)
    state, fn = step.init_state(rc), step.train_step_fn(rc)
    for k in range(TRAIN_STEPS):
        state, metrics = fn(state, batches.batch(k))
    print(f"trained {TRAIN_STEPS} steps on {len(stream)} tokens: loss {float(metrics['loss']):.4f}", flush=True)
    state = jax.device_get(state)
    export.export(out, state["params"], state["biases"], model_config.config_dict("small"), tokenizer=tok)
    ids = tok.encode(PROMPT_TEXT, add_special_tokens=False).ids
    assert len(ids) >= MIN_PROMPT_TOKENS, f"the prompt is {len(ids)} tokens, fewer than {MIN_PROMPT_TOKENS}"
    (out / PROMPT_FILE).write_text(json.dumps(ids) + "\n")
    print(f"wrote {out} ({len(ids)} prompt tokens)", flush=True)


# ---- step 2: the HF side ----------------------------------------------------------------------------
def hf_reference(directory: Path, out: Path | None = None, ids: list[int] | None = None,
                 last_rows: int | None = None) -> dict:
    """HF's f32 logits for `ids` (default: directory's prompt_ids.json) into out (default: directory); with
    last_rows, only the logits of the last rows are kept, beside every row's argmax (a small file for a
    large vocabulary)."""
    import numpy as np
    import torch
    import transformers
    from transformers import BailingHybridForCausalLM

    sys.path.insert(0, str(HERE))
    from make_fixtures import routing_gaps

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    model, info = BailingHybridForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    model.eval()
    cfg = model.config
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    unexpected = sorted(info.get("unexpected_keys", []))
    problems = {k: sorted(v) for k, v in info.items() if v and k != "unexpected_keys"}
    if problems or any(not k.startswith(mtp_prefix) for k in unexpected):
        raise RuntimeError(f"HF loaded {directory} with problems {problems}, unexpected {unexpected[:8]}")
    gaps = []

    def hook(router, args, _output):
        x = args[0].reshape(-1, router.hidden_dim).float()
        sel = torch.sigmoid(x @ router.weight.float().T) + router.e_score_correction_bias
        g, e, _ = routing_gaps(sel, router.num_group, router.topk_group, router.top_k)
        gaps.extend(torch.minimum(g, e).tolist())

    for module in model.modules():
        if type(module).__name__ == "BailingHybridTopkRouter":
            module.register_forward_hook(hook)
    out = directory if out is None else out
    ids = json.loads((directory / PROMPT_FILE).read_text()) if ids is None else ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    kept = logits if last_rows is None else logits[-last_rows:]
    np.savez(out / LOGITS_FILE, prompt_ids=np.asarray(ids, np.int32), logits=kept.astype(np.float32),
             argmax=logits.argmax(-1).astype(np.int32))
    reference = {"generated_by": sys.argv[0], "checkpoint": str(directory), "torch": torch.__version__.split("+")[0],
                 "transformers": transformers.__version__, "prompt_tokens": len(ids),
                 "unexpected_keys": len(unexpected), "router_min_gap": min(gaps), "router_decisions": len(gaps),
                 "logits_max_abs": float(np.abs(logits).max())}
    (out / REFERENCE_FILE).write_text(json.dumps(reference, indent=2) + "\n")
    if min(gaps) < MIN_ROUTER_GAP:
        raise RuntimeError(f"a router decision gap of {min(gaps):.2e} is too close to a tie; change PROMPT_TEXT")
    print(f"HF logits for {len(ids)} tokens written to {out / LOGITS_FILE}: {reference}", flush=True)
    return reference


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", action="store_true", help="only the HF step (run with the HF reference interpreter)")
    p.add_argument("--hf-python", default="/work/hfref/bin/python", help="the HF reference interpreter")
    p.add_argument("--out", type=Path, default=FIXTURE)
    args = p.parse_args()
    if args.hf:
        hf_reference(args.out)
        return 0
    make_checkpoint(args.out)
    subprocess.run([args.hf_python, str(Path(__file__).resolve()), "--hf", "--out", str(args.out)], check=True)
    total = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"fixture size: {total} B", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
