"""EngineOptions: what picks and configures an engine, built once at the edge and passed on frozen (`tune` makes
one from its TuneRequest, offload_tuner/app/requests.py; `run` from its RunRequest, below). RunRequest: what `run`
measures (the CLI parses it from its flags, offload_tuner/cli/runtime_cmds.py; runtime/run.py prepares the run)."""
from __future__ import annotations

from dataclasses import dataclass

from . import defaults as D

EngineName = str      # a name planner.engine_registry registers (the CLI, specs and the service check it there)


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
        """The file the engine gives llama.cpp: the first shard of a split model, whichever shard was named."""
        from .gguf_header import first_shard
        return None if self.model.startswith("preset:") else first_shard(self.model)


@dataclass(frozen=True)
class RunRequest:
    """One plan measured once (`offload-tuner run`): the model and the engine, the plan as a Plan JSON file
    (`plan`) or as a llama.cpp command line (`llama_args`; exactly one of the two), the llama-bench workload
    (None: the command line's -p/-n/-d/-r, else defaults.RUN_WORKLOAD), the declared hardware (`gpu` sizes or a
    `hardware` preset/JSON) and the dialect of a command line (None: the binary's, else mainline)."""
    model: str
    engine: EngineName
    plan: str | None = None
    llama_args: tuple[str, ...] = ()
    llama_bench: str | None = None
    dialect: str | None = None
    n_prompt: int | None = None
    n_gen: int | None = None
    depth: int | None = None
    reps: int | None = None
    timeout_s: float = D.RUN_TIMEOUT_S
    gpu: str | None = None
    hardware: str | None = None

    def engine_options(self) -> EngineOptions:
        return EngineOptions(engine=self.engine, model=self.model, llama_bench=self.llama_bench,
                             timeout_s=self.timeout_s)
