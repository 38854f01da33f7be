"""`lingjax` command line: generate, chat, serve, convert, info.

Every request is checked before a weight is drawn or read; a bad one is one `lingjax: error: ...` line and
exit status 2. `--help` imports no jax.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lingjax import interrupts
from lingjax.config import DEFAULT_STEPS


class _Parser(argparse.ArgumentParser):
    """argparse with one `lingjax: error: ...` line and exit status 2 for a bad command line (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"lingjax: error: {message} (see {self.prog} --help)\n")


class UsageError(ValueError):
    """A request that cannot run as given; the message says what to change."""


_HELP = dict(formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by spaces or commas, got {text!r}") from None


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. enable_thinking=false), got {text!r}")
    try:
        return key, json.loads(value)  # true/false/numbers/JSON; anything else is a string
    except json.JSONDecodeError:
        return key, value


# ---- arguments ----------------------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser) -> None:
    from lingjax.config import PRESETS
    from lingjax.shipped import DEFAULT_NAME

    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", choices=sorted(PRESETS), help="a preset with random weights")
    src.add_argument("--checkpoint", type=Path, help="official safetensors dir or `lingjax convert` output "
                                                     f"(without --model or --checkpoint: the shipped {DEFAULT_NAME})")


def _add_run_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and preset weights' seed)")
    p.add_argument("--stop-ids", type=_ids, default=[], help="extra stop token ids")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's stop tokens")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop where the text holds TEXT, cut before it (repeatable)")
    p.add_argument("--spec", choices=["nextn", "dspark"], default=None,
                   help="speculate: nextn with the MTP layer, dspark with a DSpark drafter (--draft)")
    p.add_argument("--steps", type=int, default=None, help="drafts per speculative round with --spec (nextn: "
                   f"default {DEFAULT_STEPS}; dspark: the drafter's block size)")
    p.add_argument("--widths", type=_ids, default=None, metavar="W,W,...",
                   help="--spec dspark: verify widths to choose from each round by the drafter's confidence "
                        "(instead of a fixed --steps)")
    p.add_argument("--draft", default=None, metavar="DIR|random|none",
                   help="the DSpark drafter for --spec dspark: a draft checkpoint directory, 'random' (random "
                        "weights, for timing), or 'none' (default: the shipped model's own with the shipped model)")
    p.add_argument("--draft-vocab", default=None, metavar="N|P%[:FILE]",
                   help="--spec: draft over the N (or P%%) most frequent tokens of a frequency table FILE (.npy of "
                        "vocab-size counts; default: the checkpoint's token_frequencies.npy); output unchanged")
    p.add_argument("--rounds-per-call", type=int, default=1,
                   help="speculative rounds (or decode steps) per device call: the host's cost per call is "
                        "shared; tokens arrive in bursts, the same tokens either way")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights and activations")
    p.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="auto",
                   help="auto: the Pallas kernels on a GPU, the XLA references elsewhere")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
    p.add_argument("--weights", choices=["auto", "fp8", "dense"], default="auto",
                   help="auto: as the checkpoint stores them (fp8 stays fp8 on the device); fp8: quantize every "
                        "matrix (docs/fp8.md); dense: all in --dtype")
    p.add_argument("--router-precision", choices=["f32", "bf16"], default="f32",
                   help="MoE gate GEMV operands (bf16: faster, a declared rounding change)")
    p.add_argument("--no-cache", action="store_true",
                   help="do not use the persistent compilation cache (also: LINGJAX_NO_CACHE=1)")


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="a system message before the first turn")
    p.add_argument("--chat-option", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="a variable of the chat template, e.g. enable_thinking=false (repeatable)")


# ---- the request, checked before any weight -----------------------------------------------------------
def _source(args):
    """(cfg, directory or None, source name, tokenizer or None), read without a weight."""
    from lingjax.config import PRESETS
    from lingjax.loading import resolve, source_tokenizer

    if args.checkpoint is not None:
        name = str(args.checkpoint)
        if not args.checkpoint.exists() and name in PRESETS:
            raise UsageError(f"{name!r} is a preset, not a checkpoint directory: use --model {name}")
        if not args.checkpoint.is_dir():
            raise UsageError(f"--checkpoint {name}: no such directory")
    elif args.model is not None:
        name = args.model
    else:
        from lingjax.shipped import default_checkpoint

        name = str(default_checkpoint())
    cfg, directory = resolve(name)
    return cfg, directory, name, source_tokenizer(cfg, directory, name)


def _stdin_text() -> str:
    """stdin as UTF-8 text (bytes that are not: one error line)."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text stream standing in for stdin
        return sys.stdin.read()
    try:
        return raw.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"stdin is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


def _prompt_text(args) -> str | None:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        if str(args.prompt_file) == "-":
            return _stdin_text()
        try:
            return args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: {e}") from None
    if args.prompt_ids is None and not sys.stdin.isatty():
        return _stdin_text()
    return None


def _chat_kwargs(args) -> dict:
    return dict(args.chat_option)


def _messages(system: str | None, user: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}]


def _generation_kwargs(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                stop_ids=args.stop_ids, top_k=args.top_k, top_p=args.top_p, ignore_eos=args.ignore_eos,
                stop=args.stop, spec=args.spec, steps=args.steps, rounds_per_call=args.rounds_per_call,
                widths=args.widths)


def _draft(args, cfg, name: str):
    """(load's draft argument, the drafter's block size or None) for the source `name`, read without a weight."""
    from lingjax.shipped import is_default_checkpoint
    from lingjax.spec.dspark import default_config
    from lingjax.spec.dspark_io import read_dspark_config
    from lingjax.spec.dspark_model import DSparkConfigError

    shipped = is_default_checkpoint(name)
    choice = args.draft if args.draft is not None else ("auto" if shipped else None)
    if choice in (None, "none"):
        return None, None
    if choice == "random":
        return "random", default_config(cfg).block_size
    if choice == "auto":
        from lingjax.shipped import default_draft

        choice = default_draft()
        if choice is None:
            return None, None
    try:
        draft_cfg = read_dspark_config(choice)
        draft_cfg.check_target(cfg)
    except DSparkConfigError as e:
        raise UsageError(f"--draft: {e}") from None
    return str(choice), draft_cfg.block_size


def _as_flag(message: str) -> str:
    """A request check's message naming its argument as the flag, as --help spells it."""
    from lingjax.requests import argument_of

    name = argument_of(message)
    return "--" + name.replace("_", "-") + message[len(name):] if name else message


def _check_request(cfg, prompt_len: int, args, name: str) -> None:
    from lingjax import requests

    if args.draft is not None and args.spec != "dspark":
        raise UsageError("--draft has no effect without --spec dspark")
    args.draft_source, block = _draft(args, cfg, name) if args.spec == "dspark" else (None, None)
    if args.draft_vocab is not None:
        from lingjax.loading import draft_vocab_ids

        if args.spec is None:
            raise UsageError("--draft-vocab has no effect without --spec")
        kw = _draft_vocab_kwargs(args.draft_vocab)
        try:
            draft_vocab_ids(kw["draft_vocab"], kw["draft_vocab_table"], cfg,
                            None if args.model is not None else Path(name), args.tp)
        except ValueError as e:
            raise UsageError(f"--draft-vocab: {e}") from None
    try:
        requests.check_generation(cfg, prompt_len=prompt_len, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, spec=args.spec,
                                  steps=args.steps, widths=args.widths, rounds_per_call=args.rounds_per_call,
                                  has_mtp=cfg.num_nextn_predict_layers > 0, draft_block=block, seed=args.seed)
    except ValueError as e:
        raise UsageError(_as_flag(str(e))) from None
    requests.check_stop_ids(args.stop_ids, cfg.vocab_size)
    from lingjax.stops import check_stop_strings

    try:
        check_stop_strings(args.stop)
    except ValueError as e:
        raise UsageError(f"--stop: {e}") from None
    _check_devices(cfg, args, name)


def _check_devices(cfg, args, name: str) -> None:
    """Enough devices for --tp, and the weights fit their memory (estimated from the config)."""
    from pathlib import Path

    from lingjax.dtypes import DTYPES
    from lingjax.loading import weights_layout
    from lingjax.memory import check_fits
    from lingjax.sharding import check_tp

    check_tp(cfg, args.tp)
    directory = None if args.model is not None else Path(name)
    check_fits(cfg, DTYPES[args.dtype], args.tp, name, fp8=weights_layout(cfg, directory, args.weights, args.tp))


def _load(args, name: str, tokenizer):
    """Load after every check: the compilation cache first, then the weights with a progress bar."""
    import lingjax
    from lingjax import compilation_cache
    from lingjax.progress import Progress

    if not args.no_cache:
        compilation_cache.enable()
    if args.model is not None:
        print(f"drawing random weights (preset {name})", file=sys.stderr, flush=True)
    return lingjax.load(name, dtype=args.dtype, kernels=args.kernels, seed=args.seed, tp=args.tp,
                        router_precision=args.router_precision, progress=Progress("loading weights"),
                        tokenizer=tokenizer, weights=args.weights, draft=getattr(args, "draft_source", None),
                        **_draft_vocab_kwargs(args.draft_vocab))


def _draft_vocab_kwargs(flag: str | None) -> dict:
    """--draft-vocab N|P%[:FILE] -> load's draft_vocab and draft_vocab_table."""
    if flag is None:
        return {}
    size, _, table = flag.partition(":")
    return {"draft_vocab": size, "draft_vocab_table": table or None}


def _summary(result, args) -> str:
    accept = f"; mean accept length {result.mean_accept_len:.2f} over {len(result.accept_lens)} rounds" \
        if args.spec and result.accept_lens else ""
    tpot = (f"TPOT mean {result.tpot_mean_s * 1e3:.2f} ms, median {result.tpot_median_s * 1e3:.2f} ms"
            if len(result.tokens) > 1 else "no TPOT (one token)")
    compiled = f" (compiling took {result.compile_s:.1f} s of it)" if result.compile_s > 0 else ""
    return (f"{len(result.tokens)} tokens ({result.stop_reason}); prompt {result.prompt_len}; "
            f"TTFT {result.ttft_s * 1e3:.1f} ms; {tpot}{accept}{compiled}")


# ---- commands -----------------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from lingjax import requests
    from lingjax.chat_template import render_for

    cfg, _, name, tokenizer = _source(args)
    text = _prompt_text(args)
    if text is None and args.prompt_ids is None:
        raise UsageError("give a prompt: --prompt TEXT, --prompt-file FILE (- for stdin), --prompt-ids IDS, "
                         "or text on stdin")
    if not args.chat and (args.system is not None or args.chat_option):
        raise UsageError("--system and --chat-option have no effect without --chat")
    if args.suffix is not None and (args.chat or text is None):
        raise UsageError("--suffix fills in the middle after a text prompt: give --prompt (without --chat)")
    if args.stop and (args.ids or tokenizer is None):
        raise UsageError("--stop cuts text; with token ids use --stop-ids")
    if text is not None:
        if tokenizer is None:
            raise UsageError(f"{name} has no tokenizer (no tokenizer.json): give --prompt-ids")
        if not text:
            raise UsageError("the prompt is empty")
        if args.chat:
            text = render_for(tokenizer, name, _messages(args.system, text), **_chat_kwargs(args))
        if args.suffix is not None:
            from lingjax.fim import fim_prompt

            ids = fim_prompt(tokenizer, name, text, args.suffix)
        else:
            ids = tokenizer.encode(text)
    else:
        if args.chat:
            raise UsageError("--chat renders a text prompt; --prompt-ids are used as given")
        ids = args.prompt_ids
    prompt = requests.check_prompt_ids(ids, cfg.vocab_size)
    _check_request(cfg, prompt.size, args, name)
    as_ids = args.ids or tokenizer is None

    model = _load(args, name, tokenizer)
    import lingjax
    from lingjax import compile_watch

    out = sys.stdout
    state = {"first": True, "last": "\n"}
    compile_watch.show(sys.stderr, quiet=lambda: state["last"] != "\n")  # no status line after text on a line

    def show_id(token: int) -> None:
        out.write(("" if state["first"] else " ") + str(token))
        out.flush()
        state["first"], state["last"] = False, " "

    def show_text(piece: str) -> None:
        out.write(piece)
        out.flush()
        state["last"] = piece[-1]

    from lingjax.engine import stop_set

    stops = stop_set(model, args.stop_ids, args.ignore_eos)
    kwargs = _generation_kwargs(args)
    if as_ids:
        result = lingjax.generate(model, prompt.tolist(),
                                  on_token=lambda t: None if t in stops else show_id(t), **kwargs)
        if not state["first"]:
            out.write("\n")
    else:
        result = lingjax.generate(model, prompt.tolist(), on_text=show_text, **kwargs)
        if state["last"] != "\n":
            out.write("\n")
    out.flush()
    print(_summary(result, args), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from lingjax.chat_repl import ChatSession
    from lingjax.chat_template import render_for
    from lingjax.shipped import DEFAULT_NAME, is_default_checkpoint

    cfg, _, name, tokenizer = _source(args)
    render_for(tokenizer, name, _messages(args.system, "hello"), **_chat_kwargs(args))  # the options render
    _check_request(cfg, 1, args, name)
    if is_default_checkpoint(name):
        print(f"note: {DEFAULT_NAME} is a code completion model, not trained for chat: its replies are code-shaped "
              "text. `lingjax generate --prompt 'def f(xs):'` completes code.", file=sys.stderr)
    elif args.model is not None:
        print(f"note: preset {name} has random weights: its replies are random tokens.", file=sys.stderr)
    model = _load(args, name, tokenizer)
    from lingjax import compile_watch

    session = ChatSession(model, system=args.system, template_kwargs=_chat_kwargs(args),
                          generation_kwargs=_generation_kwargs(args))
    compile_watch.show(sys.stderr, quiet=lambda: session.streaming)
    return session.run(sys.stdin, sys.stdout, sys.stderr)


def cmd_convert(args) -> int:
    import jax.numpy as jnp

    from lingjax.checkpoint import convert
    from lingjax.progress import Progress

    if args.fp8 and args.dtype != "bfloat16":
        raise UsageError("--dtype has no effect with --fp8 (the fp8 layout keeps the other tensors as they are)")
    if not args.fp8 and args.scale_fmt != "float32":
        raise UsageError("--scale-fmt has no effect without --fp8")
    if not (args.hf_dir / "config.json").exists():
        raise UsageError(f"{args.hf_dir}: no config.json (expected an official checkpoint directory)")
    if args.out_dir.resolve() == args.hf_dir.resolve():
        raise UsageError("the output directory is the checkpoint itself: give another one")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise UsageError(f"{args.out_dir} exists and is not a directory: give a new directory to write")
    if args.out_dir.is_dir() and any(args.out_dir.iterdir()):
        raise UsageError(f"{args.out_dir} is not empty: give a new or empty directory (nothing was written)")
    if args.fp8:
        from lingjax.checkpoint import convert_fp8

        convert_fp8(args.hf_dir, args.out_dir, scale_fmt=args.scale_fmt, progress=Progress("quantizing files"))
    else:
        convert(args.hf_dir, args.out_dir, dtype=getattr(jnp, args.dtype), progress=Progress("converting parameters"))
    print(f"wrote {args.out_dir}", file=sys.stderr)
    return 0


def _amount(n: int, giga: str, mega: str) -> str:
    """n in units of 1e9 (e.g. "124.41 B") or, below that, of 1e6 ("8.63 M")."""
    return f"{n / 1e9:.2f} {giga}" if n >= 1e9 else f"{n / 1e6:.2f} {mega}"


def cmd_info(args) -> int:
    from lingjax.model import abstract_model, param_count
    from lingjax.shipped import default_draft, is_default_checkpoint
    from lingjax.spec.dspark_io import read_dspark_config

    cfg, _, name, _ = _source(args)
    base = param_count(abstract_model(cfg, with_mtp=False))
    full = param_count(abstract_model(cfg, with_mtp=True))
    kinds = "".join("M" if t == "mla" else "k" for t in cfg.layer_types)
    print(f"layers      {cfg.num_hidden_layers} ({kinds}: k=KDA, M=MLA), MoE from layer {cfg.mlp_types.index('moe')}"
          if "moe" in cfg.mlp_types else f"layers      {cfg.num_hidden_layers} ({kinds})")
    print(f"experts     {cfg.num_experts} routed, top-{cfg.num_experts_per_tok}, "
          f"{cfg.n_group} groups keep {cfg.topk_group}")
    print(f"params      {_amount(base, 'B', 'M')} without MTP, {_amount(full, 'B', 'M')} with MTP ({full:,})")
    print(f"bf16 bytes  {_amount(full * 2, 'GB', 'MB')}")
    draft = default_draft() if is_default_checkpoint(name) else None
    if draft is not None:
        d = read_dspark_config(draft)
        print(f"drafter     DSpark ({draft.name}): {d.num_layers} layers, blocks of {d.block_size}, features of "
              f"layers {', '.join(map(str, d.target_layer_ids))} (--spec dspark)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import lingjax

    parser = _Parser(prog="lingjax", description=__doc__, **_HELP)
    parser.add_argument("--version", action="version", version=f"lingjax {lingjax.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="complete a prompt, streaming text (or token ids with --ids)", **_HELP)
    _add_model_args(g)
    prompt = g.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="prompt text (without a --prompt*: text on stdin)")
    prompt.add_argument("--prompt-file", type=Path, default=None, help="read the prompt text from a file (- stdin)")
    prompt.add_argument("--prompt-ids", type=_ids, default=None, help='prompt token ids, e.g. "1 2 3"')
    g.add_argument("--chat", action="store_true", help="apply the chat template: the prompt is a user turn")
    _add_chat_args(g)
    g.add_argument("--ids", action="store_true", help="print token ids (space separated) instead of text")
    g.add_argument("--suffix", default=None, metavar="TEXT",
                   help="fill in the middle: generate what goes between the prompt and TEXT (the tokenizer's FIM "
                        "tokens)")
    _add_run_args(g, max_new_tokens=128)
    g.set_defaults(run=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat (Ctrl-C stops a reply, Ctrl-D quits)", **_HELP)
    _add_model_args(c)
    _add_chat_args(c)
    _add_run_args(c, max_new_tokens=512)
    c.set_defaults(run=cmd_chat)

    v = sub.add_parser("convert", help="official safetensors checkpoint -> lingjax (orbax) checkpoint", **_HELP)
    v.add_argument("hf_dir", type=Path)
    v.add_argument("out_dir", type=Path)
    v.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the saved weights")
    v.add_argument("--fp8", action="store_true", help="write the official fp8 layout instead (safetensors: "
                   "float8_e4m3fn weights with 128x128-block scales; router and lm_head kept)")
    v.add_argument("--scale-fmt", choices=["float32", "ue8m0"], default="float32",
                   help="with --fp8: the scales' format (ue8m0: powers of two)")
    v.set_defaults(run=cmd_convert)

    from lingjax.serve.command import add_parser as add_serve_parser

    add_serve_parser(sub, _add_model_args, **_HELP)

    i = sub.add_parser("info", help="config summary and parameter count (abstract: no memory used)", **_HELP)
    _add_model_args(i)
    i.set_defaults(run=cmd_info)

    from lingjax import profile_command  # imports no jax

    profile_command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lingjax.chat_template import ChatError
    from lingjax.checkpoint import CheckpointError
    from lingjax.config import ConfigError
    from lingjax.engine import NonFiniteLogits
    from lingjax.tokenizer import TokenizerError

    ctrl_c = interrupts.honour_ctrl_c()
    try:
        return args.run(args)
    except (CheckpointError, ConfigError, TokenizerError, ChatError, UsageError, FileNotFoundError,
            NotImplementedError, ValueError) as e:
        print(f"lingjax: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLogits as e:
        print(f"\nlingjax: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        if ctrl_c is not None:
            ctrl_c.stop()
        if "lingjax.compile_watch" in sys.modules:  # the status line ends with the command
            sys.modules["lingjax.compile_watch"].show(None)


if __name__ == "__main__":
    sys.exit(main())
