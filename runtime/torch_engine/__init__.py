"""The bundled PyTorch runtime: executes a Plan with llama.cpp's placement and op-offload rules and measures it.

    TorchEngine(compute_dtype="bf16", device_map=None, seed=0, routing="uniform", use_cuda_graphs=True)
        .measure(inv, plan, workload) -> Measurement          (planner/engine.py's Engine protocol)
        .load(inv, plan, min_cells) -> TorchModel              (forward / prefill / decode / generate, counters)

Files: config.py (what the forward pass needs to know), weights.py (GGUF dequantization, synthetic weights),
kernels.py (compute primitives), placement.py (devices, accounting, weights, KV, uploads), scheduler.py (where
ops run, programs, eager and CUDA-graph executors), model.py (the forward pass per arch), engine.py (the engine),
reference.py (a plain implementation without placement, for tests).
"""
from __future__ import annotations

from typing import Any

from .engine import TorchEngine, TorchModel

__all__ = ["TorchEngine", "TorchModel", "from_options"]


def from_options(opts: Any, hw: Any) -> TorchEngine:
    """The registry's factory (planner/engines.py): the GPUs of this machine, the runtime's defaults."""
    return TorchEngine()
