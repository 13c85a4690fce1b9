"""`offload-tuner run` (measure one plan on an engine) and `explain --oracle` (llama-fit-params next to our
memory model). planner/cli/runtime_cmds.py registers the commands; the work is here, where the runtime is.

    offload-tuner run MODEL --engine llamacpp|sim|torch [--llama-bench PATH] (--plan FILE | -- <llama.cpp args>)
                      [--n-prompt N --n-gen N --depth N --reps N] [--gpu SIZE | --hardware P] [--json]

The plan comes from a Plan JSON file (`plan --json` output, whose "plan" key is used, or Plan.to_json()) or
from a llama.cpp command line (planner.flags.parse: the program name picks the tool, else llama-bench, else
llama-server). JSON output: the plan, the workload, the command run, `measurement` (the Measurement fields)
and `devices` (planner.memory for the same run). Exit 0 when the measurement succeeded, 1 when it failed
(the reason on stderr and in measurement.error), 2 for bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner import defaults as D
from planner.engines import names, spec
from planner.errors import FlagError, InputError
from planner.hardware import HardwareProfile, fmt_bytes, from_gpu_sizes, resolve
from planner.options import EngineOptions
from planner.plan import DIALECTS, Plan, device_sort_key, gpu_index, is_gpu
from planner.validate import check_dialect, check_plan

from .engine import Engine, Measurement, BenchWorkload

if TYPE_CHECKING:     # planner.memory is heavy: imported when a command runs, not when the parser is built
    from planner.memory import MemoryReport
    from planner.model import ModelInventory

DEFAULT_WORKLOAD = D.RUN_WORKLOAD


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a .gguf (the llamacpp engine needs the file) or preset:NAME[:QUANT]")
    p.add_argument("--engine", choices=names(), required=True)
    p.add_argument("--llama-bench", metavar="PATH", help="llama-bench or llama-sweep-bench (else $LLAMA_BENCH, "
                                                          "else llama-bench on PATH)")
    p.add_argument("--plan", metavar="FILE", help="Plan JSON (`plan --json` output or Plan.to_json())")
    p.add_argument("--dialect", choices=DIALECTS, help="for a command line after --: default the binary's "
                                                        "(llamacpp) or mainline")
    p.add_argument("--n-prompt", type=int, help=f"prompt tokens (default {DEFAULT_WORKLOAD.n_prompt}, or -p)")
    p.add_argument("--n-gen", type=int, help=f"generated tokens (default {DEFAULT_WORKLOAD.n_gen}, or -n)")
    p.add_argument("--depth", type=int, help="context depth before both (default 0, or -d)")
    p.add_argument("--reps", type=int, help=f"repetitions (default {DEFAULT_WORKLOAD.repetitions}, or -r)")
    p.add_argument("--timeout", type=float, default=D.RUN_TIMEOUT_S,
                   help=f"seconds per run (llamacpp; default {D.RUN_TIMEOUT_S:.0f})")
    p.add_argument("--gpu", help="GPU sizes for sim and for the predicted memory, e.g. 24GiB")
    p.add_argument("--hardware", help="hardware preset or calibrated JSON (sim; predicted memory)")
    p.add_argument("--json", action="store_true")


# ---- inputs -------------------------------------------------------------------------------------------------------

def read_plan_file(path: str, inv: ModelInventory, n_gpus: int | None = None) -> Plan:
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise InputError(f"cannot read --plan {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"--plan {path} is not JSON: {str(e)[:100]}") from e
    if isinstance(d, dict) and isinstance(d.get("plan"), dict):
        d = d["plan"]                     # `offload-tuner plan --json` output
    try:
        plan = Plan.from_dict(d)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise InputError(f"--plan {path} is not a Plan (expected model_id, assignment, knobs, dialect): {e}") from e
    names = {t.name for t in inv.allocated()}
    extra = sorted(plan.assignment.keys() - names)
    missing = sorted(names - plan.assignment.keys())
    if extra or missing:
        what = f"names {extra[0]!r}, which the model does not have" if extra else f"leaves {missing[0]!r} unplaced"
        raise InputError(f"--plan {path} does not fit this model: it {what}")
    if plan.dialect not in DIALECTS:
        raise InputError(f"--plan {path}: unknown dialect {str(plan.dialect)[:40]!r}")
    check_plan(plan, n_gpus, f"--plan {path}")
    return plan


def plan_from_args(llama_args: list[str], inv: ModelInventory, dialect: str,
                   n_gpus: int | None = None) -> tuple[Plan, dict[str, int]]:
    """A Plan from a llama.cpp command line, and the llama-bench workload it names (empty for other tools).
    `n_gpus` (the declared hardware's) bounds the device names."""
    from planner.flags import parse
    from planner.flags.cmdline import split_command
    _, program, _ = split_command(llama_args)
    if program is not None:
        pc = parse(llama_args, inv, dialect, n_gpus=n_gpus)
    else:
        try:
            pc = parse(llama_args, inv, dialect, tool="bench", n_gpus=n_gpus)
        except FlagError as bench_error:
            try:
                pc = parse(llama_args, inv, dialect, tool="server", n_gpus=n_gpus)
            except FlagError:
                raise bench_error from None
    return pc.to_plan(inv.source or inv.name, label="command line"), dict(pc.workload)


def workload_from(args: argparse.Namespace, named: dict[str, int]) -> BenchWorkload:
    def pick(value: int | None, key: str, default: int) -> int:
        return value if value is not None else int(named.get(key, default))
    return BenchWorkload(pick(args.n_prompt, "n_prompt", DEFAULT_WORKLOAD.n_prompt),
                    pick(args.n_gen, "n_gen", DEFAULT_WORKLOAD.n_gen), pick(args.depth, "n_depth", 0),
                    pick(args.reps, "repetitions", DEFAULT_WORKLOAD.repetitions))


def hardware_for(args: argparse.Namespace, plan: Plan | None = None) -> HardwareProfile:
    """--hardware / --gpu, else a generic desktop with one 24 GiB GPU per GPU the plan uses."""
    hw = resolve(getattr(args, "hardware", None), getattr(args, "gpu", None))
    if hw is not None:
        return hw
    n = max([gpu_index(d) + 1 for d in (plan.devices() if plan else []) if is_gpu(d)] or [1])
    return from_gpu_sizes(",".join(["24GiB"] * n))


def engine_options(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(engine=args.engine, model=args.model, llama_bench=args.llama_bench, timeout_s=args.timeout)


def make_engine(opts: EngineOptions, hw: HardwareProfile) -> Engine:
    from planner.engines import make_engine as make
    return make(opts, hw)


# ---- run ------------------------------------------------------------------------------------------------------------

def run_main(args: argparse.Namespace) -> int:
    from planner.loader import load_model
    from planner.memory import estimate
    if bool(args.plan) == bool(args.llama_args):
        raise InputError("give the plan either as --plan FILE or as llama.cpp arguments after --, not "
                         + ("both" if args.plan else "neither"))
    for flag in ("n_prompt", "n_gen", "depth", "reps"):
        v = getattr(args, flag)
        if v is not None and (v < 0 or (flag == "reps" and v < 1)):
            raise InputError(f"--{flag.replace('_', '-')} must be {'>= 1' if flag == 'reps' else '>= 0'}, got {v}")
    inv = load_model(args.model)
    declared = resolve(getattr(args, "hardware", None), getattr(args, "gpu", None))
    n_gpus = len(declared.gpus) if declared is not None else None   # devices beyond these do not exist
    engine: Engine | None = None
    if spec(args.engine).traits.binary:      # the binary decides the dialect of a command line
        engine = make_engine(engine_options(args), hardware_for(args))
    if args.plan:
        plan, named = read_plan_file(args.plan, inv, n_gpus), {}
    else:
        dialect = args.dialect or (engine.info.dialect if engine is not None else "mainline")   # type: ignore[attr-defined]
        plan, named = plan_from_args(args.llama_args, inv, dialect, n_gpus)
    check_dialect(inv, plan.dialect)
    workload = workload_from(args, named)
    hw = hardware_for(args, plan)
    if engine is None:
        engine = make_engine(engine_options(args), hw)
    command = None
    if hasattr(engine, "command"):           # an engine that runs a program shows its command line
        command = engine.command(inv, plan, workload).shell
    run_memory = getattr(engine, "run_memory", None)     # the memory of its run, where that is not the plan's
    mem = run_memory(inv, plan, workload, hw) if run_memory else estimate(inv, plan, hw)
    if not args.json:
        print(f"# {args.engine}: measuring plan {plan.id} ({workload.n_prompt} prompt + {workload.n_gen} generated "
              f"tokens at depth {workload.depth}, {workload.repetitions} reps)", file=sys.stderr, flush=True)
    m = engine.measure(inv, plan, workload)
    if args.json:
        json.dump({"model": inv.name or inv.source, "engine": args.engine, "plan_id": plan.id, "plan": plan.to_dict(),
                   "workload": {"n_prompt": workload.n_prompt, "n_gen": workload.n_gen, "depth": workload.depth,
                                "repetitions": workload.repetitions},
                   "command": command, "measurement": m.to_dict(), **mem.to_dict()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_measurement(m, mem, command)
    if not m.ok:
        print(f"offload-tuner: run failed: {m.error}", file=sys.stderr)
        return 1
    return 0


def print_measurement(m: Measurement, mem: MemoryReport, command: str | None) -> None:
    from planner.tables import table
    if command:
        print(f"command: {command}")
    status = "ok" if m.ok else f"FAILED ({m.raw.get('failure', 'error')}): {m.error}"
    print(f"result:  {status}")
    print(f"PP {m.pp_tps:.2f} t/s, TG {m.tg_tps:.2f} t/s; host peak RSS {fmt_bytes(m.host_bytes)}")
    rows = []
    for dev in sorted(set(mem.devices) | set(m.peak_bytes), key=device_sort_key):
        if dev == "CPU":
            continue
        pred = mem.devices[dev].total if dev in mem.devices else 0
        got = m.peak_bytes.get(dev)
        rows.append([dev, fmt_bytes(pred), fmt_bytes(got) if got is not None else "-",
                     fmt_bytes(got - pred) if got is not None else "-"])
    if rows:
        src = m.raw.get("vram_source", "")
        print(table(["device", "predicted", f"measured ({src})" if src else "measured", "measured - predicted"], rows))


# ---- explain --oracle ------------------------------------------------------------------------------------------------

def oracle_compare(inv: ModelInventory, plan: Plan, mem: MemoryReport, model: str, fit_params: str
                   ) -> tuple[dict[str, Any], str]:
    """llama-fit-params' per-device numbers for the plan next to ours: (JSON-ready dict, text table)."""
    from planner.tables import table
    from .llamacpp import oracle
    if model.startswith("preset:"):
        raise InputError("--oracle runs llama-fit-params on the model file; give a .gguf path, not a preset")
    theirs = oracle(inv, plan, model, fit_params)
    rows, out = [], {}
    for dev in sorted(set(theirs) | set(mem.devices), key=device_sort_key):
        o = theirs.get(dev)
        ours = mem.devices.get(dev)
        ours_self = (ours.weights + ours.kv + ours.compute) if ours is not None else 0
        o_total = sum(o.values()) if o is not None else None
        out[dev] = {"oracle": o, "ours": ours.to_dict() if ours is not None else None,
                    "ours_minus_oracle": (ours_self - o_total) if o_total is not None else None}
        rows.append([dev,
                     *(fmt_bytes(v) for v in ((ours.weights, ours.kv, ours.compute) if ours else (0, 0, 0))),
                     *((fmt_bytes(o["model"]), fmt_bytes(o["context"]), fmt_bytes(o["compute"])) if o else ("-",) * 3),
                     fmt_bytes(ours_self - o_total) if o_total is not None else "-"])
    text = table(["device", "ours: weights", "kv", "compute", "fit-params: model", "context", "compute",
                  "ours - theirs"], rows)
    note = ("llama-fit-params floors each value to whole MiB; its context = KV + output buffer; our overhead "
            "(CUDA context) is not in either column")
    return {"binary": fit_params, "devices": out, "note": note}, text + "\n" + note
