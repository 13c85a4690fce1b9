"""`serve`: the HTTP API and web view (planner/service); the configuration is checked here."""
from __future__ import annotations

import argparse
import sys

from ..errors import InputError
from .common import _positive


def cmd_serve(args: argparse.Namespace) -> int:
    """The HTTP API and web view (planner/service): configuration is checked here, the serving is there."""
    import os
    from pathlib import Path
    from ..engines import names as engine_names
    from ..service.config import ServerConfig
    from ..service.security import check_bind
    token = args.token or os.environ.get("OFFLOAD_TUNER_TOKEN") or None
    check_bind(args.host, token)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port}: give 0-65535")
    names = tuple(dict.fromkeys(e.strip() for e in args.engine.split(",") if e.strip()))
    bad = [e for e in names if e not in engine_names()]
    if not names or bad:
        raise InputError(f"--engine {args.engine!r}: a comma list of {', '.join(engine_names())}")
    dirs = tuple(Path(d) for d in args.models or ())
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise InputError(f"--models {missing[0]}: not a folder")
    if args.storage:
        from ..tuner.storage import resolve_url
        resolve_url(args.storage)
    config = ServerConfig(host=args.host, port=args.port, storage=args.storage, model_dirs=dirs, token=token,
                          engines=names, llama_bench=args.llama_bench,
                          max_tunes=_positive(args.max_tunes, "--max-tunes"),
                          max_trials=_positive(args.max_trials, "--max-trials"))
    from ..service.app import serve
    print(f"# offload-tuner serve: http://{args.host if ':' not in args.host else f'[{args.host}]'}:{args.port}/ "
          f"(API docs at /docs, /openapi.json); studies in {args.storage or str(config.studies_dir) + '/'}",
          file=sys.stderr, flush=True)
    serve(config)
    return 0


def add_parser(sub) -> None:
    """Registers `serve` and its options."""
    p = sub.add_parser("serve", help="HTTP API (the --json outputs) and a web view of studies")
    p.add_argument("--storage", help="SQLAlchemy URL of the studies (default: one sqlite:///studies/STUDY.db per "
                                     "study, as tune writes them)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; anything else needs "
                                                       "--token)")
    p.add_argument("--port", type=int, default=8787, help="port (default 8787)")
    p.add_argument("--token", help="secret every request must carry (Authorization: Bearer, or /?token= once in "
                                   "a browser); also $OFFLOAD_TUNER_TOKEN")
    p.add_argument("--models", action="append", metavar="DIR", help="folder whose .gguf files and hardware JSON "
                   "requests may name (repeatable; default none: presets only)")
    p.add_argument("--engine", default="sim", help="engines a tune request may use, comma list (default sim)")
    p.add_argument("--llama-bench", metavar="PATH", help="the llamacpp engine's llama-bench (else $LLAMA_BENCH, "
                                                          "else PATH)")
    p.add_argument("--max-tunes", type=int, default=1, help="tune workers at once (default 1)")
    p.add_argument("--max-trials", type=int, default=200, help="trials one tune request may ask for (default 200)")
    p.set_defaults(func=cmd_serve)
