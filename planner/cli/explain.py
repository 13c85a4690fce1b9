"""`explain`: what a llama.cpp command line does: placement, memory, speed, warnings."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .. import engines
from ..errors import InputError
from ..hardware import HardwareProfile, fmt_bytes, from_gpu_sizes
from ..plan import DIALECTS, Plan, gpu_index, is_gpu
from ..validate import check_dialect
from .common import _add_build, _add_hw, _emit_json, _hardware, _print_layers, _target_build, layer_summary


@dataclass(frozen=True)
class ExplainOutcome:
    """What `explain` reports (text, `--json` and the service read the same object)."""
    dialect: str
    inv: object
    hw: HardwareProfile
    plan: Plan
    mem: object
    pred: object
    warnings: list
    oracle: tuple | None

    def to_json(self) -> dict:
        return {"model": self.inv.name, "dialect": self.dialect, "hardware": self.hw.name, "plan": self.plan.to_dict(),
                **self.mem.to_dict(), "predicted": {"pp_tps": self.pred.pp_tps, "tg_tps": self.pred.tg_tps},
                "layers": layer_summary(self.inv, self.plan.assignment), "warnings": self.warnings,
                **({"oracle": self.oracle[0]} if self.oracle else {})}


def explain_outcome(args: argparse.Namespace) -> ExplainOutcome:
    from ..cost import predict
    from ..flags import parse
    from ..loader import load_model
    from ..memory import estimate
    inv = load_model(args.model)
    if not args.llama_args:
        raise InputError("give the llama.cpp arguments after --, e.g. explain MODEL -- -ngl 99 -ot exps=CPU")
    check_dialect(inv, args.dialect)
    hw = _hardware(args, required=False)
    # the declared hardware bounds the device names (llama.cpp refuses a buffer type of a GPU it does not see)
    parsed = parse(args.llama_args, inv, args.dialect, n_gpus=len(hw.gpus) if hw is not None else None,
                   build=_target_build(args))
    plan = Plan(inv.source or inv.name, parsed.assignment, parsed.knobs, args.dialect, "explained")
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
    if getattr(args, "oracle", None):
        oracle = engines.runtime("oracle_compare")(inv, plan, mem, args.model, args.oracle)
    return ExplainOutcome(args.dialect, inv, hw, plan, mem, pred, warnings, oracle)


def cmd_explain(args: argparse.Namespace) -> int:
    from ..tables import inventory_summary, memory_table
    o = explain_outcome(args)
    if args.json:
        _emit_json(o.to_json())
        return 0
    inv, hw, plan, mem, pred, warnings, oracle = o.inv, o.hw, o.plan, o.mem, o.pred, o.warnings, o.oracle
    print(f"model:    {inventory_summary(inv)}")
    print(f"dialect:  {args.dialect}; hardware for the prediction: {hw.name}")
    print()
    _print_layers(inv, plan.assignment)
    print()
    print(memory_table(mem, {f"CUDA{i}": g.vram_bytes for i, g in enumerate(hw.gpus)}))
    print()
    print(f"predicted: PP {pred.pp_tps:.1f} t/s, TG {pred.tg_tps:.2f} t/s")
    if oracle:
        print(f"\nmemory: ours vs llama-fit-params ({args.oracle})\n{oracle[1]}")
    for w in warnings:
        print(f"warning: {w}")
    return 0


def add_parser(sub) -> None:
    """Registers `explain` and its options."""
    p = sub.add_parser("explain", help="what a llama.cpp command line does: placement, memory, speed, warnings")
    p.add_argument("model")
    p.add_argument("--dialect", choices=DIALECTS, default="mainline")
    _add_build(p)
    _add_hw(p, False)
    p.add_argument("--json", action="store_true")
    p.add_argument("--oracle", metavar="PATH", help="llama-fit-params binary: its memory estimate beside ours")
    p.epilog = "then -- and the llama.cpp arguments, e.g. explain MODEL -- -ngl 99 -cmoe"
    p.set_defaults(func=cmd_explain)
