"""The `lingjax serve` subcommand: its arguments, then parse, check, load, serve (in that order, as `lingjax
generate`: a bad request is one error line before any weight is read)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def add_parser(sub, add_model_args, **kwargs) -> None:
    """The `serve` subcommand under the CLI's subparsers: the CLI's model flags (add_model_args), then its own."""
    from lingjax.cli import _ids

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server at batch 1 (the serve extra; docs/serve.md)",
                       **kwargs)
    add_model_args(p)
    p.set_defaults(run=serve)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--spec", choices=["nextn", "dspark"], default=None,
                   help="speculate on every request: nextn with the MTP layer, dspark with a DSpark drafter")
    p.add_argument("--steps", type=int, default=None, help="drafts per speculative round with --spec")
    p.add_argument("--widths", type=_ids, default=None, metavar="W,W,...",
                   help="--spec dspark: verify widths chosen each round by the drafter's confidence")
    p.add_argument("--draft", default=None, metavar="DIR|random|none",
                   help="the DSpark drafter for --spec dspark (default: the shipped model's own)")
    p.add_argument("--draft-vocab", default=None, metavar="N|P%[:FILE]",
                   help="--spec: draft over the N (or P%%) most frequent tokens (as for lingjax generate)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients name (default: the checkpoint directory's or preset's name)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights and activations")
    p.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="auto",
                   help="auto: the Pallas kernels on a GPU, the XLA references elsewhere")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
    p.add_argument("--weights", choices=["auto", "fp8", "dense"], default="auto", help="as for lingjax generate")
    p.add_argument("--no-cache", action="store_true", help="do not use the persistent compilation cache")
    # what lingjax.cli's request checks read; a request's own values come with each HTTP request
    p.set_defaults(max_new_tokens=1, temperature=0.0, top_k=0, top_p=1.0, seed=0, rounds_per_call=1, stop_ids=[],
                   stop=[], router_precision="f32")


def _check_port(host: str, port: int) -> None:
    from lingjax.cli import UsageError

    if not 0 < port < 65536:
        raise UsageError(f"--port must be in [1, 65535], got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(args) -> int:
    from lingjax.cli import UsageError, _check_request, _load, _source
    from lingjax.shipped import DEFAULT_NAME, is_default_checkpoint

    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UsageError(f"lingjax serve needs the serve extra ({e.name} is missing): pip install -e '.[serve]'") \
            from None
    cfg, _, name, tokenizer = _source(args)
    _check_request(cfg, 1, args, name)
    _check_port(args.host, args.port)
    served = args.served_model_name or (DEFAULT_NAME if is_default_checkpoint(name) else Path(name).resolve().name)
    model = _load(args, name, tokenizer)

    from lingjax.serve.app import create_app
    from lingjax.serve.backend import ModelBackend

    backend = ModelBackend(model, served, spec=args.spec, steps=args.steps, widths=args.widths)
    print(f"lingjax: serving {served} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(create_app(backend), host=args.host, port=args.port, log_level="warning")
    return 0
