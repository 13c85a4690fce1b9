"""offload-tuner command line: argparse entry point wiring the planner (and, lazily, the runtime).

Results go to stdout (tables, or JSON with --json); logs to stderr. Expected errors print one line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, replace

from .. import defaults as D
from .. import engines
from ..builds import Build, parse_build
from ..tuner.confirm import CONFIRM_ROUNDS
from ..errors import BudgetError, InputError
from ..hardware import HardwareProfile, fmt_bytes, from_gpu_sizes, parse_size, resolve
from ..options import EngineOptions, TuneOptions
from ..plan import DEFAULT_CTX, DIALECTS, KV_TYPES, Knobs, Plan, gpu_index, is_gpu
from ..validate import check_dialect

# the demo's study: what studies/demo.toml spells out (a test holds the two equal), built in so that `demo` runs
# from any folder. Qwen3-30B-A3B Q4_K_M on a 16 GiB RTX 4090 with dual-channel DDR5, sim engine, objective both.
DEMO = TuneOptions(model="preset:Qwen3-30B-A3B:Q4_K_M", engine="sim", hardware="rtx4090-ddr5", gpu="16GiB",
                   trials=60, study="demo", objective="both", reps=1, ctx=DEFAULT_CTX, pool=120)
TOOLS = ("server", "cli", "bench")


# ---- shared pieces --------------------------------------------------------------------------------------------

def _emit_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _hardware(args: argparse.Namespace, required: bool = True) -> HardwareProfile | None:
    hw = resolve(getattr(args, "hardware", None), getattr(args, "gpu", None))
    if hw is not None:
        return hw
    if required:
        raise InputError("say what GPUs there are: --gpu 24GiB[,24GiB] or --hardware PROFILE")
    return None


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


def _positive(v: int, flag: str) -> int:
    if v <= 0:
        raise InputError(f"{flag} must be positive, got {v}")
    return v


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


def _target_build(args: argparse.Namespace) -> Build:
    """--build DIALECT:N, or the path of a llama.cpp program (its --help and --version say), else pinned."""
    spec = getattr(args, "build", None)
    if spec and ("/" in spec or spec.startswith(".")):
        build = engines.runtime("build_of_binary")(spec)    # cli.py is where planner and runtime meet
        if build.dialect != args.dialect:
            raise InputError(f"--build {spec} is a {build.dialect} program; say --dialect {build.dialect}")
        return build
    return parse_build(spec, args.dialect)


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


def layer_summary(inv, assignment: dict[str, str]) -> list[dict]:
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


def _print_layers(inv, assignment: dict[str, str]) -> None:
    from ..tuner.report import table
    out_dev = assignment.get("output.weight", assignment.get("output_norm.weight", "CPU"))
    rows = [["token_embd", assignment.get("token_embd.weight", "CPU"), "-"], ["output", out_dev, "-"]]
    for r in layer_summary(inv, assignment):
        span = f"blk {r['first']}" if r["first"] == r["last"] else f"blk {r['first']}-{r['last']}"
        exps = ", ".join(f"{k}:{v}" for k, v in r["experts"].items()) or "-"
        rows.append([span, "/".join(r["dense"]), exps])
    print(table(["layers", "attn+dense on", "experts (up/gate/down)"], rows, right=set()))


# ---- commands -------------------------------------------------------------------------------------------------

def _per_layer(inv) -> list[dict]:
    out = []
    for il in range(inv.n_layer):
        ts = inv.by_layer.get(il, ())
        out.append({"layer": il, "bytes": sum(t.nbytes for t in ts),
                    "expert_bytes": sum(t.nbytes for t in ts if t.is_expert),
                    "nextn": any(t.role == "nextn" for t in ts)})
    return out


def inspect_json(inv) -> dict:
    """What `inspect --json` prints (the service answers the same)."""
    return {"model": inv.name, "source": inv.source, "arch": inv.arch,
            "hparams": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(inv.hparams).items()},
            "n_tensors": len(inv.tensors), "total_bytes": inv.total_bytes(),
            "active_bytes_per_token": inv.active_bytes_per_token(), "tied_output": inv.tied_output,
            "groups": inv.groups(), "layers": _per_layer(inv)}


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..loader import load_model
    from ..tuner.report import inventory_summary, table
    inv = load_model(args.model)
    hp = inv.hparams
    groups = inv.groups()
    per_layer = _per_layer(inv)
    if args.json:
        _emit_json(inspect_json(inv))
        return 0
    print(inventory_summary(inv))
    print(f"tensors: {len(inv.tensors)}; weights read per token: {fmt_bytes(inv.active_bytes_per_token())}"
          + ("; output tied to token_embd" if inv.tied_output else ""))
    print(f"n_embd {hp.n_embd}, n_head {hp.n_head}, n_head_kv {max(hp.n_head_kv)}, "
          f"head_dim {hp.head_dim_k}/{hp.head_dim_v}, "
          f"vocab {hp.n_vocab}, ctx_train {hp.n_ctx_train}"
          + (f", MLA kv_lora_rank {hp.mla_kv_lora_rank}" if hp.is_mla else "")
          + (f", SWA window {hp.n_swa} on {sum(hp.swa_layers)} layers" if hp.n_swa else ""))
    print()
    print(table(["group", "bytes"], [[g, fmt_bytes(b)] for g, b in sorted(groups.items(), key=lambda x: -x[1])]))
    print()
    runs: list[list[object]] = []
    for row in per_layer:
        desc = (fmt_bytes(row["bytes"]), fmt_bytes(row["expert_bytes"]), "nextn (not loaded)" if row["nextn"] else "")
        if runs and runs[-1][2:] == list(desc) and runs[-1][1] == row["layer"] - 1:
            runs[-1][1] = row["layer"]
        else:
            runs.append([row["layer"], row["layer"], *desc])
    print(table(["layers", "bytes per layer", "experts", "note"],
                [[f"{a}" if a == b else f"{a}-{b}", x, y, z] for a, b, x, y, z in runs]))
    return 0


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
    from ..tuner.report import inventory_summary, memory_table, table
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
    from ..tuner.report import inventory_summary, memory_table
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


def cmd_run(args: argparse.Namespace) -> int:
    return engines.runtime("run")(args)


def cmd_synth(args: argparse.Namespace) -> int:
    return engines.runtime("synth")(args) or 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    return engines.runtime("calibrate")(args)


def load_engine(opts: EngineOptions, hw: HardwareProfile):
    """The Engine `opts` names, looked up in planner.engines' registry. sim is always here; torch and llamacpp
    are looked up lazily in the runtime (runtime/torch_engine, runtime/llamacpp.py, built through the registry's
    make_engine as `run` does): a module that is missing, or exposes no engine, is one line and exit 2."""
    if opts.engine == "sim":
        return engines.engine_class("sim")(hw)
    module = ENGINE_MODULES[opts.engine]
    if not engines.module_found(module):
        raise InputError(f"engine {opts.engine} is not available yet (no {module} in this install); use --engine sim")
    if opts.engine == "torch" and not _cuda_available():
        raise InputError("engine torch measures plans on CUDA GPUs and this machine has none; use --engine sim "
                         "(or run the same tune command where the GPU is)")
    try:
        make_engine = engines.runtime("make_engine")
    except ImportError as e:
        raise InputError(f"engine {opts.engine} is not available yet (runtime.run_cli: {e})") from e
    return make_engine(opts, hw)


ENGINE_MODULES = {name: engines.engine_module(name) for name in ("torch", "llamacpp")}   # tests point one elsewhere


def _nonneg(v: int, flag: str) -> int:
    if v < 0:
        raise InputError(f"{flag} must be >= 0, got {v}")
    return v


def _progress(total: int, quiet: bool):
    """A tqdm bar on stderr counting engine runs (silent when stderr is not a TTY or with --quiet)."""
    from tqdm import tqdm
    bar = tqdm(total=total, desc="tune", unit="run", file=sys.stderr, dynamic_ncols=True,
               disable=quiet or not sys.stderr.isatty())
    state = {"start": None}

    def update(tuner, trial) -> None:
        if state["start"] is None:
            state["start"] = tuner.n_measured - (1 if trial.user_attrs.get("measured") else 0)
        done = min(total, tuner.n_measured - state["start"])
        if done > bar.n:
            bar.update(done - bar.n)
        pts = [(tg, pp) for _, tg, pp in tuner.samples]
        if pts:
            bar.set_postfix_str(f"best TG {max(p[0] for p in pts):.1f} t/s, PP {max(p[1] for p in pts):.0f} t/s",
                                refresh=False)
        bar.refresh()
    return bar, update


@dataclass(frozen=True)
class TuneInputs:
    """tune's options checked (before any storage or engine is touched): the service checks a tune request
    with the same function before it starts a worker."""
    inv: object
    hw: HardwareProfile
    objective: object
    workload: object
    margin: int | None
    study: str


def tune_inputs(args: TuneOptions) -> TuneInputs:
    from ..loader import load_model
    from ..tuner.objectives import parse_objective
    from ..tuner.search import slug
    from ..workload import Workload
    _positive(args.trials, "--trials")
    _nonneg(args.pool, "--pool")
    inv = load_model(args.model)
    hw = _hardware(args)
    objective = parse_objective(args.objective)
    if args.n_prompt == 0 and args.n_gen == 0:
        raise InputError("--n-prompt and --n-gen are both 0: nothing to measure")
    workload = Workload(n_prompt=_nonneg(args.n_prompt, "--n-prompt"), n_gen=_nonneg(args.n_gen, "--n-gen"),
                        depth=_nonneg(args.depth, "--depth"), repetitions=_positive(args.reps, "--reps"))
    margin = None if str(args.margin).strip().lower() == "auto" else parse_size(args.margin, allow_zero=True)
    _check_budget(hw, margin or 0)
    name = args.study or slug(f"{inv.name or inv.source}-{hw.name}-{args.engine}-{objective.kind}")
    return TuneInputs(inv, hw, objective, workload, margin, name)


def cmd_tune(args: TuneOptions) -> int:
    """`tune`, from options built at the edge (flags, a spec, or the demo's)."""
    from pathlib import Path
    from ..tuner.search import Tuner, default_storage
    from ..tuner.space import SpaceConfig
    from ..studyspec import storage_beside
    t = tune_inputs(args)
    inv, hw, objective, workload, margin, name = t.inv, t.hw, t.objective, t.workload, t.margin, t.study
    storage = args.storage or (storage_beside(args.spec, name) if args.spec else default_storage(name))
    out = Path(args.out) if args.out else Path("reports") / name
    if not args.no_report:                        # checked now, not after a study of minutes
        from ..tuner.storage import check_output_folder
        check_output_folder(out, "--out")
    engine = load_engine(args.engine_options(), hw)
    from ..tuner.search import STUDIES_DIR, make_storage, sqlite_path
    if sqlite_path(storage) is not None:          # one worker per SQLite file, before its schema is made
        from ..tuner.storage import check_sqlite_folder, lock_sqlite
        check_sqlite_folder(sqlite_path(storage), create=sqlite_path(storage).parent == STUDIES_DIR)
        lock_sqlite(sqlite_path(storage))
    make_storage(storage)                         # the driver, the folder, the database answer
    info = getattr(engine, "info", None)          # a llama.cpp binary knows its own dialect
    dialect = args.dialect or getattr(info, "dialect", None) or "mainline"
    check_dialect(inv, dialect)
    config = SpaceConfig(kv_types=args.kv_types)
    if (args.space or ("full" if engine.name == "sim" else "settled")) == "settled":
        config = config.settled(hw.host.n_threads, dialect)
    if dialect == "ik" and getattr(info, "tool", None) == "bench":
        config = replace(config, op_per_class=False)     # ik's llama-bench has no -op (docs/ik_llama.md)
    config = replace(config, **args.space_limits)        # a spec's limits win over the settled values
    rounds = args.confirm if args.confirm is not None else (0 if engine.name == "sim" else CONFIRM_ROUNDS)
    _nonneg(rounds, "--confirm")
    tuner = Tuner(inv, hw, engine, model=args.model, objective=objective, workload=workload, dialect=dialect,
                  n_ctx=_positive(args.ctx, "--ctx") if args.ctx is not None else None, margin=margin,
                  config=config, study_name=name, storage=storage, fresh=args.fresh,
                  seed=args.seed, pool_size=args.pool)
    print(f"# tune {inv.name or args.model} on {hw.name} ({', '.join(fmt_bytes(g.vram_bytes) for g in hw.gpus)}) "
          f"with the {engine.name} engine: study {name!r} in {storage}, objective {objective.text}, "
          f"{args.trials} runs", file=sys.stderr, flush=True)
    bar, update = _progress(args.trials, args.quiet)
    try:
        result = tuner.run(args.trials, progress=update)
        if rounds:
            bar.close()
            print(f"# confirming: the finalists and the reference re-measured interleaved, {rounds} rounds",
                  file=sys.stderr, flush=True)
            tuner.confirm(rounds)
    except KeyboardInterrupt:
        bar.close()
        n = len([t for t in tuner.study.get_trials(deepcopy=False) if t.state.is_finished()])
        print(f"offload-tuner: interrupted; {n} finished trials are saved in {storage}: run the same command to "
              "resume", file=sys.stderr)
        return 130
    finally:
        bar.close()
    from optuna.trial import TrialState
    if not tuner.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise BudgetError(f"no config fitted or ran in {', '.join(fmt_bytes(g.vram_bytes) for g in hw.gpus)} of VRAM "
                          f"minus the {fmt_bytes(tuner.margin)} margin ({result.trials} trials, none complete); give "
                          "more --gpu memory or a smaller --margin")
    summary = None if args.no_report else _write_report(tuner.study, out)
    if args.json:
        from ..tuner.report import study_summary
        s = summary or study_summary(tuner.study)
        s = dict(s, storage=storage, run={"measured": result.measured, "trials": result.trials,
                                          "engine_runs": s.get("engine_runs"),
                                          "elapsed_s": round(result.elapsed_s, 3), "stopped": result.stopped})
        _emit_json(s)
        return 0
    _print_tune(tuner, result, summary or __import__("planner.tuner.report", fromlist=["x"]).study_summary(tuner.study),
                storage, None if args.no_report else out)
    return 0


def _check_budget(hw: HardwareProfile, margin: int) -> None:
    """Nothing can fit when a GPU's VRAM minus the margin does not even hold the CUDA context."""
    for i, g in enumerate(hw.gpus):
        free = g.vram_bytes - margin
        if free <= g.overhead_bytes:
            raise BudgetError(f"nothing fits on CUDA{i}: {fmt_bytes(g.vram_bytes)} minus the "
                              f"{fmt_bytes(margin)} margin "
                              f"leaves {fmt_bytes(free)}, not even the CUDA context ({fmt_bytes(g.overhead_bytes)}); "
                              "give more --gpu memory or a smaller --margin")


def _write_report(study, out):
    from ..tuner.report import write_study_report
    try:
        return write_study_report(study, out)
    except OSError as e:
        raise InputError(f"cannot write the report to {out}: {e.strerror or e}") from e


def _print_tune(tuner, result, s: dict, storage: str, out) -> None:
    from ..tuner.cost_fit import CostFit
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s["counts"].items()))
    print(f"study {s['study']}: {result.measured} runs this session in {result.elapsed_s:.1f} s; "
          f"{s['n_trials']} trials in all ({counts}); storage {storage}")
    if result.stopped:
        print(f"note: {result.stopped}")
    fit = s.get("cost_fit") or {}
    if fit.get("err_prior"):
        print(f"cost model refit on {fit['n']} runs: mean error TG {fit['err_prior'].get('tg', 0):.1%} -> "
              f"{fit['err_fit'].get('tg', 0):.1%}, PP {fit['err_prior'].get('pp', 0):.1%} -> "
              f"{fit['err_fit'].get('pp', 0):.1%}"
              f"; terms moved: {CostFit.from_dict(fit).describe_moves()}")
    rows = []
    for b in s.get("baselines", []):
        m = b.get("measured") or {}
        rows.append([b["name"], f"{m.get('tg_tps', 0):.2f}" if b.get("ok") else "-",
                     f"{m.get('pp_tps', 0):.1f}" if b.get("ok") else "-",
                     fmt_bytes(sum((m.get("peak_bytes") or {}).values())) if b.get("ok") else (b.get("error") or "-")])
    picks = [("best " + k.upper() if k in ("tg", "pp") else f"best {s['settings'].get('objective')}", r)
             for k, r in s["best"].items() if r]
    for title, r in picks:
        rows.append([f"{title} (trial {r['trial']})", f"{r['tg_tps']:.2f}", f"{r['pp_tps']:.1f}",
                     fmt_bytes(r["vram_bytes"]) if r.get("vram_bytes") else "-"])
    from ..tuner.report import table
    print()
    print(table(["config", "TG t/s", "PP t/s", "peak VRAM"], rows))
    for title, r in picks:
        print()
        print(f"{title}: {r['label']}")
        for tool, cmd in r["commands"].items():
            print(f"  {tool}: {cmd}")
    if out is not None:
        print()
        print(f"report: {out}/summary.md (and summary.html, trials.csv, report.json, PNG and SVG plots)")


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on the embedded default: a whole study on the sim engine, its report and the best flags."""
    from pathlib import Path
    from ..tuner.search import default_storage, sqlite_path
    from ..studyspec import load_spec, storage_beside
    base = TuneOptions(**load_spec(args.spec)) if args.spec else DEMO
    opts = replace(base, fresh=True, quiet=args.quiet, trials=args.trials if args.trials is not None else base.trials,
                   pool=args.pool if args.pool is not None else base.pool)
    print(f"# offload-tuner demo: tune {opts.model} on {opts.gpu or 'the'} GPU ({opts.hardware}) with the "
          f"{opts.engine} engine, {opts.trials} runs, objective {opts.objective}", flush=True)
    storage = opts.storage or (storage_beside(opts.spec, opts.study) if opts.spec else default_storage(opts.study))
    db = sqlite_path(storage)
    for folder in ({db.parent} if db else set()) | {Path("reports")}:
        if folder.exists() and not folder.is_dir():
            raise InputError(f"demo writes into {folder}/, but {folder} here is a file; run it in another folder")
    for suffix in ("", "-wal", "-shm", "-journal") if db else ():    # a fresh study each run: repeated demos agree
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    rc = cmd_tune(opts)
    if rc == 0 and _cuda_available():
        print()
        print("# a CUDA GPU is here: the same study measured on the bundled PyTorch runtime:")
        print(f"offload-tuner tune {opts.model} --engine torch --gpu {opts.gpu} --objective {opts.objective} "
              f"--trials 40 --study {opts.study}-torch --n-prompt {opts.n_prompt} --n-gen {opts.n_gen}")
    return rc


def _cuda_available() -> bool:
    return engines.runtime("cuda_available")()   # torch lives in runtime/, imported only there


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path
    from ..tuner.report import study_summary
    from ..tuner.search import default_storage, load_study
    storage = args.storage or default_storage(args.study)
    out = Path(args.out) if args.out else Path("reports") / args.study
    from ..tuner.storage import check_output_folder
    check_output_folder(out, "--out")
    study = load_study(args.study, storage)
    s = _write_report(study, out)
    if args.json:
        _emit_json(dict(s, storage=storage))
        return 0
    del study_summary
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s["counts"].items()))
    print(f"study {args.study}: {s['n_trials']} trials ({counts})")
    for k, r in s["best"].items():
        if r:
            print(f"best {k}: TG {r['tg_tps']:.2f} t/s, PP {r['pp_tps']:.1f} t/s (trial {r['trial']}, {r['label']})")
            if r["commands"].get("llama-server"):
                print(f"  {r['commands']['llama-server']}")
    print(f"report: {out}/summary.md (and summary.html, trials.csv, report.json, PNG and SVG plots)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """The HTTP API and web view (planner/service): configuration is checked here, the serving is there."""
    import os
    from pathlib import Path
    from ..service.config import ENGINES, ServerConfig
    from ..service.security import check_bind
    token = args.token or os.environ.get("OFFLOAD_TUNER_TOKEN") or None
    check_bind(args.host, token)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port}: give 0-65535")
    names = tuple(dict.fromkeys(e.strip() for e in args.engine.split(",") if e.strip()))
    bad = [e for e in names if e not in ENGINES]
    if not names or bad:
        raise InputError(f"--engine {args.engine!r}: a comma list of {', '.join(ENGINES)}")
    dirs = tuple(Path(d) for d in args.models or ())
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise InputError(f"--models {missing[0]}: not a folder")
    if args.storage:
        from ..tuner.storage import resolve_url
        resolve_url(args.storage)
    config = ServerConfig(host=args.host, port=args.port, storage=args.storage, model_dirs=dirs, token=token,
                          engines=names, llama_bench=args.llama_bench,
                          max_tunes=_positive(args.max_tunes, "--max-tunes"),
                          max_trials=_positive(args.max_trials, "--max-trials"))
    from ..service.app import serve
    print(f"# offload-tuner serve: http://{args.host if ':' not in args.host else f'[{args.host}]'}:{args.port}/ "
          f"(API docs at /docs, /openapi.json); studies in {args.storage or str(config.studies_dir) + '/'}",
          file=sys.stderr, flush=True)
    serve(config)
    return 0


# ---- argparse -------------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):   # one line, exit 2 (argparse's default prints usage first)
        raise InputError(f"{self.prog}: {message}")


def _add_hw(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--gpu", help="GPU memory per GPU, e.g. 24GiB or 24GiB,16GiB (a generic desktop otherwise)")
    p.add_argument("--hardware", help="hardware preset name or calibrated JSON (offload-tuner calibrate)")


def _add_knobs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"context length (default {DEFAULT_CTX})")
    p.add_argument("--ubatch", type=int, help="-ub (default 512)")
    p.add_argument("--batch", type=int, help="-b (default 2048, at least --ubatch)")
    p.add_argument("--kv-type", choices=KV_TYPES, help="KV cache type for K and V (default f16)")
    p.add_argument("--threads", type=int, help="-t (default: the hardware's cores)")


def _add_build(p: argparse.ArgumentParser) -> None:
    p.add_argument("--build", metavar="DIALECT:N|PATH", help="the engine build the printed lines are for, as "
                   "`llama-server --version` numbers it (e.g. ik:4840, mainline:10114), or the path of the program "
                   "(its --help and --version are read); default: the pinned builds (ik 8337e4cd = 4840, mainline "
                   "as in llama-cpp-python 0.3.36)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="offload-tuner",
                 description="Find the fastest GPU+RAM placement for MoE GGUF models in llama.cpp")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("inspect", help="hparams, tensor groups, bytes per group and per layer")
    p.add_argument("model", help="path to a .gguf (first shard of a split) or preset:NAME[:QUANT]")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

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

    p = sub.add_parser("explain", help="what a llama.cpp command line does: placement, memory, speed, warnings")
    p.add_argument("model")
    p.add_argument("--dialect", choices=DIALECTS, default="mainline")
    _add_build(p)
    _add_hw(p, False)
    p.add_argument("--json", action="store_true")
    p.add_argument("--oracle", metavar="PATH", help="llama-fit-params binary: its memory estimate beside ours")
    p.epilog = "then -- and the llama.cpp arguments, e.g. explain MODEL -- -ngl 99 -cmoe"
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("run", help="measure one plan on an engine (llamacpp, sim, torch)")
    engines.runtime("add_run_arguments")(p)
    p.epilog = "the plan: --plan FILE, or -- and the llama.cpp arguments"
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("synth", help="write a synthetic GGUF that llama.cpp loads")
    engines.runtime("add_synth_arguments")(p)   # cli.py is where planner and runtime meet, by name
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("calibrate", help="measure this machine's bandwidths, FLOP/s, PCIe and overheads (--hardware)")
    engines.runtime("add_calibrate_arguments")(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("tune", help="search placements and knobs with Optuna for the best PP/TG within VRAM",
                       description="Start or resume an Optuna study. --spec studies/NAME.toml reads the study from a "
                       "file (docs in planner/studyspec.py); any flag given on the command line overrides the "
                       "spec's value for it.")
    # every default here is None (or False): TuneOptions holds the real ones, so a flag counts only when given
    p.add_argument("model", nargs="?", help="path to a .gguf or preset:NAME[:QUANT] (or the spec's model)")
    p.add_argument("--spec", metavar="FILE", help="study spec (TOML): starts or resumes that study, its database "
                   "beside the file (studies/NAME.db) unless --storage or the spec says otherwise; flags given "
                   "here override the spec's values")
    p.add_argument("--engine", choices=D.ENGINES, help="what measures a candidate: sim (the cost model), torch, "
                   f"llamacpp (default {D.TUNE_ENGINE})")
    _add_hw(p, True)
    p.add_argument("--trials", type=int, help=f"engine runs to add to the study (default {D.TUNE_TRIALS})")
    p.add_argument("--study", help="study name (default: the spec's file name, else from model, hardware, engine, "
                                   "objective); resumes it")
    p.add_argument("--storage", help="SQLAlchemy URL (default sqlite:///studies/STUDY.db, or STUDY.db beside the "
                                     "spec; postgresql://... for several workers)")
    p.add_argument("--objective", help="tg, pp, both (Pareto) or an expression such as 'tg + 0.1*pp' "
                                       f"(default {D.TUNE_OBJECTIVE})")
    p.add_argument("--n-prompt", type=int, help="prompt tokens of the workload "
                                                f"(default {D.TUNE_WORKLOAD.n_prompt})")
    p.add_argument("--n-gen", type=int, help=f"generated tokens of the workload (default {D.TUNE_WORKLOAD.n_gen})")
    p.add_argument("--depth", type=int, help=f"context depth before the workload (default {D.TUNE_WORKLOAD.depth})")
    p.add_argument("--reps", type=int, help=f"repetitions per measurement (default {D.TUNE_WORKLOAD.repetitions})")
    p.add_argument("--ctx", type=int, help=f"context the emitted commands reserve (default max({DEFAULT_CTX}, "
                                           "depth+prompt+gen))")
    p.add_argument("--dialect", choices=DIALECTS,
                   help="mainline or ik (default: the llama.cpp binary's, else mainline)")
    p.add_argument("--llama-bench", metavar="PATH", help="llamacpp engine: llama-bench or llama-sweep-bench (else "
                                                          "$LLAMA_BENCH, else llama-bench on PATH)")
    p.add_argument("--margin", help="VRAM kept free per GPU for the memory model's error: auto "
                   "(default: learnt from the runs, starting at the engine's known error) or a size, 0 allowed "
                   "(kept, raised only by an out-of-memory or a run over the budget)")
    p.add_argument("--cpu-stand-in", action="store_true", help="llamacpp: run every plan with all its tensors "
                   "on the CPU: a dry run of a GPU study's whole pipeline on a CPU-only build (its speeds and "
                   "peaks are not the GPU plans')")
    p.add_argument("--confirm", type=int, help="rounds of interleaved re-measurement of the finalists and --fit "
                   f"before the study reports (default {CONFIRM_ROUNDS}; 0 for the sim engine, which is exact)")
    p.add_argument("--space", choices=D.SPACE_MODES, help="settled: threads, flash attention, batch, "
                   "output layer, mmap and op offload fixed at what won on real engines, so runs go to placement, "
                   "ubatch and KV (default for llamacpp and torch); full: search every knob (default for sim)")
    p.add_argument("--kv-types", help="KV cache types the search may use (default "
                                      f"{','.join(D.TUNE_KV_TYPES)})")
    p.add_argument("--seed", type=int, help=f"sampler seed (default {D.TUNE_SEED})")
    p.add_argument("--pool", type=int, help=f"candidates the cost model pre-screens (default {D.TUNE_POOL})")
    p.add_argument("--timeout", type=float, help=f"seconds per measurement (llamacpp; default {D.RUN_TIMEOUT_S:.0f})")
    p.add_argument("--fresh", action="store_true", help="delete the study of that name first")
    p.add_argument("--out", help="report folder (default reports/STUDY)")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda args: cmd_tune(TuneOptions.from_args(args)))

    p = sub.add_parser("report", help="plots, Markdown/HTML summary, CSV and JSON of a study")
    p.add_argument("study")
    p.add_argument("--storage", help="SQLAlchemy URL (default sqlite:///studies/STUDY.db)")
    p.add_argument("--out", help="folder (default reports/STUDY)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("serve", help="HTTP API (the --json outputs) and a web view of studies")
    p.add_argument("--storage", help="SQLAlchemy URL of the studies (default: one sqlite:///studies/STUDY.db per "
                                     "study, as tune writes them)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; anything else needs "
                                                       "--token)")
    p.add_argument("--port", type=int, default=8787, help="port (default 8787)")
    p.add_argument("--token", help="secret every request must carry (Authorization: Bearer, or /?token= once in "
                                   "a browser); also $OFFLOAD_TUNER_TOKEN")
    p.add_argument("--models", action="append", metavar="DIR", help="folder whose .gguf files and hardware JSON "
                   "requests may name (repeatable; default none: presets only)")
    p.add_argument("--engine", default="sim", help="engines a tune request may use, comma list (default sim)")
    p.add_argument("--llama-bench", metavar="PATH", help="the llamacpp engine's llama-bench (else $LLAMA_BENCH, "
                                                          "else PATH)")
    p.add_argument("--max-tunes", type=int, default=1, help="tune workers at once (default 1)")
    p.add_argument("--max-trials", type=int, default=200, help="trials one tune request may ask for (default 200)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="the main job on the embedded default: a sim-engine study, its report, the best "
                                    "flags (no GPU or llama.cpp needed)")
    p.add_argument("--spec", metavar="FILE", help="the study to run as the demo (default: the built-in one, "
                                                  "which studies/demo.toml spells out)")
    p.add_argument("--trials", type=int, help=f"engine runs (default {DEMO.trials})")
    p.add_argument("--pool", type=int, help=f"candidates the cost model pre-screens (default {DEMO.pool})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # diagnostics from the modules (a fast path dropped for its fallback, ...) as one stderr line each
    logging.basicConfig(level=logging.WARNING, format="offload-tuner: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        # everything after the first "--" belongs to llama.cpp (explain), never to our own parser
        cut = argv.index("--") if "--" in argv else len(argv)
        args = build_parser().parse_args(argv[:cut])
        args.llama_args = argv[cut + 1:]
        return args.func(args) or 0
    except InputError as e:
        print(f"offload-tuner: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("offload-tuner: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
