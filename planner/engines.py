"""The registry of what planner/ calls in runtime/: engines and the CLI's runtime commands, by name -> "module:attr".

planner never imports runtime (tests/test_import_graph.py holds it): the runtime pulls in torch, CUDA probes and
subprocess machinery the planner and the tuner must work without. The CLI asks this table for a name and the
module is imported only then, so `plan`, `explain` or a sim study never load more than they use.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Final

# engine name -> its class; every one follows planner.engine.Engine (runtime/sim.py is the smallest example)
ENGINES: Final = {
    "sim": "runtime.sim:SimEngine",
    "llamacpp": "runtime.llamacpp:LlamaCppEngine",
    "torch": "runtime.torch_engine:TorchEngine",
}

# what the CLI dispatches to in runtime/: subcommands, their argparse helpers, and the probes it needs
RUNTIME: Final = {
    "run": "runtime.run_cli:run_main",
    "synth": "runtime.synth:synth_main",
    "calibrate": "runtime.calibrate:calibrate_main",
    "add_run_arguments": "runtime.run_cli:add_run_arguments",
    "add_synth_arguments": "runtime.synth:add_synth_arguments",
    "add_calibrate_arguments": "runtime.calibrate:add_calibrate_arguments",
    "make_engine": "runtime.run_cli:make_engine",           # builds any engine from EngineOptions, as `run` does
    "build_of_binary": "runtime.llamacpp:build_of_binary",   # a llama.cpp program's dialect and build number
    "oracle_compare": "runtime.run_cli:oracle_compare",     # llama-fit-params next to our memory model
    "cuda_available": "runtime.gpumem:cuda_available",      # torch lives in runtime/, imported only there
}


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def engine_class(name: str) -> Any:
    """The class registered for engine `name` (imports its module now). KeyError for an unknown name."""
    return _load(ENGINES[name])


def engine_module(name: str) -> str:
    """The module engine `name` lives in, e.g. "runtime.llamacpp"."""
    return ENGINES[name].partition(":")[0]


def module_found(module: str) -> bool:
    """Whether `module` is importable here, without importing it (a missing parent package counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def runtime(name: str) -> Any:
    """The runtime function the CLI calls `name` (imports its module now). KeyError for an unknown name."""
    return _load(RUNTIME[name])
