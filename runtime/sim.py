"""The cost model as an engine: memory model + roofline predictor for a HardwareProfile (no hardware needed).

Deterministic and instant; for planning hardware you do not have, for tests, and as the optimizer's prior.
The smallest Engine, so also the example implementation of planner/engine_contract.py's contract: a plan over a
GPU's memory is a failed Measurement (as a real out-of-memory would be), not an exception.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.cost import predict
from planner.errors import InputError
from planner.hardware import HardwareProfile, fmt_bytes
from planner.memory import estimate
from planner.model import ModelInventory
from planner.plan import Plan, gpu_index, is_gpu

from planner.engine_contract import Engine, Measurement, BenchRun

if TYPE_CHECKING:
    from planner.options import EngineOptions


@dataclass
class SimEngine(Engine):
    hw: HardwareProfile
    name: str = "sim"

    def measure(self, inv: ModelInventory, plan: Plan, bench: BenchRun) -> Measurement:
        n_gpus = len(self.hw.gpus)
        for dev in plan.devices():
            if dev != "CPU" and (not is_gpu(dev) or gpu_index(dev) >= n_gpus):
                raise InputError(f"plan puts tensors on {dev}, but the hardware profile {self.hw.name} has "
                                 f"{n_gpus} GPU(s) (CUDA0..CUDA{n_gpus - 1})")
        mem = estimate(inv, plan, self.hw)
        peak = {d: m.total for d, m in mem.devices.items() if d != "CPU"}
        cpu = mem.devices.get("CPU")
        host = mem.host_pinned + mem.host_mapped + sum(getattr(cpu, k, 0) for k in ("kv", "compute", "overhead"))
        for dev, used in peak.items():
            have = self.hw.gpu(dev).vram_bytes
            if used > have:
                return Measurement.failed(f"out of memory on {dev}: needs {fmt_bytes(used)}, has {fmt_bytes(have)}",
                                          peak_bytes=peak, host_bytes=host)
        pr = predict(inv, plan, self.hw, n_prompt=max(bench.n_prompt, 1), depth=bench.depth)
        return Measurement(pp_tps=pr.pp_tps if bench.n_prompt else 0.0, tg_tps=pr.tg_tps if bench.n_gen else 0.0,
                           peak_bytes=peak, host_bytes=host, raw={"breakdown": pr.breakdown, "engine": "sim"})


def from_options(opts: EngineOptions, hw: HardwareProfile) -> SimEngine:
    """The registry's factory (planner/engine_registry.py): the sim engine needs only the hardware."""
    return SimEngine(hw)
