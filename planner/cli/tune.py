"""`tune`: an Optuna study of placements and knobs (planner/tuner), from options built at the edge."""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .. import defaults as D
from ..engines import names as engine_names, traits_of
from ..errors import BudgetError, InputError
from ..hardware import HardwareProfile, fmt_bytes, parse_size
from ..options import TuneOptions
from ..plan import DEFAULT_CTX, DIALECTS
from ..tuner.confirm import CONFIRM_ROUNDS
from ..tuner.interrupt import SIGINT
from ..validate import check_dialect
from .common import _add_hw, _emit_json, _hardware, _nonneg, _positive, _write_report, load_engine

if TYPE_CHECKING:
    from ..tuner.report import StudySummary


def _progress(total: int, quiet: bool):
    """A tqdm bar on stderr counting engine runs (silent when stderr is not a TTY or with --quiet)."""
    from tqdm import tqdm
    bar = tqdm(total=total, desc="tune", unit="run", file=sys.stderr, dynamic_ncols=True,
               disable=quiet or not sys.stderr.isatty())
    state = {"start": None}

    def update(tuner, trial) -> None:
        if state["start"] is None:
            from ..tuner.records import TrialRecord
            state["start"] = tuner.n_measured - (1 if TrialRecord.from_trial(trial).measured is not None else 0)
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
    from ..bench_workload import BenchWorkload
    _positive(args.trials, "--trials")
    _nonneg(args.pool, "--pool")
    inv = load_model(args.model)
    hw = _hardware(args)
    objective = parse_objective(args.objective)
    if args.n_prompt == 0 and args.n_gen == 0:
        raise InputError("--n-prompt and --n-gen are both 0: nothing to measure")
    workload = BenchWorkload(n_prompt=_nonneg(args.n_prompt, "--n-prompt"), n_gen=_nonneg(args.n_gen, "--n-gen"),
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
    measured = traits_of(engine).measured       # the sim engine is the model: every choice is cheap, none to confirm
    if (args.space or ("settled" if measured else "full")) == "settled":
        config = config.settled(hw.host.n_threads, dialect)
    config = config.for_engine(engine, dialect)        # --no-host (and its probe run), ik bench's one -op switch
    config = replace(config, **args.space_limits)        # a spec's limits win over the settled values
    rounds = args.confirm if args.confirm is not None else (CONFIRM_ROUNDS if measured else 0)
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
        with SIGINT.guard():            # Ctrl-C stops at a safe point (planner/tuner/interrupt.py)
            result = tuner.run(args.trials, progress=update)
            if rounds:
                bar.close()
                print(f"# confirming: the finalists and the reference re-measured interleaved, {rounds} rounds",
                      file=sys.stderr, flush=True)
                tuner.confirm(rounds)
            SIGINT.check()
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
    from ..tuner.report import study_summary
    summary = None if args.no_report else _write_report(tuner.study, out)
    s = summary or study_summary(tuner.study)
    if args.json:
        runs = s.engine_runs.to_dict()
        _emit_json(dict(s.to_dict(), storage=storage,
                        run={"measured": result.measured, "trials": result.trials, "engine_runs": runs,
                             "elapsed_s": round(result.elapsed_s, 3), "stopped": result.stopped}))
        return 0
    _print_tune(tuner, result, s, storage, None if args.no_report else out)
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


def _print_tune(tuner, result, s: StudySummary, storage: str, out) -> None:
    """The text outcome of `tune`: runs, the refit, the baselines and the best configs."""
    from ..tuner.cost_fit import CostFit
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s.counts.items()))
    print(f"study {s.study}: {result.measured} runs this session in {result.elapsed_s:.1f} s; "
          f"{s.n_trials} trials in all ({counts}); storage {storage}")
    if result.stopped:
        print(f"note: {result.stopped}")
    fit = s.cost_fit or {}
    if fit.get("err_prior"):
        print(f"cost model refit on {fit['n']} runs: mean error TG {fit['err_prior'].get('tg', 0):.1%} -> "
              f"{fit['err_fit'].get('tg', 0):.1%}, PP {fit['err_prior'].get('pp', 0):.1%} -> "
              f"{fit['err_fit'].get('pp', 0):.1%}"
              f"; terms moved: {CostFit.from_dict(fit).describe_moves()}")
    rows = []
    for b in s.baselines:
        m = b.get("measured") or {}
        rows.append([b["name"], f"{m.get('tg_tps', 0):.2f}" if b.get("ok") else "-",
                     f"{m.get('pp_tps', 0):.1f}" if b.get("ok") else "-",
                     fmt_bytes(sum((m.get("peak_bytes") or {}).values())) if b.get("ok") else (b.get("error") or "-")])
    picks = [("best " + k.upper() if k in ("tg", "pp") else f"best {s.settings.get('objective')}", r)
             for k, r in s.best.items() if r]
    for title, r in picks:
        rows.append([f"{title} (trial {r['trial']})", f"{r['tg_tps']:.2f}", f"{r['pp_tps']:.1f}",
                     fmt_bytes(r["vram_bytes"]) if r.get("vram_bytes") else "-"])
    from ..tables import table
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


def add_parser(sub) -> None:
    """Registers `tune` and its options."""
    p = sub.add_parser("tune", help="search placements and knobs with Optuna for the best PP/TG within VRAM",
                       description="Start or resume an Optuna study. --spec studies/NAME.toml reads the study from a "
                       "file (docs in planner/studyspec.py); any flag given on the command line overrides the "
                       "spec's value for it.")
    # every default here is None (or False): TuneOptions holds the real ones, so a flag counts only when given
    p.add_argument("model", nargs="?", help="path to a .gguf or preset:NAME[:QUANT] (or the spec's model)")
    p.add_argument("--spec", metavar="FILE", help="study spec (TOML): starts or resumes that study, its database "
                   "beside the file (studies/NAME.db) unless --storage or the spec says otherwise; flags given "
                   "here override the spec's values")
    p.add_argument("--engine", choices=engine_names(), help="what measures a candidate: sim (the cost model), torch, "
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
