"""plan: the best predicted placement, its flags per program, memory per device, predicted PP/TG."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from planner.builds import Build
from planner.errors import InputError
from planner.hardware import HardwareProfile, parse_size
from planner.model import ModelInventory
from planner.plan import Knobs, Plan
from planner.validate import check_dialect
from planner.workload import load as load_workload
from .common import hardware, positive, target_build
from .requests import PlanRequest

TOOLS = ("server", "cli", "bench")


def _knobs(req: PlanRequest) -> Knobs:
    k = Knobs()
    if req.ctx is not None:
        k = replace(k, n_ctx=positive(req.ctx, "--ctx"))
    if req.ubatch is not None:
        ub = positive(req.ubatch, "--ubatch")
        k = replace(k, n_ubatch=ub, n_batch=max(k.n_batch, ub))
    if req.batch is not None:       # --ubatch above --batch is refused (PlanRequest); the default ubatch shrinks to
        b = positive(req.batch, "--batch")       # it, as llama.cpp runs n_ubatch = min(n_batch, n_ubatch)
        k = replace(k, n_batch=b, n_ubatch=min(k.n_ubatch, b))
    if req.kv_type:
        k = replace(k, type_k=req.kv_type, type_v=req.kv_type)
    if req.threads is not None:
        k = replace(k, n_threads=positive(req.threads, "--threads"))
    return k


def _model_path(model: str) -> str:
    """-m of the emitted lines: MODEL.gguf for a preset, the first shard for any shard of a split model."""
    from planner.gguf_header import first_shard
    return "MODEL.gguf" if model.startswith("preset:") else first_shard(model)


@dataclass(frozen=True)
class Commands:
    """Ready-to-paste lines per program, and per program that cannot express the plan, why (one line)."""
    lines: dict[str, str]
    cannot: dict[str, str]


def commands_for(plan: Plan, inv: ModelInventory, model: str, build: Build | None = None) -> Commands:
    """Shell-quoted lines for llama-server, llama-cli and llama-bench (with -m and any environment prefix).

    A tool that cannot express the plan (ik's llama-bench has no -op) costs only its own line: the others are
    still printed, the reason is kept, and for ik the plan is measured with llama-sweep-bench instead, which
    reads the server's flags (examples/sweep-bench uses the common parser)."""
    from planner.errors import FlagError
    from planner.flags import render
    lines: dict[str, str] = {}
    cannot: dict[str, str] = {}
    for tool in TOOLS:
        name = f"llama-{tool}"
        try:
            lines[name] = render(plan, inv, tool, build=build, model_path=_model_path(model)).shell()
        except FlagError as e:
            cannot[name] = str(e)
    if "llama-bench" in cannot and plan.dialect == "ik" and "llama-server" in lines:
        lines["llama-sweep-bench"] = lines["llama-server"].replace("llama-server", "llama-sweep-bench", 1)
    return Commands(lines, cannot)


@dataclass(frozen=True)
class PlanOutcome:
    """Everything `plan` reports: the text printer and `--json` (and the service) read the same object."""
    model: str
    objective: str
    inv: ModelInventory
    hw: HardwareProfile
    build: Build
    ranked: list
    room: object                  # propose.Room: GPU memory less what is kept free and the margin
    cmds: Commands
    top: int                  # candidates the text lists
    workload: str | None = None               # plan --workload: its name, and each candidate's predicted mean
    request_s: dict[str, float] | None = None  # request time by plan id (what the candidates are ranked by)
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict:
        from planner.memory import estimate
        best, inv, hw = self.ranked[0], self.inv, self.hw
        return {"model": inv.name, "hardware": hw.name, "objective": self.objective,
                "plan": best.plan.to_dict(), "plan_id": best.plan.id, **estimate(inv, best.plan, hw).to_dict(),
                "keep_free_bytes": hw.keep_free_bytes, "budgets": self.room.gpus,
                "predicted": {"pp_tps": best.pp_tps, "tg_tps": best.tg_tps, **self._request(best)},
                "build": self.build.describe(), "commands": self.cmds.lines, "not_expressible": self.cmds.cannot,
                "alternatives": [{"label": s.plan.label, "plan_id": s.plan.id, "pp_tps": s.pp_tps, "tg_tps": s.tg_tps,
                                  "mmap": s.plan.knobs.mmap, "op_offload": s.plan.knobs.offload.any_enabled,
                                  "gpu_bytes": {d: m.total for d, m in s.memory.devices.items() if d != "CPU"},
                                  **self._request(s)}
                                 for s in self.ranked[1:]], **({"workload": self.workload} if self.workload else {}),
                "warnings": list(self.warnings)}

    def _request(self, s: Any) -> dict[str, float]:
        return {"mean_request_s": self.request_s[s.plan.id]} if self.request_s is not None else {}


def plan_outcome(req: PlanRequest) -> PlanOutcome:
    from planner.loader import load_model
    from planner.propose import Room, best_plans
    inv = load_model(req.model)
    check_dialect(inv, req.dialect)
    hw = hardware(req.hardware, req.gpu, keep_free=req.keep_free)
    knobs = _knobs(req)
    margin = parse_size(req.margin, allow_zero=True)
    if req.top < 1:
        raise InputError(f"--top {req.top}: list at least 1 candidate")
    build = target_build(req.build, req.dialect)
    from planner.builds import Feature
    if req.dialect == "ik" and not build.has(Feature.ONLY_ACTIVE_EXPERTS):
        knobs = replace(knobs, only_active_experts=False)   # before ik PR 698 every expert is uploaded
    if req.dialect == "ik" and inv.hparams.is_mla and req.amb is None:
        knobs = replace(knobs, amb=512)     # what ik users pass for DeepSeek (-amb 512; docs/ik_llama.md)
    elif req.dialect == "ik" and req.amb is not None:
        knobs = replace(knobs, amb=req.amb)
    objective = req.objective
    requests = load_workload(req.workload) if req.workload else None
    if requests is not None:     # the emitted context holds the longest request in each slot
        knobs = replace(knobs, n_ctx=max(knobs.n_ctx, -(-requests.ctx // 256) * 256), n_seq=requests.slots)
    ranked = best_plans(inv, hw, knobs, req.dialect, objective, margin)
    times = None
    if requests is not None:
        from tuner.objectives import predicted_request_s
        times = {s.plan.id: predicted_request_s(inv, hw, s.plan, requests) for s in ranked}
        ranked = sorted(ranked, key=lambda s: times[s.plan.id])
        objective = f"time, workload {requests.name}"
    warnings = []
    if requests is not None and requests.slot_ctx > inv.hparams.n_ctx_train > 0:    # one line says both
        warnings.append(f"W029 workload {requests.name}: its longest request ({requests.slot_ctx} tokens) is longer "
                        f"than the model's training context ({inv.hparams.n_ctx_train}); -c {knobs.n_ctx} holds it, "
                        "but llama.cpp warns of a possible context overflow and quality may suffer")
    elif knobs.n_ctx > inv.hparams.n_ctx_train > 0:      # explain's W029, for the context plan emits
        warnings.append(f"W029 -c {knobs.n_ctx} is more than the model's training context "
                        f"({inv.hparams.n_ctx_train}): llama.cpp warns of a possible context overflow; quality may "
                        "suffer")
    return PlanOutcome(req.model, objective, inv, hw, build, ranked, Room.from_hardware(hw, margin),
                       commands_for(ranked[0].plan, inv, req.model, build), req.top,
                       requests.name if requests is not None else None, times, tuple(warnings))
