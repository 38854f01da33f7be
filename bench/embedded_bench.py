"""The shipped code model measured as its issue asks: NEXTN accept length at S = 1, 3, 5 on held-out code
prompts (greedy, checked lossless against plain greedy), and time per output token of lingjax against HF
transformers' `generate` on the same checkpoint, device, dtype, prompts and greedy tokens.

The prompts are fixed by the files alone: each held-out standard-library file (lingjax.train.corpus's
HELD_OUT_PACKAGES, which the model never saw) with a `def` line past its first 4 KB gives one prompt, the last
--prompt-tokens tokens of the text up to the end of that line: code completion at a function's first line.

    python bench/embedded_bench.py all --out bench/results/shipped/embedded_h200.md  # one interpreter, both engines
    # or in two interpreters (the CPU machines keep torch in their own virtualenv):
    python bench/embedded_bench.py prompts --out /tmp/p.json
    /path/to/torch/python bench/embedded_bench.py hf --prompts /tmp/p.json --out /tmp/hf.json
    python bench/embedded_bench.py lingjax --prompts /tmp/p.json --hf /tmp/hf.json --out bench/results/shipped/x.md
    python bench/embedded_bench.py lingjax --steps 3 --dspark-steps 15 --draft-vocab full,50%,25%,12.5%  # #52

TPOT is (time of the last new token - time of the first) / (new tokens - 1) on the host, per prompt, for both
engines (EOS does not stop either: every prompt runs --new-tokens tokens); the table gives medians over the
prompts, after one untimed warm-up prompt per configuration. `hf` imports only torch, transformers and numpy.
"""

from __future__ import annotations

import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lingjax's light modules, also for `hf` (no jax)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also where this file is imported
from common import parser  # noqa: E402  (bench/common.py imports no jax until it is used)
from lingjax.shipped import DEFAULT_CHECKPOINT  # noqa: E402
from lingjax.train.corpus import HELD_OUT_PACKAGES  # noqa: E402

MIN_OFFSET = 4096  # bytes of a file before its prompt's `def` line: the prompt carries real context


# ---- prompts ------------------------------------------------------------------------------------------
def held_out_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for pkg in HELD_OUT_PACKAGES for p in (stdlib / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def make_prompts(checkpoint: Path, count: int, prompt_tokens: int) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for path in held_out_files():
        text = path.read_text(encoding="utf-8", errors="strict")
        start = text.find("\ndef ", MIN_OFFSET)
        start = text.find("\n    def ", MIN_OFFSET) if start < 0 else start
        if start < 0:
            continue
        end = text.find("\n", start + 1)
        ids = tok.encode(text[: end + 1]).ids
        if end > 0 and len(ids) >= prompt_tokens:
            candidates.append((str(path.relative_to(stdlib)), ids[-prompt_tokens:]))
    if len(candidates) < count:
        raise SystemExit(f"only {len(candidates)} held-out files give a prompt of {prompt_tokens} tokens")
    stride = len(candidates) / count  # spread over the packages, deterministically
    chosen = [candidates[int(i * stride)] for i in range(count)]
    return {"checkpoint": str(checkpoint), "python": sys.version.split()[0], "prompt_tokens": prompt_tokens,
            "files": [name for name, _ in chosen], "ids": [ids for _, ids in chosen]}


# ---- HF transformers ------------------------------------------------------------------------------------
def run_hf(prompts: dict, checkpoint: Path, new_tokens: int, device: str, dtype: str) -> dict:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: the kernels fall back to torch code
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # run every prompt to new_tokens, as lingjax's ignore_eos

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # generate hands over each step's tokens on the host: the step has finished
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def one(ids):
        clock = Clock()
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                                 streamer=clock, pad_token_id=0)
        new = out[0, len(ids):].tolist()
        # times[0]: the prompt; times[1]: the first new token
        return new, (clock.times[-1] - clock.times[1]) / (len(new) - 1), clock.times[1] - clock.times[0]

    one(prompts["ids"][0])  # warm-up
    tokens, tpot, ttft = [], [], []
    for ids in prompts["ids"]:
        new, t, first = one(ids)
        tokens.append(new)
        tpot.append(t)
        ttft.append(first)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return {"engine": f"transformers {transformers.__version__}, torch {torch.__version__}", "device": name,
            "dtype": dtype, "tokens": tokens, "tpot_s": tpot, "ttft_s": ttft}


# ---- lingjax --------------------------------------------------------------------------------------------
def run_lingjax(prompts: dict, checkpoint: Path, new_tokens: int, dtype: str, steps: list[int],
                draft: str | None = None, dspark_steps: list[int] = (), markov_topk: list[int] = (),
                draft_vocabs: list[str] = ("full",)) -> dict:
    """Plain greedy, NEXTN at each of `steps`, then DSpark (the drafter `draft`, or the checkpoint's own with the
    shipped model) verifying each of `dspark_steps` drafts of its block, in one process; with `markov_topk`, DSpark
    once more for each k, the drafter drafting from each row's k best base logits. Each speculative run once per
    draft vocabulary size of `draft_vocabs` ("full", N or "P%", over the checkpoint's token_frequencies.npy:
    lingjax.spec.draft_vocab), the same weights."""
    import lingjax
    from lingjax import loading

    model = lingjax.load(checkpoint, dtype=dtype, draft=draft or "auto") if draft or checkpoint != DEFAULT_CHECKPOINT \
        else lingjax.load(dtype=dtype)
    out = {"engine": f"lingjax {lingjax.__version__}", "dtype": dtype, "runs": {},
           "draft": None if model.draft is None else model.draft.source}
    configs = [("plain", {})] + [(f"nextn:{s}", {"spec": "nextn", "steps": s}) for s in steps]
    if dspark_steps and model.draft is None:
        raise SystemExit("--dspark-steps needs a drafter: --draft DIR (the shipped model has its own)")
    configs += [(f"dspark:{s}", {"spec": "dspark", "steps": s}) for s in dspark_steps]
    configs += [(f"dspark:{s}:{k}", {"spec": "dspark", "steps": s}) for k in markov_topk for s in dspark_steps]
    vocab_models = {v: loading.with_draft_vocab(model, loading.draft_vocab_ids(v, None, model.cfg, checkpoint))
                    for v in draft_vocabs}  # every size checked before any run
    configs = [("plain", {}, "full")] + [(label + ("" if v == "full" else f"@{v}"), kw, v)
                                         for label, kw in configs[1:] for v in draft_vocabs]
    for label, kw, vocab in configs:
        topk = label.split("@")[0].split(":")[2:]
        base = vocab_models.get(vocab, model)
        run_model = base.with_draft(base.draft.with_markov_topk(int(topk[0]))) if topk else base
        lingjax.generate(run_model, prompts["ids"][0], new_tokens, ignore_eos=True, **kw)  # warm-up (compiles)
        runs = [lingjax.generate(run_model, ids, new_tokens, ignore_eos=True, **kw) for ids in prompts["ids"]]
        out["runs"][label] = {
            "tokens": [r.tokens for r in runs], "tpot_s": [r.tpot_mean_s for r in runs],
            "ttft_s": [r.ttft_s for r in runs], "accept": [r.mean_accept_len for r in runs] if kw else None,
            "rounds": [len(r.accept_lens) for r in runs] if kw else None}
    return out


def _name(label: str) -> str:
    label, _, vocab = label.partition("@")
    kind, *rest = label.split(":")
    if kind == "plain":
        return "plain greedy"
    topk = f", Markov head over the top {rest[1]}" if len(rest) > 1 else ""
    vocab = f", draft vocabulary {vocab}" if vocab else ""
    return f"{'NEXTN' if kind == 'nextn' else 'DSpark'} S={rest[0]}{topk}{vocab}"


# ---- report -----------------------------------------------------------------------------------------------
def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def lingjax_table(say, prompts: dict, lj: dict, new_tokens: int) -> None:
    say(f"checkpoint {prompts['checkpoint']}; {len(prompts['ids'])} held-out prompts of {prompts['prompt_tokens']} "
        f"tokens ({', '.join(prompts['files'][:4])}, ...); {new_tokens} greedy new tokens each, EOS ignored; "
        f"{lj['engine']}, {lj['dtype']}.")
    runs = lj["runs"]
    plain = runs["plain"]
    if lj.get("draft"):
        say(f"DSpark drafter: {lj['draft']}.")
    say.table("lingjax", "mean accept length (tokens/round)", "min..max over prompts", "lossless (= plain greedy)",
              "TPOT median", "vs plain")
    base = statistics.median(plain["tpot_s"])
    for label, r in runs.items():
        tp = statistics.median(r["tpot_s"])
        same = sum(t == p for t, p in zip(r["tokens"], plain["tokens"]))
        if label == "plain":
            say.row("plain greedy", "1", "", "", f"{tp * 1e3:.3f} ms", "1.00x")
        else:
            acc = r["accept"]
            say.row(_name(label), f"{statistics.fmean(acc):.2f}", f"{min(acc):.2f}..{max(acc):.2f}",
                    f"{same}/{len(r['tokens'])}", f"{tp * 1e3:.3f} ms", f"{base / tp:.2f}x")


def hf_table(say, lj: dict, hf: dict, new_tokens: int) -> None:
    runs = lj["runs"]
    plain = runs["plain"]
    base = statistics.median(plain["tpot_s"])
    say()
    say(f"HF: {hf['engine']} on {hf['device']}, {hf['dtype']}, `generate(do_sample=False)`.")
    agree = [common_prefix(h, p) for h, p in zip(hf["tokens"], plain["tokens"])]
    htp = statistics.median(hf["tpot_s"])
    say.table("engine", "TPOT median", "TTFT median", "HF / this")
    say.row("HF transformers generate", f"{htp * 1e3:.3f} ms", f"{statistics.median(hf['ttft_s']) * 1e3:.1f} ms",
            "1.0x")
    say.row("lingjax plain greedy", f"{base * 1e3:.3f} ms", f"{statistics.median(plain['ttft_s']) * 1e3:.1f} ms",
            f"{htp / base:.1f}x")
    best = min((s for s in runs if s != "plain"), key=lambda s: statistics.median(runs[s]["tpot_s"]), default=None)
    if best is not None:
        tp = statistics.median(runs[best]["tpot_s"])
        say.row(f"lingjax {_name(best)}", f"{tp * 1e3:.3f} ms",
                f"{statistics.median(runs[best]['ttft_s']) * 1e3:.1f} ms", f"{htp / tp:.1f}x")
    say()
    say(f"Same greedy tokens: {sum(a == new_tokens for a in agree)}/{len(agree)} prompts identical for all "
        f"{new_tokens} tokens; common prefix median {statistics.median(agree)}, min {min(agree)} (two engines' "
        f"{hf['dtype']} roundings: a near-tie can split them, after which the texts differ).")


def open_report(path: str | None, prompts: dict, command: str):
    import jax

    from common import Report

    say = Report(path)
    dev = jax.devices()[0]
    say("# The shipped code model: NEXTN and DSpark acceptance, time per token against HF transformers")
    say(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, {dev.device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}, Python {prompts['python']}")
    say(f"command: `{command}`")
    say()
    return say


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("what", choices=["all", "prompts", "hf", "lingjax"])
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--prompts", help="prompts JSON (from `prompts`); made here when not given")
    ap.add_argument("--hf", help="HF results JSON (from `hf`) for the report")
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", default="1,3,5", help="NEXTN drafts per round, one run each")
    ap.add_argument("--draft", help="a DSpark drafter directory (default: the shipped model's own, if any)")
    ap.add_argument("--dspark-steps", default="", help="DSpark drafts verified per round, one run each (e.g. 4,8)")
    ap.add_argument("--markov-topk", default="", help="DSpark again with the Markov head over each row's k best "
                    "base logits, one run per k and --dspark-steps (e.g. 16,64)")
    ap.add_argument("--draft-vocab", default="full", help="speculative runs once per draft vocabulary size, over "
                    "the checkpoint's token_frequencies.npy (e.g. full,50%%,25%%,12.5%%)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda", help="torch device for `hf` / `all`")
    ap.add_argument("--out", help="`prompts`/`hf`: the JSON written; `lingjax`/`all`: the markdown report")
    args = ap.parse_args(argv)
    command = "python bench/embedded_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else make_prompts(
        args.checkpoint, args.count, args.prompt_tokens)
    if args.what == "prompts":
        Path(args.out).write_text(json.dumps(prompts))
        return
    if args.what == "hf":
        result = run_hf(prompts, args.checkpoint, args.new_tokens, args.device, args.dtype)
        Path(args.out).write_text(json.dumps(result))
        print(f"HF TPOT median {statistics.median(result['tpot_s']) * 1e3:.3f} ms", file=sys.stderr)
        return
    import common  # the compilation cache, set as the command line was parsed

    cache_note = common.CACHE_NOTE
    steps = [int(s) for s in args.steps.split(",") if s]
    lj = run_lingjax(prompts, args.checkpoint, args.new_tokens, args.dtype, steps, args.draft,
                     [int(s) for s in args.dspark_steps.split(",") if s],
                     [int(k) for k in args.markov_topk.split(",") if k],
                     [v for v in args.draft_vocab.split(",") if v])
    say = open_report(args.out, prompts, command)
    say(cache_note)
    say()
    lingjax_table(say, prompts, lj, args.new_tokens)  # written before HF runs: a cut-short call keeps it
    if args.what == "all":
        hf = run_hf(prompts, args.checkpoint, args.new_tokens, args.device, args.dtype)
    else:
        hf = json.loads(Path(args.hf).read_text()) if args.hf else None
    if hf is not None:
        hf_table(say, lj, hf, args.new_tokens)


if __name__ == "__main__":
    main()
