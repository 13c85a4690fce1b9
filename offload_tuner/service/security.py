"""Safe by default: loopback without a token, a token anywhere else; model and profile paths only under the
folders the server was started with; bounded request bodies; Host and Content-Type checks so a web page in the
user's browser cannot drive a loopback server (DNS rebinding, cross-site form posts). Which binds need a token is
checked where the configuration is (offload_tuner/app/serve.py: check_bind, is_loopback)."""
from __future__ import annotations

import hmac
import os
from pathlib import Path

from ..app.serve import is_loopback
from planner.errors import InputError

TOKEN_COOKIE = "offload_tuner_token"


class ServiceError(InputError):
    """Bad input with an HTTP status other than 400 (the message is still the one line the CLI would print)."""
    status = 400


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    status = 409


class TooLarge(ServiceError):
    status = 413


class Unsupported(ServiceError):
    status = 415


class Busy(ServiceError):
    status = 429


class Unauthorized(ServiceError):
    status = 401


def token_ok(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def host_ok(host_header: str | None, bound_loopback: bool) -> bool:
    """A loopback server answers only requests addressed to a loopback name (DNS rebinding)."""
    if not bound_loopback:
        return True
    if not host_header:
        return False
    name = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
    if host_header.startswith("["):
        name = host_header[1:].split("]", 1)[0]
    return is_loopback(name)


class PathPolicy:
    """Model files, hardware profiles and workload files a request may name: under one of the server's folders, after
    resolving links and '..'. Presets always pass."""

    def __init__(self, roots: tuple[Path, ...]):
        self.roots = tuple(Path(os.path.realpath(r)) for r in roots)

    def _inside(self, p: Path) -> bool:
        return any(p == r or r in p.parents for r in self.roots)

    def resolve(self, text: str, what: str) -> str:
        if not self.roots:
            raise InputError(f"{what} {text[:200]!r}: this server takes no file paths (start it with --models DIR "
                             "to allow a folder); use preset:NAME[:QUANT]")
        given = Path(text)
        candidates = [given] if given.is_absolute() else [r / given for r in self.roots]
        for c in candidates:
            real = Path(os.path.realpath(c))
            if self._inside(real) and (real.exists() or c is candidates[-1]):
                return str(real)
        raise InputError(f"{what} {text[:200]!r} is outside the folders this server serves "
                         f"({', '.join(str(r) for r in self.roots)})")

    def model(self, text: str) -> str:
        return text if text.startswith("preset:") else self.resolve(text, "model")

    def hardware(self, text: str) -> str:
        from planner.hardware import preset_names
        if "/" not in text and not text.endswith(".json") and text in preset_names():
            return text
        if "/" not in text and not text.endswith(".json"):
            raise InputError(f"unknown hardware preset {text!r}; known: {', '.join(preset_names())}")
        return self.resolve(text, "hardware profile")
