"""`explain`: what a llama.cpp command line does: placement, memory, speed, warnings."""
from __future__ import annotations

import argparse

from ..app.explain import explain_outcome
from ..app.requests import ExplainRequest
from planner.hardware import fmt_bytes
from .common import add_build, add_hw, emit_json, print_layers, add_option, add_positional, request


def cmd_explain(args: argparse.Namespace) -> int:
    from planner.tables import inventory_summary, memory_table
    o = explain_outcome(request(ExplainRequest, args, args=tuple(args.llama_args)))
    if args.json:
        emit_json(o.to_json())
        return 0
    inv, hw, plan, mem, pred, warnings, oracle = o.inv, o.hw, o.plan, o.mem, o.pred, o.warnings, o.oracle
    print(f"model:    {inventory_summary(inv)}")
    print(f"dialect:  {o.dialect}; hardware for the prediction: {hw.name}, host {fmt_bytes(hw.host.ram_bytes)} RAM")
    print()
    print_layers(inv, plan.assignment)
    print()
    print(memory_table(mem, {f"CUDA{i}": g.vram_bytes for i, g in enumerate(hw.gpus)}, o.host))
    print()
    print(f"predicted: PP {pred.pp_tps:.1f} t/s, TG {pred.tg_tps:.2f} t/s")
    if oracle:
        print(f"\nmemory: ours vs llama-fit-params ({o.oracle_path})\n{oracle[1]}")
    for w in warnings:
        print(f"warning: {w}")
    return 0


def add_parser(sub) -> None:
    """Registers `explain` and its options."""
    p = sub.add_parser("explain", help="what a llama.cpp command line does: placement, memory, speed, warnings")
    add_positional(p, ExplainRequest, "model")
    add_option(p, ExplainRequest, "dialect")
    add_build(p, ExplainRequest)
    add_hw(p, ExplainRequest)
    p.add_argument("--json", action="store_true")
    add_option(p, ExplainRequest, "oracle", metavar="PATH")
    p.epilog = "then -- and the llama.cpp arguments, e.g. explain MODEL -- -ngl 99 -cmoe"
    p.set_defaults(func=cmd_explain)
