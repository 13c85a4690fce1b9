"""explain: what a llama.cpp command line does: placement, memory, speed, warnings."""
from __future__ import annotations

from dataclasses import dataclass

from .. import engines
from ..errors import InputError
from ..hardware import HardwareProfile, fmt_bytes, from_gpu_sizes
from ..model import ModelInventory
from ..plan import Plan, gpu_index, is_gpu
from ..validate import check_dialect
from .common import hardware, target_build
from .requests import ExplainRequest


def layer_summary(inv: ModelInventory, assignment: dict[str, str]) -> list[dict]:
    """Runs of consecutive layers with the same placement pattern: home device and where experts sit."""
    from ..flags import home_devices
    homes = home_devices(assignment, inv)
    rows: list[dict] = []
    for il in range(inv.n_layer):
        tensors = [t for t in inv.by_layer.get(il, ()) if t.role != "nextn"]
        if not tensors:
            continue
        home = homes[il] or "CPU"
        others = sorted({assignment.get(t.name, "CPU") for t in tensors if not t.is_expert})
        exps = {}
        for t in tensors:
            if t.is_expert and t.name.endswith(".weight"):
                exps[t.role.replace("exps_", "")] = assignment.get(t.name, "CPU")
        key = (home, tuple(others), tuple(sorted(exps.items())))
        if rows and rows[-1]["key"] == key and rows[-1]["last"] == il - 1:
            rows[-1]["last"] = il
        else:
            rows.append({"key": key, "first": il, "last": il, "home": home, "dense": others, "experts": exps})
    for r in rows:
        r.pop("key")
    return rows


@dataclass(frozen=True)
class ExplainOutcome:
    """What `explain` reports (text, `--json` and the service read the same object)."""
    dialect: str
    inv: ModelInventory
    hw: HardwareProfile
    plan: Plan
    mem: object
    pred: object
    warnings: list
    oracle: tuple | None        # (JSON, text table) of llama-fit-params beside our memory model
    oracle_path: str | None = None

    def to_json(self) -> dict:
        return {"model": self.inv.name, "dialect": self.dialect, "hardware": self.hw.name, "plan": self.plan.to_dict(),
                **self.mem.to_dict(), "predicted": {"pp_tps": self.pred.pp_tps, "tg_tps": self.pred.tg_tps},
                "layers": layer_summary(self.inv, self.plan.assignment), "warnings": self.warnings,
                **({"oracle": self.oracle[0]} if self.oracle else {})}


def explain_outcome(req: ExplainRequest) -> ExplainOutcome:
    from ..cost import predict
    from ..flags import parse
    from ..loader import load_model
    from ..memory import estimate
    inv = load_model(req.model)
    if not req.args:
        raise InputError("give the llama.cpp arguments after --, e.g. explain MODEL -- -ngl 99 -ot exps=CPU")
    check_dialect(inv, req.dialect)
    hw = hardware(req.hardware, req.gpu, required=False)
    # the declared hardware bounds the device names (llama.cpp refuses a buffer type of a GPU it does not see)
    parsed = parse(list(req.args), inv, req.dialect, n_gpus=len(hw.gpus) if hw is not None else None,
                   build=target_build(req.build, req.dialect))
    plan = Plan(inv.source or inv.name, parsed.assignment, parsed.knobs, req.dialect, "explained")
    n_gpus = max([gpu_index(d) + 1 for d in plan.assignment.values() if is_gpu(d)] or [0])
    if hw is None:
        hw = from_gpu_sizes(",".join(["24GiB"] * max(n_gpus, parsed.n_gpus, 1)))
    mem = estimate(inv, plan, hw)
    pred = predict(inv, plan, hw)
    warnings = list(parsed.warnings)     # (-nkvo: the parser already warns)
    for dev, m in mem.devices.items():
        if is_gpu(dev) and gpu_index(dev) < len(hw.gpus) and m.total > hw.gpu(dev).vram_bytes:
            warnings.append(f"W100 {dev} needs {fmt_bytes(m.total)} but has {fmt_bytes(hw.gpu(dev).vram_bytes)}: "
                            "this command would run out of memory")
    oracle = None
    if req.oracle:
        oracle = engines.runtime("oracle_compare")(inv, plan, mem, req.model, req.oracle)
    return ExplainOutcome(req.dialect, inv, hw, plan, mem, pred, warnings, oracle, req.oracle)
