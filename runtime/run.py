"""`offload-tuner run` (measure one plan on an engine) and `explain --oracle` (llama-fit-params next to our
memory model): the work, where the runtime is. offload_tuner/cli/runtime_cmds.py parses `run`'s flags into a
planner.options.RunRequest, calls prepare_run, measures and prints.

The plan comes from a Plan JSON file (`plan --json` output, whose "plan" key is used, or Plan.to_json()) or
from a llama.cpp command line (planner.flags.parse: the program name picks the tool, else llama-bench, else
llama-server). PreparedRun.to_json: the plan, the bench run (under "workload"), the command run, `measurement`
(the Measurement fields) and `devices` (planner.memory for the same run).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner import defaults as D
from planner.engine_registry import spec
from planner.errors import FlagError, InputError
from planner.files import PLAN_BYTES, read_text
from planner.hardware import HardwareProfile, fmt_bytes, from_gpu_sizes, resolve
from planner.options import EngineOptions, RunRequest
from planner.plan import DIALECTS, Plan, device_sort_key, gpu_index, is_gpu
from planner.validate import check_dialect, check_plan

from planner.engine_contract import Engine, Measurement, BenchRun

if TYPE_CHECKING:     # planner.memory is heavy: imported when a command runs, not when the parser is built
    from planner.memory import MemoryReport
    from planner.model import ModelInventory

DEFAULT_WORKLOAD = D.RUN_WORKLOAD


# ---- inputs -------------------------------------------------------------------------------------------------------

def read_plan_file(path: str, inv: ModelInventory, n_gpus: int | None = None) -> Plan:
    try:
        d = json.loads(read_text(path, "--plan", PLAN_BYTES))
    except (json.JSONDecodeError, RecursionError) as e:
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
    """A Plan from a llama.cpp command line, and the bench run its llama-bench flags name (empty for other tools).
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
    return pc.to_plan(inv.source or inv.name, label="command line"), dict(pc.bench)


def bench_from(req: RunRequest, named: dict[str, int]) -> BenchRun:
    def pick(value: int | None, key: str, default: int) -> int:
        return value if value is not None else int(named.get(key, default))
    return BenchRun(pick(req.n_prompt, "n_prompt", DEFAULT_WORKLOAD.n_prompt),
                         pick(req.n_gen, "n_gen", DEFAULT_WORKLOAD.n_gen), pick(req.depth, "n_depth", 0),
                         pick(req.reps, "repetitions", DEFAULT_WORKLOAD.repetitions))


def hardware_for(req: RunRequest, plan: Plan | None = None) -> HardwareProfile:
    """--hardware / --gpu, else a generic desktop with one 24 GiB GPU per GPU the plan uses."""
    hw = resolve(req.hardware, req.gpu)
    if hw is not None:
        return hw
    n = max([gpu_index(d) + 1 for d in (plan.devices() if plan else []) if is_gpu(d)] or [1])
    return from_gpu_sizes(",".join(["24GiB"] * n))


def make_engine(opts: EngineOptions, hw: HardwareProfile) -> Engine:
    from planner.engine_registry import make_engine as make
    return make(opts, hw)


# ---- run ------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PreparedRun:
    """A run ready to measure: the model, the plan and its bench run, the engine made for it, the command it runs
    (None for an engine that runs no program) and the memory predicted for it."""
    request: RunRequest
    inv: ModelInventory
    plan: Plan
    bench: BenchRun
    engine: Engine
    command: str | None
    memory: MemoryReport

    def measure(self) -> Measurement:
        return self.engine.measure(self.inv, self.plan, self.bench)

    def to_json(self, m: Measurement) -> dict[str, Any]:
        w = self.bench
        return {"model": self.inv.name or self.inv.source, "engine": self.request.engine, "plan_id": self.plan.id,
                "plan": self.plan.to_dict(),
                "workload": {"n_prompt": w.n_prompt, "n_gen": w.n_gen, "depth": w.depth, "repetitions": w.repetitions},
                "command": self.command, "measurement": m.to_dict(), **self.memory.to_dict()}


def rep_spread(m: Measurement) -> dict[str, tuple[float, float, int]]:
    """{"pp"|"tg": (slowest, fastest, repetitions)} of a run's repetitions, where the engine reports each one
    (llama-bench's samples_ts per test: a PP test generates nothing, a TG test reads no new prompt); {} where it
    does not (the sim engine)."""
    out: dict[str, tuple[float, float, int]] = {}
    for t in m.raw.get("tests") or []:
        samples = [float(x) for x in t.get("samples_ts") or []]
        kind = "pp" if not t.get("n_gen") else "tg" if not t.get("n_prompt") else None
        if kind and len(samples) > 1:
            out[kind] = (min(samples), max(samples), len(samples))
    return out


def prepare_run(req: RunRequest) -> PreparedRun:
    """The run REQ describes, checked and set up (the model loaded, the plan read, the engine made), not yet
    measured. InputError for bad input."""
    from planner.loader import load_model
    from planner.memory import estimate
    if bool(req.plan) == bool(req.llama_args):
        raise InputError("give the plan either as --plan FILE or as llama.cpp arguments after --, not "
                         + ("both" if req.plan else "neither"))
    for flag in ("n_prompt", "n_gen", "depth", "reps"):
        v = getattr(req, flag)
        if v is not None and (v < 0 or (flag == "reps" and v < 1)):
            raise InputError(f"--{flag.replace('_', '-')} must be {'>= 1' if flag == 'reps' else '>= 0'}, got {v}")
        top = D.MAX_REPS if flag == "reps" else D.MAX_TOKENS      # planner/defaults.py says why
        if v is not None and v > top:
            raise InputError(f"--{flag.replace('_', '-')} {str(v)[:40]}: at most {top}")
    if not (math.isfinite(req.timeout_s) and 0 < req.timeout_s <= D.MAX_TIMEOUT_S):
        raise InputError(f"--timeout {req.timeout_s}: give the seconds one run may take, above 0 and at most "
                         f"{D.MAX_TIMEOUT_S:.0f} (a week); nan or inf would leave a hung engine running for ever")
    inv = load_model(req.model)
    declared = resolve(req.hardware, req.gpu)
    n_gpus = len(declared.gpus) if declared is not None else None   # devices beyond these do not exist
    engine: Engine | None = None
    if spec(req.engine).traits.binary:      # the binary decides the dialect of a command line
        engine = make_engine(req.engine_options(), hardware_for(req))
    if req.plan:
        plan, named = read_plan_file(req.plan, inv, n_gpus), {}
    else:
        dialect = req.dialect or (engine.info.dialect if engine is not None else "mainline")   # type: ignore[attr-defined]
        plan, named = plan_from_args(list(req.llama_args), inv, dialect, n_gpus)
    check_dialect(inv, plan.dialect)
    bench = bench_from(req, named)
    hw = hardware_for(req, plan)
    if engine is None:
        engine = make_engine(req.engine_options(), hw)
    command = engine.shell_command(inv, plan, bench)      # an engine that runs a program shows its command line
    mem = engine.run_memory(inv, plan, bench, hw) or estimate(inv, plan, hw)
    return PreparedRun(req, inv, plan, bench, engine, command, mem)


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
