"""`lingjax` command line: generate, convert, info."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    """argparse with one `lingjax: error: ...` line and exit status 2 for a bad command line (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"lingjax: error: {message} (see {self.prog} --help)\n")


_HELP = dict(formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def _progress(label: str):
    def report(done: int, total: int) -> None:
        print(f"\r{label} {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    return report


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by spaces, got {text!r}") from None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from lingjax.config import PRESETS

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=sorted(PRESETS), help="a preset with random weights")
    src.add_argument("--checkpoint", type=Path, help="official safetensors dir or `lingjax convert` output")


def cmd_generate(args) -> int:
    import lingjax

    model = lingjax.load(args.model or args.checkpoint, dtype=args.dtype, kernels=args.kernels, seed=args.seed,
                         progress=_progress("loading parameters"), tp=args.tp,
                         router_precision=args.router_precision)

    def show(token: int) -> None:
        print(token, end=" ", flush=True)

    result = lingjax.generate(model, args.prompt_ids, args.max_new_tokens, temperature=args.temperature,
                              seed=args.seed, stop_ids=args.stop_ids, top_k=args.top_k, top_p=args.top_p,
                              ignore_eos=args.ignore_eos, on_token=show, spec=args.spec, steps=args.steps,
                              rounds_per_call=args.rounds_per_call)
    print()
    accept = f"; mean accept length {result.mean_accept_len:.2f} over {len(result.accept_lens)} rounds" \
        if args.spec else ""
    print(f"{len(result.tokens)} tokens ({result.stop_reason}); prompt {result.prompt_len}; "
          f"TTFT {result.ttft_s * 1e3:.1f} ms; TPOT mean {result.tpot_mean_s * 1e3:.2f} ms, "
          f"median {result.tpot_median_s * 1e3:.2f} ms{accept} (first call includes compilation)", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from lingjax.checkpoint import convert

    import jax.numpy as jnp

    convert(args.hf_dir, args.out_dir, dtype=getattr(jnp, args.dtype), progress=_progress("converting parameters"))
    print(f"wrote {args.out_dir}", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from lingjax.config import LingConfig, preset
    from lingjax.model import abstract_model, param_count

    cfg = preset(args.model) if args.model else LingConfig.from_file(args.checkpoint / "config.json")
    base = param_count(abstract_model(cfg, with_mtp=False))
    full = param_count(abstract_model(cfg, with_mtp=True))
    kinds = "".join("M" if t == "mla" else "k" for t in cfg.layer_types)
    print(f"layers      {cfg.num_hidden_layers} ({kinds}: k=KDA, M=MLA), MoE from layer {cfg.mlp_types.index('moe')}"
          if "moe" in cfg.mlp_types else f"layers      {cfg.num_hidden_layers} ({kinds})")
    print(f"experts     {cfg.num_experts} routed, top-{cfg.num_experts_per_tok}, "
          f"{cfg.n_group} groups keep {cfg.topk_group}")
    print(f"params      {base / 1e9:.2f} B without MTP, {full / 1e9:.2f} B with MTP ({full:,})")
    print(f"bf16 bytes  {full * 2 / 1e9:.1f} GB")
    return 0


def main(argv: list[str] | None = None) -> int:
    import lingjax

    parser = _Parser(prog="lingjax", description=__doc__, **_HELP)
    parser.add_argument("--version", action="version", version=f"lingjax {lingjax.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="greedy or sampled generation, streaming token ids", **_HELP)
    _add_model_args(g)
    g.add_argument("--prompt-ids", type=_ids, required=True, help='prompt token ids, e.g. "1 2 3"')
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (and preset weights' seed)")
    g.add_argument("--stop-ids", type=_ids, default=[], help="extra stop token ids")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the config's EOS ids")
    g.add_argument("--spec", choices=["nextn"], default=None, help="speculate with the MTP layer")
    g.add_argument("--steps", type=int, default=5, help="drafts per speculative round (verify width steps+1)")
    g.add_argument("--rounds-per-call", type=int, default=1,
                   help="speculative rounds (or decode steps) per device call: the host's cost per call is "
                        "shared; tokens arrive in bursts, the same tokens either way")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights and activations")
    g.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="auto",
                   help="auto: the Pallas kernels on a GPU, the XLA references elsewhere")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
    g.add_argument("--router-precision", choices=["f32", "bf16"], default="f32",
                   help="MoE gate GEMV operands (bf16: faster, a declared rounding change)")
    g.set_defaults(run=cmd_generate)

    c = sub.add_parser("convert", help="official safetensors checkpoint -> lingjax (orbax) checkpoint", **_HELP)
    c.add_argument("hf_dir", type=Path)
    c.add_argument("out_dir", type=Path)
    c.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the saved weights")
    c.set_defaults(run=cmd_convert)

    i = sub.add_parser("info", help="config summary and parameter count (abstract: no memory used)", **_HELP)
    _add_model_args(i)
    i.set_defaults(run=cmd_info)

    args = parser.parse_args(argv)
    from lingjax.checkpoint import CheckpointError
    from lingjax.config import ConfigError

    try:
        return args.run(args)
    except (CheckpointError, ConfigError, FileNotFoundError, NotImplementedError, ValueError) as e:
        print(f"lingjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
