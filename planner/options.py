"""EngineOptions: what picks and configures an engine, built once at the edge and passed on frozen (`tune` makes
one from its TuneOptions, planner/app/requests.py; `run` from its flags, runtime/run_cli.py)."""
from __future__ import annotations

from dataclasses import dataclass

from . import defaults as D

EngineName = str      # a name planner.engines registers (the CLI's choices, specs and the service check it there)


@dataclass(frozen=True)
class EngineOptions:
    """What makes an engine: its name, the model file (llamacpp needs it; a preset has none), llama-bench's path
    (None: $LLAMA_BENCH, else PATH), the per-run time limit, and the CPU stand-in dry run."""
    engine: EngineName
    model: str
    llama_bench: str | None = None
    llama_server: str | None = None          # the llamaserver engine's program (None: $LLAMA_SERVER, else PATH)
    timeout_s: float = D.RUN_TIMEOUT_S
    cpu_stand_in: bool = False

    @property
    def model_path(self) -> str | None:
        return None if self.model.startswith("preset:") else self.model
