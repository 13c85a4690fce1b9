"""tune: start or resume an Optuna study of placements and knobs (tuner) from TuneRequest: the inputs
checked, the storage locked, the engine made, the space configured, the search run and confirmed, the report
written. The CLI's `tune`, the service's workers (which run the CLI) and the benchmarks call start_tune."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner import defaults as D, engine_registry
from planner.errors import BudgetError, InputError
from planner.hardware import HardwareProfile, fmt_bytes, kept_free_text, parse_size
from planner.model import ModelInventory
from planner.options import EngineOptions
from planner.plan import DEFAULT_CTX
from tuner.interrupt import SIGINT, signal_of
from tuner.records import StudyRecord
from planner.validate import check_dialect
from .common import hardware, nonneg, parse_seconds, positive
from .report import write_report
from .requests import TuneRequest

if TYPE_CHECKING:
    from planner.bench_run import BenchRun
    from tuner.objectives import Objective
    from tuner.report import StudySummary
    from tuner.search import TuneResult
    from planner.workload import Workload


@dataclass(frozen=True)
class TuneInputs:
    """tune's options checked (before any storage or engine is touched): the service checks a tune request
    with the same function before it starts a worker."""
    inv: ModelInventory
    hw: HardwareProfile
    objective: Objective
    bench: BenchRun
    margin: int | None
    study: str
    requests: Workload | None = None     # the user's workload, under the time objective

    @property
    def n_ctx(self) -> int | None:
        """The context the emitted commands hold when --ctx is not given: under the time objective the workload's
        (its slots x its longest request, in whole 256-token steps, at least DEFAULT_CTX); else the Tuner's."""
        if self.requests is None:
            return None
        return max(DEFAULT_CTX, -(-self.requests.ctx // 256) * 256)


def tune_inputs(args: TuneRequest) -> TuneInputs:
    from planner.loader import load_model
    from tuner.objectives import parse_objective
    from tuner.search import slug
    from planner.bench_run import BenchRun
    from tuner.objectives import bench_for
    from planner.workload import load as load_workload
    positive(args.trials, "--trials")
    if args.time_limit is not None:
        parse_seconds(args.time_limit, "--time-limit")
    nonneg(args.pool, "--pool")
    inv = load_model(args.model)
    hw = hardware(args.hardware, args.gpu, keep_free=args.keep_free, ram=args.ram)
    objective = parse_objective(args.objective)
    if args.llama_server and objective.kind != "time":       # said now, not after a study of minutes
        raise InputError("--llama-server serves the workload: it needs the time objective (--objective time)")
    if args.ttft is not None and objective.kind != "time":
        raise InputError("--ttft limits the workload's requests: it needs the time objective (--objective time)")
    requests = (load_workload(args.workload, Path(args.spec).parent if args.spec else None)
                if objective.kind == "time" else None)
    if requests is not None and args.ttft is not None:
        requests = replace(requests, ttft_limit_s=parse_seconds(args.ttft, "--ttft"))
    base = bench_for(requests, positive(args.reps, "--reps")) if requests is not None else D.TUNE_WORKLOAD

    def pick(v: int | None, default: int, flag: str) -> int:
        return default if v is None else nonneg(v, flag)
    n_prompt, n_gen = pick(args.n_prompt, base.n_prompt, "--n-prompt"), pick(args.n_gen, base.n_gen, "--n-gen")
    if n_prompt == 0 and n_gen == 0:
        raise InputError("--n-prompt and --n-gen are both 0: nothing to measure")
    bench = BenchRun(n_prompt=n_prompt, n_gen=n_gen, depth=pick(args.depth, base.depth, "--depth"),
                             repetitions=positive(args.reps, "--reps"))
    margin = None if str(args.margin).strip().lower() == "auto" else parse_size(args.margin, allow_zero=True)
    _check_budget(hw, margin or 0)
    name = args.study or slug(f"{inv.name or inv.source}-{hw.name}-{args.engine}-{objective.kind}")
    return TuneInputs(inv, hw, objective, bench, margin, name, requests)


def _check_budget(hw: HardwareProfile, margin: int) -> None:
    """Nothing can fit when a GPU's memory minus what is kept free and the margin does not even hold the CUDA
    context."""
    for i, g in enumerate(hw.gpus):
        free = g.vram_bytes - hw.keep_free_bytes - margin
        if free <= g.overhead_bytes:
            raise BudgetError(f"nothing fits on CUDA{i}: {fmt_bytes(g.vram_bytes)} minus "
                              f"{fmt_bytes(hw.keep_free_bytes)} kept free and the {fmt_bytes(margin)} margin "
                              f"leaves {fmt_bytes(free)}, not even the CUDA context ({fmt_bytes(g.overhead_bytes)}); "
                              "give more --gpu memory, a smaller --keep-free or a smaller --margin")


def load_engine(opts: EngineOptions, hw: HardwareProfile):
    """The Engine `opts` names, made through planner.engine_registry' registry (one line and exit 2 for an engine this
    install or machine cannot run)."""
    return engine_registry.make_engine(opts, hw)


def _serve(args: TuneRequest, tuner: Any, hw: HardwareProfile, note: Callable[[str], None],
           deadline: float | None = None) -> bool:
    """The finalists and llama-server's own --fit served on the workload (tuner/served.py), a line per server run;
    False when `deadline` came first (the rows so far are stored: the same command goes on from them)."""
    from tuner.served import (
        SERVED_ROUNDS, THRIFT, confirm_served, headline, partial_record, served_budget, study_threads,
    )
    server = engine_registry.make_engine(replace(args.engine_options(), engine="llamaserver"), hw)
    threads = study_threads(tuner.measurer)
    note(f"# serving: the finalists and --fit at -ub 512/2048/4096 on llama-server, up to {SERVED_ROUNDS} rounds "
         "(a contender behind after a round is not served again)"
         + (f", every one at -t {threads} (the best finalist's)" if threads else ""))
    rec = confirm_served(tuner.measurer, server, SERVED_ROUNDS, threads=threads, deadline=deadline, say=note,
                         thrift=THRIFT)
    if rec:
        note(f"# {headline(rec)}")
        return True
    partial = partial_record(StudyRecord.of(tuner.study), served_budget(hw))
    note("# the --time-limit came before the serving's end: " + (f"so far: {headline(partial)}" if partial
                                                                 else "no server run finished yet"))
    return False


def _thread_probe(args: TuneRequest, engine: Any, inv: Any, hw: HardwareProfile, dialect: str, storage: str,
                  name: str, note: Callable[[str], None]) -> Any:
    """The ThreadProbe a llama-bench study settles its -t by (tuner/setup.py asks): the one stored with the study,
    else a new one (tuner/threads.py) on the planner's first placement; None when nothing fits."""
    from tuner.threads import probe_threads
    if not args.fresh:
        stored = _stored_record(storage, name)
        if stored is not None and stored.threads_probe is not None:
            return stored.threads_probe
    from planner.propose import propose
    try:
        plan = propose(inv, hw, dialect=dialect, margin=engine_registry.traits_of(engine).memory_error_prior)[0]
    except (InputError, IndexError):
        return None                          # nothing fits: the study says so itself
    note("# threads: a short generation at llama.cpp's default -t, at half and three quarters of the cores")
    with SIGINT.engine_run():
        probe = probe_threads(engine.measure, inv, plan, say=note)
    note(f"# {probe.line()}")
    return probe


def _stored_record(storage: str, name: str) -> Any:
    """The StudyRecord of study NAME in STORAGE, or None when there is no such study yet."""
    import optuna

    from tuner.storage import make_storage
    try:
        return StudyRecord.of(optuna.load_study(study_name=name, storage=make_storage(storage)))
    except KeyError:
        return None


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT: how the service stops a worker), SIGTERM or SIGHUP stopped the study at a safe point; every
    finished trial is saved and the same options resume it. `signum`: the signal that came."""

    def __init__(self, finished: int, storage: str, signum: int = 2):
        super().__init__(f"{finished} finished trials are saved in {storage}")
        self.finished, self.storage, self.signum = finished, storage, signum


@dataclass(frozen=True)
class TuneOutcome:
    """A tune session's result: the study's summary (the report's, when one was written), this session's run,
    where the study lives and where its report went (None with no_report)."""
    summary: StudySummary
    run: TuneResult
    storage: str
    out: Path | None

    def to_json(self) -> dict[str, Any]:
        r = self.run
        return dict(self.summary.to_dict(), storage=self.storage,
                    run={"measured": r.measured, "trials": r.trials, "engine_runs": self.summary.engine_runs.to_dict(),
                         "elapsed_s": round(r.elapsed_s, 3), "stopped": r.stopped})


def _quiet(line: str) -> None:
    pass


def start_tune(args: TuneRequest, note: Callable[[str], None] = _quiet,
               progress: Callable[[Any, Any], None] | None = None) -> TuneOutcome:
    """Start or resume the study ARGS describe and run ARGS.trials more engine runs, then the confirmation rounds
    and the report. `note` gets a line as the study starts and as the confirmation starts (the CLI writes them to
    stderr); `progress(tuner, trial)` is called after each trial (the CLI's progress bar). InputError for bad
    options (before any storage or engine is touched where it can be told then), BudgetError when no config
    fitted, TuneInterrupted on SIGINT (every finished trial saved), StorageError when the storage fails (a damaged
    file, a full disk, a server gone: every finished trial saved)."""
    from tuner.storage import default_storage
    from offload_tuner.app.studyspec import storage_beside
    t = tune_inputs(args)
    hw, name = t.hw, t.study
    storage = args.storage or (storage_beside(args.spec, name) if args.spec else default_storage(name))
    out = Path(args.out) if args.out else Path("reports") / name
    if not args.no_report:                        # checked now, not after a study of minutes
        from tuner.storage import check_output_folder
        check_output_folder(out, "--out")
    engine = load_engine(args.engine_options(), hw)
    from tuner.storage import STUDIES_DIR, make_storage, sqlite_path, storage_errors
    if sqlite_path(storage) is not None:          # one worker per SQLite file, before its schema is made
        from tuner.storage import check_sqlite_folder, lock_sqlite
        check_sqlite_folder(sqlite_path(storage), create=sqlite_path(storage).parent == STUDIES_DIR)
        lock_sqlite(sqlite_path(storage))
    make_storage(storage)                         # the driver, the folder, the database answer
    with storage_errors(storage):                 # a full disk, a server gone: one line naming the storage
        return _run_study(args, t, engine, storage, out, note, progress)


def _run_study(args: TuneRequest, t: TuneInputs, engine: Any, storage: str, out: Path,
               note: Callable[[str], None], progress: Callable[[Any, Any], None] | None) -> TuneOutcome:
    """start_tune's study once its storage is open: the space, the search, the confirmation and the report."""
    from tuner.search import Tuner, StudyConfig
    from tuner.setup import study_setup
    inv, hw, objective, bench, margin, name = t.inv, t.hw, t.objective, t.bench, t.margin, t.study
    dialect = args.dialect or engine.dialect or "mainline"     # a llama.cpp binary knows its own dialect
    check_dialect(inv, dialect)
    limit = parse_seconds(args.time_limit, "--time-limit") if args.time_limit else None
    start = time.monotonic()
    tuner = None
    try:
        # Ctrl-C, SIGTERM, SIGHUP stop at a safe point (tuner/interrupt.py); in an engine run, the --fit
        # reference's too, at once. The study's opening writes are under the guard as well
        with SIGINT.guard():
            # threads settle at llama.cpp's own default (no -t), what the user runs, unless the probe finds a
            # count at least 10% faster there (a 64-vCPU VM's default generated 20x slower than half of it)
            setup = study_setup(engine, dialect, space=args.space, kv_types=args.kv_types, limits=args.space_limits,
                                probe=lambda: _thread_probe(args, engine, inv, hw, dialect, storage, name, note),
                                confirm=args.confirm, serving=bool(args.llama_server))
            tuner = Tuner(inv, hw, engine, StudyConfig(
                model=args.model, objective=objective, bench=bench, dialect=dialect,
                n_ctx=positive(args.ctx, "--ctx") if args.ctx is not None else t.n_ctx, margin=margin,
                config=setup.config, study_name=name, storage=storage, fresh=args.fresh, seed=args.seed,
                pool_size=args.pool, requests=t.requests))
            note(f"# tune {inv.name or args.model} on {hw.name} ({', '.join(fmt_bytes(g.vram_bytes) for g in hw.gpus)}"
                 f", {kept_free_text(hw.keep_free_bytes)}) with the {engine.name} engine: study {name!r} in "
                 f"{storage}, objective {objective.text}, {args.trials} runs")
            if setup.probe is not None:
                StudyRecord.save(tuner.study, threads_probe=setup.probe)
            result = _search_and_serve(args, tuner, setup.rounds, limit, start, note, progress)
            SIGINT.check()
    except KeyboardInterrupt as e:
        n = 0 if tuner is None else len([t for t in tuner.study.get_trials(deepcopy=False) if t.state.is_finished()])
        raise TuneInterrupted(n, storage, signal_of(e)) from e
    check_some_ran(args, tuner, result, limit, start, storage, note)
    from tuner.report import study_summary
    summary = None if args.no_report else write_report(tuner.study, out)
    return TuneOutcome(summary or study_summary(tuner.study), result, storage, None if args.no_report else out)


def _search_and_serve(args: TuneRequest, tuner: Any, rounds: int, limit: float | None, start: float,
                      note: Callable[[str], None], progress: Callable[[Any, Any], None] | None) -> Any:
    """The search (and llama-bench's confirmation), then the serving where --llama-server asks for it; a study
    whose search ended and whose serving did not goes on at the serving (nothing explored again). With a
    --time-limit the search takes its first half when a serving follows, else all of it. The TuneResult."""
    from tuner.search import TuneResult
    record = StudyRecord.of(tuner.study)
    if args.llama_server and record.explored and record.served is None:
        note("# the search of this study is done: going on with its serving")
        result = TuneResult(tuner.study_name, tuner.storage_url, 0, 0, 0.0, tuner.margin, tuner.fit,
                            "the search was done: serving only")
    else:
        share = 0.5 if args.llama_server else 1.0
        result = tuner.run(args.trials, progress=progress, deadline=None if limit is None else start + share * limit)
        if rounds:
            note(f"# confirming: the finalists and the reference re-measured interleaved, {rounds} rounds")
            tuner.confirm(rounds)
        StudyRecord.save(tuner.study, explored=True)
    if args.llama_server and not _serve(args, tuner, tuner.hw, note, None if limit is None else start + limit):
        note(f"# partial: run the same command to go on ({tuner.storage_url}, study {tuner.study_name!r})")
    return result


def check_some_ran(args: TuneRequest, tuner: Any, result: Any, limit: float | None, start: float,
                   storage: str, note: Callable[[str], None] = _quiet) -> None:
    """A study with no complete trial ends with its real cause: every run crashed, the --time-limit came first,
    or nothing fitted the memory. Where the serving still compared --fit's variants on llama-server (no finalist
    to serve), that verdict is the answer: the cause is said as a line (`note`) and the tune ends well."""
    from optuna.trial import TrialState

    from tuner.failures import check_some_run_worked
    check_some_run_worked(tuner.study, storage)      # every run crashed: said so, not "give more memory"
    if tuner.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return
    hw = tuner.hw
    cause: InputError = (
        InputError(f"--time-limit {args.time_limit} came before any run finished ({result.trials} trials "
                   f"started); give a longer one: the same command goes on from what ran ({storage})")
        if limit is not None and time.monotonic() - start >= limit * (0.5 if args.llama_server else 1.0)
        else BudgetError(f"no config fitted or ran in {', '.join(fmt_bytes(g.vram_bytes) for g in hw.gpus)} of "
                         f"VRAM minus {fmt_bytes(hw.keep_free_bytes)} kept free and the {fmt_bytes(tuner.margin)} "
                         f"margin ({result.trials} trials, none complete); give more --gpu memory, a smaller "
                         "--keep-free or a smaller --margin"))
    if args.llama_server and StudyRecord.of(tuner.study).served:
        note(f"# only --fit's variants were served: {cause}")
        return
    raise cause
