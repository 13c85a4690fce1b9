"""The Engine protocol shared by every engine (sim, torch, llamacpp), and its BenchRun and Measurement.

Defined on the planner side so the tuner speaks the same types as the engines without importing runtime/
(runtime imports all three from here); the engines themselves live in runtime/, named in planner.engine_registry.

Contract of `Engine.measure(inv, plan, bench) -> Measurement`:
- It runs (or predicts) the plan exactly as given: every tensor on the device the plan says, the plan's knobs.
- It returns a Measurement. A run that fails for a reason of the run itself (out of memory, a crash, a time
  limit, a load failure) is NOT an exception: it comes back as Measurement(ok=False, error="...") with what
  is known (peak bytes so far, the log tail in `raw`), so a study records it and goes on.
- It raises planner.errors.InputError (one clear line) only for input no run could succeed with: a plan that
  names a device the machine does not have, a dialect the engine cannot speak, a bench run of zero tokens.
- Throughputs are tokens per second: pp_tps over n_prompt tokens processed in ubatches at the given depth,
  tg_tps over n_gen single-token steps after a prompt of `depth` tokens. Medians over `repetitions`.
- peak_bytes maps device names as llama.cpp spells them (CUDA0, CUDA1, ...) to the peak bytes used there,
  including the CUDA context; host_bytes is the process's peak resident host memory.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InputError
from .hardware import HardwareProfile
from .memory import MemoryReport, estimate
from .model import ModelInventory
from .plan import Plan
from .bench_run import BenchRun

__all__ = ["Engine", "EngineFit", "Measurement", "MemoryModel", "TimedEngine", "BenchRun", "memory_model",
           "memory_model_name"]


@dataclass(frozen=True)
class Measurement:
    pp_tps: float = 0.0
    tg_tps: float = 0.0
    peak_bytes: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    ok: bool = True
    error: str = ""
    raw: dict[str, Any] = field(default_factory=dict)   # engine-specific details (log tail, counters, spreads)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def failed(cls, error: str, **kw: Any) -> Measurement:
        return cls(ok=False, error=error, **kw)


@dataclass(frozen=True)
class EngineFit:
    """What an engine's own --fit did for a budget: its run, the arguments to run it again (confirmation), the
    free memory it was asked to leave, and (when the engine can say) the placement it chose."""
    measurement: Any                          # planner.engine_contract.Measurement (or a stored MeasuredRun)
    argv: tuple[str, ...]                     # the benchmark's arguments after the program
    env: dict[str, str] = field(default_factory=dict)
    target_bytes: int = 0                     # -fitt: free memory llama.cpp must leave on each GPU
    chosen_args: tuple[str, ...] = ()         # the placement it chose, as server flags (llama-fit-params' for
                                              # mainline; ik's own log for ik)
    note: str = ""
    program: str = "llama-bench"              # the benchmark argv is for (ik: llama-sweep-bench)


class Engine(ABC):
    """Anything that can measure a Plan: `measure`, and `name`, the name planner.engine_registry registers it under (its
    traits are there). Every engine subclasses this one; the capabilities below are declared here with what an
    engine that lacks them answers, and the tuner calls them as they are (never probes for them):
    - `measure_args(args, bench, env)`: a run of a command line as given (the --fit references, `run -- ...`);
      an engine that only runs plans refuses with one InputError line;
    - `run_context(bench, plan) -> int | None`: the context a run holds when it differs from the plan's -c
      (llama-bench: its prompt test's; llama-sweep-bench: whole ubatch rows of the plan; None without a plan: the
      smallest); None: the plan's own -c. The tuner adds the memory model's difference to each measured peak, to
      judge the emitted command at its own context;
    - `own_fit(inv, bench, budgets) -> EngineFit | None`: the engine's own --fit at those per-GPU budgets; None:
      it has none (the tuner imitates one);
    - `predicts_memory` / `predict_memory(inv, plan, hw, bench) -> MemoryReport | None`: the engine's own
      prediction of what measure(inv, plan, bench) holds per device (GPU totals comparable with
      Measurement.peak_bytes, CUDA context included where the measurement includes it; the CPU entry and
      host_pinned as planner.memory fills them), for an engine whose memory is not llama.cpp's. No allocation, no
      run: it is called for every candidate a study judges. Without it (or None for a plan),
      planner.memory.estimate, llama.cpp's memory, judges its plans (`memory_model` below picks);
    - `op_offload_per_class`: whether its runs set ik's op offload per op class (-op); ik's llama-bench has one
      switch only (docs/ik_llama.md);
    - `dialect`: the llama.cpp dialect its program speaks (None: it runs none, any plan's dialect goes);
    - `shell_command(inv, plan, bench) -> str | None`: the command line a run of the plan executes (None: it runs
      no program);
    - `run_memory(inv, plan, bench, hw) -> MemoryReport | None`: what its run of the plan holds where that is
      not the plan's own (llama-bench: one context per test); None: the plan's (planner.memory.estimate)."""
    name: str
    predicts_memory: bool = False
    op_offload_per_class: bool = True
    dialect: str | None = None

    @abstractmethod
    def measure(self, inv: ModelInventory, plan: Plan, bench: BenchRun) -> Measurement:
        ...

    def measure_args(self, args: Sequence[str], bench: BenchRun, env: Mapping[str, str] | None = None
                     ) -> Measurement:
        raise InputError(f"the {self.name} engine measures plans, not a command line")

    def run_context(self, bench: BenchRun, plan: Plan | None = None) -> int | None:
        return None

    def shell_command(self, inv: ModelInventory, plan: Plan, bench: BenchRun) -> str | None:
        return None

    def run_memory(self, inv: ModelInventory, plan: Plan, bench: BenchRun,
                   hw: HardwareProfile | None = None) -> MemoryReport | None:
        return None

    def own_fit(self, inv: ModelInventory, bench: BenchRun, budgets: Mapping[str, int]) -> EngineFit | None:
        return None

    def predict_memory(self, inv: ModelInventory, plan: Plan, hw: HardwareProfile | None,
                       bench: BenchRun) -> MemoryReport | None:
        return None


MemoryModel = Callable[[ModelInventory, Plan, "HardwareProfile | None"], MemoryReport]


def memory_model(engine: Engine, bench: BenchRun) -> MemoryModel:
    """The memory model that judges `engine`'s plans at the bench run `bench`, with planner.memory.estimate's signature:
    the engine's `predict_memory` where it `predicts_memory` (planner.memory.estimate for a plan it returns None for),
    else planner.memory.estimate itself (the same function object, so callers keep its behaviour exactly)."""
    if not engine.predicts_memory:
        return estimate

    def model(inv: ModelInventory, plan: Plan, hw: HardwareProfile | None = None) -> MemoryReport:
        report = engine.predict_memory(inv, plan, hw, bench)
        return estimate(inv, plan, hw) if report is None else report
    model.engine_name = engine.name    # type: ignore[attr-defined]
    return model


def memory_model_name(model: MemoryModel) -> str:
    """What predicts: "planner.memory" (llama.cpp's memory) or "<engine> engine"."""
    name = getattr(model, "engine_name", None)
    return f"{name} engine" if name else "planner.memory"


class TimedEngine(Engine):
    """An engine that times each run it makes: how long the next runs will take, for a caller that must end inside
    a time limit (a device call). `on_run(seconds)` hears of each run as it ends. The protocol is delegated by name;
    any other attribute (a binary's `info`) passes through to the engine it wraps."""

    def __init__(self, engine: Engine, on_run: Callable[[float], None] | None = None) -> None:
        self.inner, self.on_run, self.times = engine, on_run, []
        self.name, self.predicts_memory = engine.name, engine.predicts_memory
        self.op_offload_per_class, self.dialect = engine.op_offload_per_class, engine.dialect

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run_context(self, bench: BenchRun, plan: Plan | None = None) -> int | None:
        return self.inner.run_context(bench, plan)

    def own_fit(self, inv: ModelInventory, bench: BenchRun, budgets: Mapping[str, int]) -> EngineFit | None:
        return self.inner.own_fit(inv, bench, budgets)

    def shell_command(self, inv: ModelInventory, plan: Plan, bench: BenchRun) -> str | None:
        return self.inner.shell_command(inv, plan, bench)

    def run_memory(self, inv: ModelInventory, plan: Plan, bench: BenchRun,
                   hw: HardwareProfile | None = None) -> MemoryReport | None:
        return self.inner.run_memory(inv, plan, bench, hw)

    def predict_memory(self, inv: ModelInventory, plan: Plan, hw: HardwareProfile | None,
                       bench: BenchRun) -> MemoryReport | None:
        return self.inner.predict_memory(inv, plan, hw, bench)

    def _timed(self, fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
        t0 = time.monotonic()
        try:
            return fn(*a, **k)
        finally:
            self.times.append(time.monotonic() - t0)
            if self.on_run is not None:
                self.on_run(self.times[-1])

    def measure(self, *a: Any, **k: Any) -> Any:
        return self._timed(self.inner.measure, *a, **k)

    def measure_args(self, *a: Any, **k: Any) -> Any:
        return self._timed(self.inner.measure_args, *a, **k)

    def run_seconds(self, default: float) -> float:
        """Seconds to plan a run at: 1.2 x the mean of the runs so far once there are 3, else `default`."""
        return 1.2 * sum(self.times) / len(self.times) if len(self.times) >= 3 else default
