"""serve: the HTTP API and web view's configuration checked, before anything starts: bind and token, host and
port, engines, model folders, the storage (reached, its schema there) and bounds. The service itself
(offload_tuner/service) imports this module for its bind rules; nothing here imports the service: the CLI's
`serve` starts it (tests/test_import_graph.py)."""
from __future__ import annotations

import ipaddress
import math

from planner import engine_registry
from planner.errors import InputError
from .common import positive
from .requests import ServerConfig

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Any bind but loopback needs a token (else anyone on the network could start tunes)."""
    if not is_loopback(host) and not token:
        raise InputError(f"--host {host} is reachable from other machines: give --token SECRET (or set "
                         "OFFLOAD_TUNER_TOKEN); without one the server binds to loopback only")
    if token is not None and len(token) < 16:
        raise InputError("--token: use at least 16 characters (e.g. python3 -c 'import secrets; "
                         "print(secrets.token_urlsafe())')")


def check_server(config: ServerConfig) -> ServerConfig:
    """The configuration as `serve` takes it: bind and token, port (free), engines, model folders, storage,
    bounds."""
    check_bind(config.host, config.token)
    if not 0 <= config.port <= 65535:
        raise InputError(f"--port {config.port}: give 0-65535")
    check_port_free(config.host, config.port)
    bad = [e for e in config.engines if e not in engine_registry.ENGINES]
    if not config.engines or bad:
        raise InputError(f"--engine {','.join(config.engines)!r}: a comma list of {', '.join(engine_registry.names())}")
    missing = [str(d) for d in config.model_dirs if not d.is_dir()]
    if missing:
        raise InputError(f"--models {missing[0]}: not a folder")
    if config.storage:      # reached now (a wrong password, a server down, a garbage file), not per request
        from tuner.storage import make_storage
        make_storage(config.storage)
    positive(config.max_tunes, "--max-tunes")
    positive(config.max_trials, "--max-trials")
    if not (math.isfinite(config.request_limit_s) and config.request_limit_s > 0):
        raise InputError(f"--request-limit {config.request_limit_s}: give a number of seconds above 0")
    return config


def check_port_free(host: str, port: int) -> None:
    """A taken port is one line before the server starts (uvicorn would log its errno text and exit 3). Bound and
    released here with SO_REUSEADDR, as uvicorn binds: a port in TIME_WAIT is not taken."""
    import socket
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InputError(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, addr = infos[0]      # port 0: the host is bound once all the same (a foreign address)
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise InputError(f"--port {port}: {host}:{port} cannot be bound ({e.strerror or e}; another server "
                             "there?); give another --port, or 0 for a free one") from None

