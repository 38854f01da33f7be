"""What fp8 weights cost in accuracy on the shipped model: its bf16 checkpoint against its `lingjax convert --fp8`
copy (docs/fp8.md), kept in fp8 on the device, the same compute dtype, in one process.

    python bench/fp8_accuracy.py --out bench/results/fp8/fp8_accuracy_cpu.md
    python bench/fp8_accuracy.py --scale-fmt ue8m0 --max-bytes 200000 --count 4 --out /tmp/x.md

- held-out bits per byte: the held-out standard-library packages (lingjax.train.corpus.HELD_OUT_PACKAGES, never
  trained on), files in name order up to --max-bytes, tokenized and joined with EOS into one stream cut into
  full-forward windows of --window tokens; nats of every predicted token over the stream's bytes (each window's
  first token is predicted by neither model);
- greedy agreement: --count held-out prompts (bench/embedded_bench.py's), --new-tokens greedy tokens each: the
  common prefix with bf16's tokens and the share of prompts equal throughout;
- NEXTN mean accept length at S = --steps on the same prompts, each model drafting for itself.
"""

from __future__ import annotations

import datetime
import math
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import embedded_bench  # noqa: E402

from common import parser  # noqa: E402
from lingjax.shipped import DEFAULT_CHECKPOINT  # noqa: E402


def held_out_stream(tokenizer, eos: int, max_bytes: int) -> tuple[list[int], int, int]:
    """(token ids, bytes, files) of the held-out files in name order up to max_bytes, joined with EOS."""
    ids, used, files = [], 0, 0
    for path in embedded_bench.held_out_files():
        data = path.read_bytes()
        if used and used + len(data) > max_bytes:
            break
        ids += tokenizer.encode(data.decode("utf-8")) + [eos]
        used, files = used + len(data), files + 1
    return ids, used, files


def bits_per_byte(model, ids: list[int], num_bytes: int, window: int) -> tuple[float, list]:
    """(bits per byte of the stream, each window's argmax predictions)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    nats, predictions = 0.0, []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < window:  # the tail: padded to the window (one program), its real rows counted
            chunk = chunk + [0] * (window - len(chunk))
        real = min(window, len(ids) - start)
        logits = model.logits(chunk)
        logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)[: real - 1], axis=-1)
        targets = jnp.asarray(chunk[1:real], jnp.int32)
        nats -= float(np.asarray(jnp.take_along_axis(logp, targets[:, None], axis=1)).sum())
        predictions.append(np.asarray(jnp.argmax(logp, axis=-1)))
    return nats / num_bytes / math.log(2), predictions


def add_accuracy_options(ap) -> None:
    """The options of an accuracy A/B on the shipped model (this script's and bench/op_rounding.py's)."""
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--max-bytes", type=int, default=200_000)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path)


def measure(models: dict, args) -> tuple[dict, dict]:
    """Each model's held-out bits per byte and argmax predictions, greedy tokens and NEXTN accept on the same
    prompts -> (rows by name, what was measured on: files, bytes, tokens)."""
    import lingjax

    first = next(iter(models.values()))
    ids, num_bytes, files = held_out_stream(first.tokenizer, first.cfg.eos_token_ids[0], args.max_bytes)
    prompts = embedded_bench.make_prompts(args.checkpoint, args.count, args.prompt_tokens)
    rows = {}
    for name, model in models.items():
        bpb, predictions = bits_per_byte(model, ids, num_bytes, args.window)
        plain = [lingjax.generate(model, p, args.new_tokens, ignore_eos=True).tokens for p in prompts["ids"]]
        spec = [lingjax.generate(model, p, args.new_tokens, ignore_eos=True, spec="nextn", steps=args.steps)
                for p in prompts["ids"]]
        rows[name] = dict(
            bpb=bpb,
            plain=plain,
            predictions=predictions,
            accept=statistics.mean(r.mean_accept_len for r in spec),
            lossless=sum(r.tokens == t for r, t in zip(spec, plain)),
        )
        print(f"{name}: {bpb:.4f} bits/byte, accept {rows[name]['accept']:.2f}", flush=True)
    return rows, dict(files=files, bytes=num_bytes, tokens=len(ids))


def publish(lines: list[str], out: Path | None) -> None:
    """The report on stdout, and in `out` when given."""
    print("\n".join(lines))
    if out:
        out.write_text("\n".join(lines) + "\n")


def report(title: str, script: str, setup: str, column: str, rows: dict, data: dict, args, argv) -> list[str]:
    """The A/B's markdown: heading, setup, one row per model against the first (the reference) -> lines."""
    import jax

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    device = jax.devices()[0]
    base_name, base = next(iter(rows.items()))
    lines = [
        f"# {title}",
        f"{now}, {device.device_kind} ({device.platform}), jax {jax.__version__}, Python {platform.python_version()}",
        f"command: `python bench/{script} {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"{setup} Held-out: {data['files']} files, {data['bytes']:,} bytes, {data['tokens']:,} tokens in windows of "
        f"{args.window}. {args.count} prompts of {args.prompt_tokens} tokens, {args.new_tokens} greedy tokens.",
        "",
        f"| {column} | held-out bits/byte | vs {base_name} | held-out next-token argmax equal to {base_name}'s "
        f"| greedy tokens equal to {base_name}'s (prompts all equal; common prefix median, min) "
        f"| NEXTN mean accept length S={args.steps} | NEXTN = plain greedy |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        prefixes = [embedded_bench.common_prefix(a, b) for a, b in zip(row["plain"], base["plain"])]
        equal = sum(p == args.new_tokens for p in prefixes)
        same = sum(int((a == b).sum()) for a, b in zip(row["predictions"], base["predictions"]))
        total = sum(a.size for a in base["predictions"])
        lines.append(f"| {name} | {row['bpb']:.4f} | {row['bpb'] / base['bpb'] - 1:+.2%} | {same / total:.2%} | "
                     f"{equal}/{len(prefixes)}; {statistics.median(prefixes):.0f}, {min(prefixes)} | "
                     f"{row['accept']:.2f} | {row['lossless']}/{len(prefixes)} |")
    return lines


def main(argv=None) -> None:
    ap = parser(__doc__)
    add_accuracy_options(ap)
    ap.add_argument("--scale-fmt", choices=["float32", "ue8m0"], default="float32")
    args = ap.parse_args(argv)

    import lingjax
    from lingjax import checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        fp8_dir = Path(tmp) / "fp8"
        layout = checkpoint.convert_fp8(args.checkpoint, fp8_dir, scale_fmt=args.scale_fmt)
        models = {"bf16": lingjax.load(args.checkpoint, dtype=args.dtype),
                  "fp8": lingjax.load(fp8_dir, dtype=args.dtype)}
        rows, data = measure(models, args)
    setup = (f"checkpoint {args.checkpoint}; fp8 copy by `lingjax convert --fp8` (blocks {list(layout.block)}, "
             f"scales {layout.scale_fmt}, not converted: {', '.join(layout.not_converted)}), kept in fp8 on the "
             f"device (kernels {models['fp8'].kernels}); compute {args.dtype}.")
    lines = report("fp8 weights against bf16 on the shipped model", "fp8_accuracy.py", setup, "weights", rows, data,
                   args, argv)
    publish(lines, args.out)


if __name__ == "__main__":
    main()
