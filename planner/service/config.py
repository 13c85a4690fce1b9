"""What the server was started with. Engines, binaries, storage and model folders are the server's to choose;
a request only picks among them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..tuner.search import STUDIES_DIR


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8787
    storage: str | None = None           # one SQLAlchemy URL for every study; None: studies/NAME.db per study
    workdir: Path = field(default_factory=Path.cwd)    # where studies/ lives and tune workers run
    model_dirs: tuple[Path, ...] = ()    # model paths a request may name lie under these (presets always may)
    token: str | None = None             # required on every request when set (always set off loopback)
    engines: tuple[str, ...] = ("sim",)  # engines a tune request may ask for
    llama_bench: str | None = None       # the llamacpp engine's binary (the server's, never a request's)
    max_tunes: int = 1                   # tune workers running at once
    max_trials: int = 200                # trials one tune request may ask for
    max_body: int = 64 * 1024            # bytes of a request body
    max_args: int = 512                  # llama.cpp arguments of one explain request
    compute_threads: int = 4             # plan/explain/inspect computed at once (the rest wait)
    max_waiting: int = 256               # requests waiting for a compute slot before 503

    @property
    def studies_dir(self) -> Path:
        return self.workdir / STUDIES_DIR
