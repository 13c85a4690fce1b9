"""The bundled PyTorch runtime: executes a Plan with llama.cpp's placement and op-offload rules and measures it.

    TorchEngine(compute_dtype="bf16", device_map=None, seed=0, routing="uniform", use_cuda_graphs=True)
        .measure(inv, plan, workload) -> Measurement          (planner/engine_contract.py's Engine protocol)
        .load(inv, plan, min_cells) -> TorchModel              (forward / prefill / decode / generate, counters)

Files: config.py (what the forward pass needs to know), weights.py (GGUF dequantization, synthetic weights),
kernels.py (compute primitives), placement.py (devices, accounting, weights, KV, uploads), scheduler.py (where
ops run, programs, eager and CUDA-graph executors), model.py (the forward pass per arch), engine.py (the engine),
reference.py (a plain implementation without placement, for tests).
"""
from __future__ import annotations

from typing import Any

from planner.errors import InputError
from ..gpumem import cuda_available

__all__ = ["TorchEngine", "TorchModel", "from_options"]


def __getattr__(name: str) -> Any:
    """TorchEngine and TorchModel, imported on first use: the factory below says "no GPU" without loading torch."""
    if name in ("TorchEngine", "TorchModel"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_options(opts: Any, hw: Any) -> Any:
    """The registry's factory (planner/engine_registry.py): the GPUs of this machine, the runtime's defaults; an
    InputError
    of one line on a machine without a CUDA GPU."""
    if not cuda_available():
        raise InputError("engine torch measures plans on CUDA GPUs and this machine has none; use --engine sim "
                         "(or run the same command where the GPU is)")
    from planner.engine_contract import TorchEngine
    return TorchEngine()
