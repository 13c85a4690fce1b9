"""`serve`: the HTTP API and web view. The flags become a ServerConfig; the app layer checks it
(offload_tuner/app/serve.py), then cmd_serve starts the service: the one import of offload_tuner/service outside
it, inside the function, so that no other command loads the service (nor FastAPI)."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from ..app.requests import ServerConfig
from ..app.serve import check_server
from .common import add_option, given

log = logging.getLogger(__name__)


def cmd_serve(args: argparse.Namespace) -> int:
    values = given(ServerConfig, args)
    if "engines" in values:
        values["engines"] = tuple(dict.fromkeys(e.strip() for e in values["engines"].split(",") if e.strip()))
    if "model_dirs" in values:
        values["model_dirs"] = tuple(Path(d) for d in values["model_dirs"])
    values["token"] = values.get("token") or os.environ.get("OFFLOAD_TUNER_TOKEN") or None
    config = check_server(ServerConfig(**values))
    host = config.host if ":" not in config.host else f"[{config.host}]"
    from tuner.storage import shown_url
    log.info("# offload-tuner serve: http://%s:%s/ (API docs at /docs, /openapi.json); studies in %s", host,
             config.port, shown_url(config.storage) if config.storage else str(config.studies_dir) + "/")
    from ..service.app import serve     # the service: loaded only by this command
    serve(config)
    return 0


def add_parser(sub) -> None:
    """Registers `serve` and its options."""
    p = sub.add_parser("serve", help="HTTP API (the --json outputs) and a web view of studies")
    for name in ("storage", "host", "port", "token"):
        add_option(p, ServerConfig, name)
    add_option(p, ServerConfig, "model_dirs", action="append", metavar="DIR")
    add_option(p, ServerConfig, "engines")
    add_option(p, ServerConfig, "llama_bench", metavar="PATH")
    add_option(p, ServerConfig, "max_tunes")
    add_option(p, ServerConfig, "max_trials")
    add_option(p, ServerConfig, "request_limit_s")
    p.set_defaults(func=cmd_serve)
