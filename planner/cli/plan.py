"""`plan`: the best predicted placement, its flags per program, memory per device, predicted PP/TG."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from .. import defaults as D
from ..builds import Build
from ..errors import InputError
from ..hardware import HardwareProfile, fmt_bytes, parse_size
from ..plan import DEFAULT_CTX, DIALECTS, KV_TYPES, Knobs, Plan
from ..validate import check_dialect
from .common import _add_build, _add_hw, _emit_json, _hardware, _positive, _print_layers, _target_build

TOOLS = ("server", "cli", "bench")


def _knobs(args: argparse.Namespace) -> Knobs:
    k = Knobs()
    if args.ctx is not None:
        k = replace(k, n_ctx=_positive(args.ctx, "--ctx"))
    if args.ubatch is not None:
        ub = _positive(args.ubatch, "--ubatch")
        k = replace(k, n_ubatch=ub, n_batch=max(k.n_batch, ub))
    if args.batch is not None:
        k = replace(k, n_batch=_positive(args.batch, "--batch"))
    if args.kv_type:
        k = replace(k, type_k=args.kv_type, type_v=args.kv_type)
    if args.threads is not None:
        k = replace(k, n_threads=_positive(args.threads, "--threads"))
    return k


def _model_path(model: str) -> str:
    return "MODEL.gguf" if model.startswith("preset:") else model


@dataclass(frozen=True)
class Commands:
    """Ready-to-paste lines per program, and per program that cannot express the plan, why (one line)."""
    lines: dict[str, str]
    cannot: dict[str, str]


def commands_for(plan: Plan, inv, model: str, build: Build | None = None) -> Commands:
    """Shell-quoted lines for llama-server, llama-cli and llama-bench (with -m and any environment prefix).

    A tool that cannot express the plan (ik's llama-bench has no -op) costs only its own line: the others are
    still printed, the reason is kept, and for ik the plan is measured with llama-sweep-bench instead, which
    reads the server's flags (examples/sweep-bench uses the common parser)."""
    from ..errors import FlagError
    from ..flags import render
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


def _op_words(plan: Plan) -> str:
    """on / off, or which op classes are off (ik -op)."""
    pol = plan.knobs.offload
    off = [op for op in ("dense_matmul", "moe_matmul", "moe_fused_up_gate", "output") if not pol.rule(op).enabled]
    if not off:
        return "on"
    if len(off) == 4:
        return "off"
    return "moe off" if set(off) == {"moe_matmul", "moe_fused_up_gate"} else "partly off"


def _mmap_words(plan: Plan, build: Build) -> str:
    """How the target spells the plan's mmap choice (mainline -lm none since PR 20834; --no-mmap before; ik)."""
    if plan.knobs.mmap:
        return "mmap"
    from ..builds import Feature
    return "-lm none" if build.has(Feature.LOAD_MODE) else "--no-mmap"


@dataclass(frozen=True)
class PlanOutcome:
    """Everything `plan` reports: the text printer and `--json` (and the service) read the same object."""
    model: str
    objective: str
    inv: object
    hw: HardwareProfile
    build: Build
    ranked: list
    budget: object
    cmds: Commands

    def to_json(self) -> dict:
        from ..memory import estimate
        best, inv, hw = self.ranked[0], self.inv, self.hw
        return {"model": inv.name, "hardware": hw.name, "objective": self.objective,
                "plan": best.plan.to_dict(), "plan_id": best.plan.id, **estimate(inv, best.plan, hw).to_dict(),
                "budgets": self.budget.gpus, "predicted": {"pp_tps": best.pp_tps, "tg_tps": best.tg_tps},
                "build": self.build.describe(), "commands": self.cmds.lines, "not_expressible": self.cmds.cannot,
                "alternatives": [{"label": s.plan.label, "plan_id": s.plan.id, "pp_tps": s.pp_tps, "tg_tps": s.tg_tps,
                                  "mmap": s.plan.knobs.mmap, "op_offload": s.plan.knobs.offload.any_enabled,
                                  "gpu_bytes": {d: m.total for d, m in s.memory.devices.items() if d != "CPU"}}
                                 for s in self.ranked[1:]]}


def plan_outcome(args: argparse.Namespace) -> PlanOutcome:
    from ..loader import load_model
    from ..propose import Budget, best_plans
    inv = load_model(args.model)
    check_dialect(inv, args.dialect)
    hw = _hardware(args)
    knobs = _knobs(args)
    margin = parse_size(args.margin, allow_zero=True)
    if args.top < 1:
        raise InputError(f"--top {args.top}: list at least 1 candidate")
    build = _target_build(args)
    from ..builds import Feature
    if args.dialect == "ik" and not build.has(Feature.ONLY_ACTIVE_EXPERTS):
        knobs = replace(knobs, only_active_experts=False)   # before ik PR 698 every expert is uploaded
    if args.dialect == "ik" and inv.hparams.is_mla and args.amb is None:
        knobs = replace(knobs, amb=512)     # what ik users pass for DeepSeek (-amb 512; docs/ik_llama.md)
    elif args.dialect == "ik" and args.amb is not None:
        knobs = replace(knobs, amb=args.amb)
    objective = "balanced" if args.objective == "both" else args.objective
    ranked = best_plans(inv, hw, knobs, args.dialect, objective, margin)
    return PlanOutcome(args.model, objective, inv, hw, build, ranked, Budget.from_hardware(hw, margin),
                       commands_for(ranked[0].plan, inv, args.model, build))


def cmd_plan(args: argparse.Namespace) -> int:
    from ..tables import inventory_summary, memory_table, table
    o = plan_outcome(args)
    if args.json:
        _emit_json(o.to_json())
        return 0
    inv, hw, build, ranked, budget, cmds = o.inv, o.hw, o.build, o.ranked, o.budget, o.cmds
    best = ranked[0]
    print(f"model:    {inventory_summary(inv)}")
    gpus = ", ".join(f"{g.name} {fmt_bytes(g.vram_bytes)}" for g in hw.gpus)
    print(f"hardware: {hw.name}: {gpus}; host {hw.host.mem_bw / 1e9:.0f} GB/s, "
          f"PCIe {hw.link.h2d_pinned / 1e9:.0f} GB/s pinned")
    print(f"best ({o.objective}): {best.plan.label}, op offload {_op_words(best.plan)}, "
          f"{_mmap_words(best.plan, build)} -> predicted PP {best.pp_tps:.1f} t/s, TG {best.tg_tps:.2f} t/s")
    print(f"target:   {build.describe()}")
    print()
    _print_layers(inv, best.plan.assignment)
    print()
    print(memory_table(best.memory, budget.gpus))
    print()
    for tool, line in cmds.lines.items():
        print(f"{tool}:\n  {line}")
    for tool, why in cmds.cannot.items():
        print(f"{tool}: cannot express this plan: {why}")
    print()
    rows = [[s.plan.label, _op_words(s.plan), "yes" if s.plan.knobs.mmap else "no",
             " ".join(fmt_bytes(m.total) for d, m in sorted(s.memory.devices.items()) if d != "CPU"),
             f"{s.pp_tps:.1f}", f"{s.tg_tps:.2f}"] for s in ranked[: args.top]]
    print(table(["candidate", "op offload", "mmap", "GPU total", "PP t/s", "TG t/s"], rows))
    return 0


def _add_knobs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"context length (default {DEFAULT_CTX})")
    p.add_argument("--ubatch", type=int, help="-ub (default 512)")
    p.add_argument("--batch", type=int, help="-b (default 2048, at least --ubatch)")
    p.add_argument("--kv-type", choices=KV_TYPES, help="KV cache type for K and V (default f16)")
    p.add_argument("--threads", type=int, help="-t (default: the hardware's cores)")


def add_parser(sub) -> None:
    """Registers `plan` and its options."""
    p = sub.add_parser("plan", help="best predicted placement, flags, memory per device, predicted PP/TG")
    p.add_argument("model")
    _add_hw(p, True)
    _add_knobs(p)
    p.add_argument("--dialect", choices=DIALECTS, default="mainline")
    _add_build(p)
    p.add_argument("--amb", type=int, help="ik -amb in MiB (default 512 for MLA models, else ik's default)")
    p.add_argument("--objective", choices=("tg", "pp", "balanced", "both"), default="tg",
                   help="tg, pp or balanced (the geometric mean of both; 'both', tune's word, means the same here)")
    p.add_argument("--margin", default=D.PLAN_MARGIN, help=f"VRAM kept free per GPU (default {D.PLAN_MARGIN})")
    p.add_argument("--top", type=int, default=D.PLAN_TOP, help=f"candidates to list (default {D.PLAN_TOP})")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
