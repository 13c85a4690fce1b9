"""plan: the best predicted placement, its flags per program, memory per device, predicted PP/TG."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from planner.builds import Build
from planner.errors import InputError
from planner.hardware import HardwareProfile, parse_size
from planner.host import HostBill, shortfall_warning
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


def commands_for(plan: Plan, inv: ModelInventory, model: str, build: Build | None = None,
                 cache_ram_mib: int | None = None) -> Commands:
    """Shell-quoted lines for llama-server, llama-cli and llama-bench (with -m and any environment prefix), the
    server's with --cache-ram `cache_ram_mib` where given (and the build has it: host_of).

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
            lines[name] = render(plan, inv, tool, build=build, model_path=_model_path(model),
                                 cache_ram_mib=cache_ram_mib).shell()
        except FlagError as e:
            cannot[name] = str(e)
    if "llama-bench" in cannot and plan.dialect == "ik" and "llama-server" in lines:
        server = render(plan, inv, "server", build=build, model_path=_model_path(model)).shell()   # no prompt cache
        lines["llama-sweep-bench"] = server.replace("llama-server", "llama-sweep-bench", 1)
    return Commands(lines, cannot)


def host_of(best: Any, hw: HardwareProfile, build: Build) -> tuple[HostBill, int | None]:
    """The pick's host bill against the RAM and the --cache-ram its server line gets: llama-server's default prompt
    cache where the RAM has room for it, else what is left (planner/host.py); None for a build without the flag."""
    from planner.builds import Spelling
    from planner.host import cache_ram_for, host_bill, with_prompt_cache
    bill = best.host if best.host is not None else host_bill(best.memory, hw.host.ram_bytes)
    if not build.accepts(Spelling.CACHE_RAM):
        return bill, None
    cache = cache_ram_for(bill)
    return with_prompt_cache(bill, cache), cache


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
    workload: str | None = None               # the workload (plan --workload, chat under time): its name, and
    request_s: dict[str, float] | None = None  # each candidate's predicted mean request time by plan id
    warnings: tuple[str, ...] = ()
    gives_up: str | None = None               # what the pick trades away against an alternative (gives_up)
    host: HostBill | None = None              # the pick's host RAM in parts, its prompt cache at the emitted size

    def to_json(self) -> dict:
        from planner.memory import estimate
        best, inv, hw = self.ranked[0], self.inv, self.hw
        return {"model": inv.name, "hardware": hw.name, "objective": self.objective, "gives_up": self.gives_up,
                "plan": best.plan.to_dict(), "plan_id": best.plan.id, **estimate(inv, best.plan, hw).to_dict(),
                "keep_free_bytes": hw.keep_free_bytes, "budgets": self.room.gpus,
                "predicted": {"pp_tps": best.pp_tps, "tg_tps": best.tg_tps, **self._request(best)},
                "build": self.build.describe(), "commands": self.cmds.lines, "not_expressible": self.cmds.cannot,
                "alternatives": [{"label": s.plan.label, "plan_id": s.plan.id, "pp_tps": s.pp_tps, "tg_tps": s.tg_tps,
                                  "mmap": s.plan.knobs.mmap, "op_offload": s.plan.knobs.offload.any_enabled,
                                  "gpu_bytes": {d: m.total for d, m in s.memory.devices.items() if d != "CPU"},
                                  **self._request(s)}
                                 for s in self.ranked[1:]], **({"workload": self.workload} if self.workload else {}),
                "warnings": list(self.warnings), "host_ram": self.host.to_dict() if self.host else None}

    def _request(self, s: Any) -> dict[str, float]:
        return {"mean_request_s": self.request_s[s.plan.id]} if self.request_s is not None else {}


def op_words(plan: Plan) -> str:
    """Op offload in words: on / off, or which op classes are off (ik -op)."""
    pol = plan.knobs.offload
    off = [op for op in ("dense_matmul", "moe_matmul", "moe_fused_up_gate", "output") if not pol.rule(op).enabled]
    if not off:
        return "on"
    if len(off) == 4:
        return "off"
    return "moe off" if set(off) == {"moe_matmul", "moe_fused_up_gate"} else "partly off"


def gives_up(ranked: list) -> str | None:
    """What the pick (ranked[0]) trades away, said first on its line, by the rule tune's first line follows
    (tuner.served: PP_GIVE_UP, TG_GIVE_UP): under half the PP of an alternative whose TG is within 5% of the pick's
    (the one of those with the most PP); None when it gives up nothing so."""
    from tuner.served import PP_GIVE_UP, TG_GIVE_UP
    best = ranked[0]
    near = [s for s in ranked[1:] if s.tg_tps >= TG_GIVE_UP * best.tg_tps]
    alt = max(near, key=lambda s: s.pp_tps, default=None)
    if alt is None or best.pp_tps >= PP_GIVE_UP * alt.pp_tps:
        return None
    k = alt.plan.knobs
    return (f"gives up PP {best.pp_tps / alt.pp_tps:.2f}x the best alternative's ({best.pp_tps:.1f} vs "
            f"{alt.pp_tps:.1f} t/s: {alt.plan.label}, op offload {op_words(alt.plan)}, "
            f"{'mmap' if k.mmap else 'no mmap'}) for TG {best.tg_tps / alt.tg_tps - 1:+.1%}")


def _workload(req: PlanRequest):
    """The requests the plan is sized for: the workload given, else under the time objective the default one
    (tune's, chat); None under tg, pp or both without one."""
    from planner import defaults as D
    if req.workload:
        return load_workload(req.workload)
    return load_workload(D.TUNE_REQUESTS) if req.objective == "time" else None


def plan_outcome(req: PlanRequest) -> PlanOutcome:
    from planner.loader import load_model
    from planner.propose import Room, best_plans, distinct
    inv = load_model(req.model)
    check_dialect(inv, req.dialect)
    hw = hardware(req.hardware, req.gpu, keep_free=req.keep_free, ram=req.ram)
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
    requests = _workload(req)
    if requests is not None:     # the emitted context holds the longest request in each slot
        knobs = replace(knobs, n_ctx=max(knobs.n_ctx, -(-requests.ctx // 256) * 256), n_seq=requests.slots)
    ranked = best_plans(inv, hw, knobs, req.dialect, "tg" if objective == "time" else objective, margin)
    times = None
    if requests is not None:     # the request times: what time ranks by, shown beside tg, pp or both
        from tuner.objectives import predicted_request_s
        times = {s.plan.id: predicted_request_s(inv, hw, s.plan, requests) for s in ranked}
        if objective == "time":
            ranked = sorted(ranked, key=lambda s: times[s.plan.id])
            objective = f"time, workload {requests.name}"
    ranked = distinct(ranked)     # a switch that changes nothing for a placement is not another candidate
    warnings = []
    if requests is not None and requests.slot_ctx > inv.hparams.n_ctx_train > 0:    # one line says both
        warnings.append(f"W029 workload {requests.name}: its longest request ({requests.slot_ctx} tokens) is longer "
                        f"than the model's training context ({inv.hparams.n_ctx_train}); -c {knobs.n_ctx} holds it, "
                        "but llama.cpp warns of a possible context overflow and quality may suffer")
    elif knobs.n_ctx > inv.hparams.n_ctx_train > 0:      # explain's W029, for the context plan emits
        warnings.append(f"W029 -c {knobs.n_ctx} is more than the model's training context "
                        f"({inv.hparams.n_ctx_train}): llama.cpp warns of a possible context overflow; quality may "
                        "suffer")
    host, cache_ram = host_of(ranked[0], hw, build)
    if (short := shortfall_warning(host, hw.host.disk_read_bytes_per_s)) is not None:
        warnings.append(short)
    return PlanOutcome(req.model, objective, inv, hw, build, ranked, Room.from_hardware(hw, margin),
                       commands_for(ranked[0].plan, inv, req.model, build, cache_ram), req.top,
                       requests.name if requests is not None else None, times, tuple(warnings), gives_up(ranked),
                       host=host)
