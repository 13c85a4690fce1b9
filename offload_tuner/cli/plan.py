"""`plan`: the best predicted placement, its flags per program, memory per device, predicted PP/TG."""
from __future__ import annotations

import argparse

from ..app.plan import op_words as _op_words, plan_outcome
from ..app.requests import PlanRequest
from planner.builds import Build
from planner.hardware import fmt_bytes, kept_free_text
from planner.plan import Plan
from .common import add_build, add_hw, emit_json, print_layers, add_option, add_positional, request


def _mmap_words(plan: Plan, build: Build) -> str:
    """How the target spells the plan's mmap choice (mainline -lm none since PR 20834; --no-mmap before; ik)."""
    if plan.knobs.mmap:
        return "mmap"
    from planner.builds import Feature
    return "-lm none" if build.has(Feature.LOAD_MODE) else "--no-mmap"


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.tables import inventory_summary, memory_table, table
    o = plan_outcome(request(PlanRequest, args))
    if args.json:
        emit_json(o.to_json())
        return 0
    inv, hw, build, ranked, room, cmds = o.inv, o.hw, o.build, o.ranked, o.room, o.cmds
    best = ranked[0]
    print(f"model:    {inventory_summary(inv)}")
    gpus = ", ".join(f"{g.name} {fmt_bytes(g.vram_bytes)}" for g in hw.gpus)
    print(f"hardware: {hw.name}: {gpus}; host {fmt_bytes(hw.host.ram_bytes)} RAM, {hw.host.mem_bw / 1e9:.0f} GB/s, "
          f"PCIe {hw.link.h2d_pinned / 1e9:.0f} GB/s pinned; {kept_free_text(hw.keep_free_bytes)} per GPU")
    mean = f", mean request {o.request_s[best.plan.id]:.2f} s" if o.request_s is not None else ""
    first = f"{o.gives_up}: " if o.gives_up else ""      # what the pick trades away, said first (as tune's)
    print(f"best ({o.objective}): {first}{best.plan.label}, op offload {_op_words(best.plan)}, "
          f"{_mmap_words(best.plan, build)} -> predicted PP {best.pp_tps:.1f} t/s, TG {best.tg_tps:.2f} t/s{mean}")
    print(f"target:   {build.describe()}")
    for w in o.warnings:
        print(f"warning: {w}")
    print()
    print_layers(inv, best.plan.assignment)
    print()
    print(memory_table(best.memory, room.gpus, o.host))
    print()
    for tool, line in cmds.lines.items():
        print(f"{tool}:\n  {line}")
    for tool, why in cmds.cannot.items():
        print(f"{tool}: cannot express this plan: {why}")
    print()
    rows = [[s.plan.label, _op_words(s.plan), "yes" if s.plan.knobs.mmap else "no",
             " ".join(fmt_bytes(m.total) for d, m in sorted(s.memory.devices.items()) if d != "CPU"),
             f"{s.pp_tps:.1f}", f"{s.tg_tps:.2f}"] + ([f"{o.request_s[s.plan.id]:.2f}"] if o.request_s else [])
            for s in ranked[: o.top]]
    print(table(["candidate", "op offload", "mmap", "GPU total", "PP t/s", "TG t/s"]
                + (["request s"] if o.request_s else []), rows))
    return 0


def add_parser(sub) -> None:
    """Registers `plan` and its options."""
    p = sub.add_parser("plan", help="best predicted placement, flags, memory per device, predicted PP/TG")
    add_positional(p, PlanRequest, "model")
    add_hw(p, PlanRequest)
    for name in ("ctx", "ubatch", "batch", "kv_type", "threads", "dialect"):
        add_option(p, PlanRequest, name)
    add_build(p, PlanRequest)
    for name in ("amb", "objective", "workload", "keep_free", "margin", "top"):
        add_option(p, PlanRequest, name)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
