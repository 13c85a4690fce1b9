"""The engine registry: every engine's name, where its factory lives in runtime/, and its traits; `make_engine`
builds one. The one place engines are named: the CLI's choices, study specs, the service's list and the tuner's
per-engine behaviour all read this table, and code asks an engine's traits (`traits_of`), never its name.

planner never imports runtime (tests/test_import_graph.py holds it): the runtime pulls in torch, CUDA probes and
subprocess machinery the planner and the tuner must work without. Factories are "module:function" strings,
imported only when an engine is made, so `plan`, `explain` or a sim study never load more than they use. What an
engine needs of the machine (a GPU, a binary) its factory checks, and says in one InputError line.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .errors import InputError

if TYPE_CHECKING:
    from .engine_contract import Engine
    from .hardware import HardwareProfile

MiB: Final = 1 << 20


@dataclass(frozen=True)
class EngineTraits:
    """What the tuner and the front ends need to know of an engine, instead of its name.

    measured: it runs something real (False: the cost and memory models themselves, so there is nothing to
      pre-screen, nothing to confirm, and the whole search space is cheap to explore);
    memory_error_prior: bytes the memory model may be short of a run's peak before the study has measured any
      (docs/tuning.md "The margin is the memory model's error, learnt");
    dialects: the llama.cpp dialects it speaks;
    replays_requests: it measures a user's Workload (request classes over HTTP), not a BenchRun;
    binary: the program it runs (None: none), which the options' `binary` names;
    no_host_probe: mainline's --no-host is a choice worth measuring on it (real llama.cpp repacks; the cost model
      does not model repacking)."""
    measured: bool = True
    memory_error_prior: int = 512 * MiB
    dialects: tuple[str, ...] = ("mainline", "ik")
    replays_requests: bool = False
    binary: str | None = None
    no_host_probe: bool = False


@dataclass(frozen=True)
class EngineSpec:
    name: str
    factory: str                 # "module:function", called as function(EngineOptions, HardwareProfile) -> Engine
    traits: EngineTraits
    help: str                    # one line for --help and the service's list

    @property
    def module(self) -> str:
        return self.factory.partition(":")[0]


# every engine follows planner.engine_contract.Engine (runtime/sim.py is the smallest example)
ENGINES: Final[dict[str, EngineSpec]] = {s.name: s for s in (
    EngineSpec("sim", "runtime.sim:from_options",
               EngineTraits(measured=False, memory_error_prior=0),
               "the memory and cost models (instant; no GPU, no llama.cpp)"),
    # memory_error_prior: the memory model's known error before a run says more (predicted - measured peak):
    # llama-bench on the H100 box -204..+72 MiB over 74 runs (issue 10); the torch runtime holds 1.4-2.3 GiB of
    # upload staging the llama.cpp model does not count (and predicts itself); sim is the model
    EngineSpec("torch", "runtime.torch_engine:from_options",
               EngineTraits(memory_error_prior=512 * MiB, dialects=("mainline",)),
               "the bundled PyTorch runtime on this machine's CUDA GPUs"),
    EngineSpec("llamacpp", "runtime.llamacpp:from_options",
               EngineTraits(memory_error_prior=256 * MiB, binary="llama-bench", no_host_probe=True),
               "llama-bench (mainline) or llama-bench / llama-sweep-bench (ik)"),
    EngineSpec("llamaserver", "runtime.llamaserver:from_options",
               EngineTraits(memory_error_prior=256 * MiB, binary="llama-server", replays_requests=True,
                            no_host_probe=True),
               "llama-server as the user runs it, replaying the workload over HTTP (mainline or ik)"),
)}

# an engine object whose name is not registered (a test's stand-in) is taken for a measured one
UNREGISTERED: Final = EngineTraits()

def names() -> tuple[str, ...]:
    return tuple(ENGINES)


def spec(name: str) -> EngineSpec:
    """The registered engine `name`; InputError listing the known ones for any other."""
    try:
        return ENGINES[name]
    except KeyError:
        raise InputError(f"unknown engine {str(name)[:40]!r}: give one of {', '.join(ENGINES)}") from None


def traits_of(engine: Engine) -> EngineTraits:
    """An engine object's traits: its registered spec's, by the engine's `name`."""
    s = ENGINES.get(engine.name)
    return s.traits if s is not None else UNREGISTERED


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def module_found(module: str) -> bool:
    """Whether `module` is importable here, without importing it (a missing parent package counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def make_engine(opts: Any, hw: HardwareProfile) -> Any:
    """The Engine `opts.engine` names (opts: planner.options.EngineOptions), made by its factory. An engine this
    install or machine cannot run (its module missing here; a GPU engine without a GPU, said by its factory) is an
    InputError of one line saying what to use instead."""
    s = spec(opts.engine)
    if not module_found(s.module):
        raise InputError(f"engine {s.name} is not available yet (no {s.module} in this install); use --engine sim")
    return _load(s.factory)(opts, hw)

