"""The autotuner: an Optuna study over tuner.space, measured on any Engine, screened by the memory model.

One trial = one candidate of the space decoded into a Plan. Before anything runs:
- the memory model judges it against every GPU's budget (VRAM minus the study's margin) and host RAM; one over
  budget is never executed: the trial is PRUNED with the reason in its user attrs;
- a plan already measured in this study is not measured again (the trial gets the same values);
- when measuring is expensive (any engine but sim) a candidate the refitted cost model predicts to be well
  below the best measured so far is PRUNED as "screened" and costs no run.
A measured failure (out of memory, crash, time limit) is a FAIL trial with the error in its user attrs and the
study goes on; an out-of-memory raises the study's margin for every later trial (user attr `margin_bytes`). So
does a run whose measured peak on a GPU exceeds that GPU's budget (VRAM minus the margin the study was asked for):
it is a FAIL trial too ("measured peak X GiB on CUDA0 over the budget Y GiB", the measurement kept in its user
attrs), since a GPU with more VRAM than the budget (an 80 GB card tuned for 24 GiB) does not run out of memory
where the memory model is wrong.

Search efficiency: the study starts with the planner's proposals (propose.best_plans) and the cost model's
predicted Pareto front over a pool of candidates, enqueued as trials; after every measurement the cost model's
coefficients are refitted (tuner.cost_fit) and, every other trial, the pool's best unmeasured candidate under
the refitted model is enqueued ("surrogate"); the sampler (TPE) proposes the rest.

Budgets mean what users mean: `--gpu 16GiB` is the peak VRAM the emitted command may use at the emitted
context (`--ctx`). A run measures at the engine's own context (llama-bench: n_prompt + depth), so the memory
model's difference between the two contexts is added to each measured peak before it is judged. The margin is
the memory model's own error, learnt from the runs per ubatch (`margin=None`, the default: an ubatch not yet run is
held to the engine's known error, a measured one to the largest under-prediction seen at it plus MARGIN_SLACK);
a fixed margin is kept as given.

Baselines (tuner.baselines): the engine's own `--fit` where it has one, `-ngl 99 -cmoe` and the best
`-ncmoe N`. Confirmation (tuner.confirm, `Tuner.confirm`): the finalists and `--fit` re-measured interleaved,
judged by the median and its spread. The margin is tuner.margin's, the candidate pool and its Pareto
helpers tuner.pool's; the study-level attrs are read and written through records.StudyRecord.

Storage is Optuna's RDBStorage (SQLite under studies/ by default, any SQLAlchemy URL): every finished trial is
committed when it ends, so Ctrl-C or kill -9 loses none; a heartbeat lets a resumed study fail (and retry once)
trials a killed worker left RUNNING. Each trial stores its plan JSON, plan id, rendered commands, predicted and
measured PP/TG and peak bytes per device (user attrs), so reports need neither the model file nor the engine.
"""
from __future__ import annotations

import math
import random
import re
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from planner.bench_run import BenchRun
from planner.engine_contract import Engine, memory_model
from planner.engine_registry import traits_of
from planner.errors import BudgetError, InputError, OffloadTunerError
from planner.hardware import HardwareProfile
from planner.host import ram_floor_error
from planner.model import ModelInventory
from planner.plan import Plan
from . import baselines as _baselines, confirm as _confirm, seeds as _seeds
from .confirm import CONFIRM_ROUNDS, Contender
from .cost_fit import CostFit, Terms
from .failures import OOM
from .interrupt import SIGINT
from .margin import Margins
from .measurer import Measurer, contexts
from .objectives import parse_objective
from .options import LATER_SPACE_OPTIONS, Settings, StudyConfig, hardware_key
from .pool import Pool, Scorer
from .records import CandidateInfo, MeasuredRun, RecordWriter, StudyRecord, TrialRecord
from .space import Space, SpaceConfig
from .storage import make_storage, sqlite_path, study_exists

PATIENCE = 60              # trials in a row without a run before a session stops as converged


class MeasurementFailed(OffloadTunerError):
    """A run that failed for a reason of the run (OOM, crash, time limit): the trial is FAIL, the study goes on."""


class NotBeforeDeadline(OffloadTunerError):
    """A run not started because it would end past run()'s deadline: the trial is FAIL, its plan queued again."""


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "study"


# ---- the tuner ------------------------------------------------------------------------------------------------

@dataclass
class TuneResult:
    study_name: str
    storage: str | None
    measured: int                  # engine runs this session
    trials: int                    # trials this session (incl. pruned, duplicates)
    elapsed_s: float
    margin_bytes: int
    fit: CostFit
    stopped: str = ""              # why the loop ended early, if it did
    counts: dict[str, int] = field(default_factory=dict)


class Tuner:
    """One study: `Tuner(inv, hw, engine, StudyConfig(...)).run(n)` measures n more candidates (screened and
    duplicate trials do not count).

    `engine` a planner.engine_contract.Engine; `hw` the machine as the memory model and the cost model see it (the cost
    model's prior; for sim it is the engine's own). The study's Measurer (`measurer`, tuner.measurer) measures and
    records every run; the search here, the baselines, the seeds, the confirmation and the serving all take it."""

    def __init__(self, inv: ModelInventory, hw: HardwareProfile, engine: Engine,
                 options: StudyConfig = StudyConfig()) -> None:
        import optuna
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        o = self.options = options
        self.inv, self.hw, self.engine = inv, hw, engine
        # the memory model that judges this engine's plans: its own prediction where it has one (the torch engine),
        # else planner.memory's (llama.cpp's memory; the sim engine's own)
        self.estimate = memory_model(engine, o.bench)
        self.objective = parse_objective(o.objective) if isinstance(o.objective, str) else o.objective
        self.bench, self.dialect = o.bench, o.dialect
        if self.objective.kind == "time" and o.requests is None:
            raise InputError("objective time needs the workload's request classes: say --workload (chat, agent, rag, "
                             "batch, or a file)")
        self.requests = o.requests if self.objective.kind == "time" else None
        self.n_ctx, self.run_ctx = contexts(o.bench, o.n_ctx, engine)
        self.config, self.seed, self.rng = o.config, o.seed, random.Random(o.seed)
        traits = traits_of(engine)
        self.prescreen = traits.measured if o.prescreen is None else o.prescreen
        self.surrogate, self.seed_trials = o.surrogate, o.seed_trials
        self.pool_size, self.want_baselines, self.want_commands = o.pool_size, o.baselines, o.commands
        self.study_name, self.storage_url = o.study_name, o.storage
        if o.margin is not None and o.margin < 0:
            raise InputError(f"--margin must be >= 0, got {o.margin}")
        if (short := ram_floor_error(inv, hw)) is not None:    # every config would be refused: one line, no study
            raise BudgetError(short)
        prior = o.margin if o.margin is not None else traits.memory_error_prior
        self.settings = Settings(model=o.model or inv.source or inv.name, model_id=inv.source or inv.name,
                                 engine=engine.name, hardware=hardware_key(hw),
                                 dialect=o.dialect, objective=self.objective.text, bench=o.bench,
                                 n_ctx=self.n_ctx, space=o.config.to_dict(),
                                 requests=self.requests.to_dict() if self.requests is not None else None)
        self.study = self._open(o.fresh, o.sampler, prior)
        self.margins = Margins(self.study, hw, o.margin, prior)
        self.max_seeds: int | None = None      # run() caps the seed trials of an expensive engine
        # o.space: a prepared one, taken when it is this study's (self.config: _open may have kept a resumed
        # study's space, LATER_SPACE_OPTIONS)
        self.measurer = m = Measurer(inv, hw, engine, self.study, self.settings, self.margins, self.config,
                                     bench=o.bench, estimate=self.estimate, n_ctx=self.n_ctx,
                                     run_ctx=self.run_ctx, objective=self.objective, requests=self.requests,
                                     commands=o.commands, space=o.space)
        if self.requests is not None:
            self.objective = m.objective = self.objective.with_request(m.request_time())
        self.scorer = Scorer(self.objective, self.bench)
        self.pool = Pool(m.terms, self.rng)
        self.n_measured = 0
        self.n_trials_session = 0
        self.idle = 0                 # trials in a row that ran nothing (screened, duplicate, over budget)
        self._deadline: float | None = None     # run()'s, for the trial about to measure
        self._deadline_stop = ""

    # ---- what the Measurer holds, read by the study's users ------------------------------------------------------

    @property
    def margin(self) -> int:
        """The margin of an ubatch without runs (learnt), or the fixed one."""
        return self.margins.default

    @property
    def ubatch_margins(self) -> dict[int, int]:
        return self.margins.by_ubatch

    @property
    def margin_initial(self) -> int:
        return self.margins.initial

    @property
    def space(self) -> Space:
        return self.measurer.space

    @property
    def fit(self) -> CostFit:
        return self.measurer.fit

    @property
    def samples(self) -> list[tuple[Terms, float, float]]:
        return self.measurer.samples

    @property
    def measured(self) -> dict[str, tuple[int, tuple[float, ...] | None]]:
        return self.measurer.measured

    # ---- study ----------------------------------------------------------------------------------------------

    def _sampler(self, kind: str):
        import optuna
        if kind == "random":
            return optuna.samplers.RandomSampler(seed=self.seed)
        if kind != "tpe":
            raise InputError(f"unknown sampler {kind!r}; expected tpe or random")
        return optuna.samplers.TPESampler(seed=self.seed, multivariate=True, group=True, n_startup_trials=10,
                                          constant_liar=True)

    def _open(self, fresh: bool, sampler: str, margin_prior: int):
        import optuna
        storage = make_storage(self.storage_url)
        path = sqlite_path(self.storage_url) if self.storage_url else None
        if path is not None:
            from .storage import lock_sqlite
            lock_sqlite(path)          # one worker per SQLite file; several share PostgreSQL
        if study_exists(storage, self.study_name):
            if fresh:
                optuna.delete_study(study_name=self.study_name, storage=storage)
            else:
                study = optuna.load_study(study_name=self.study_name, storage=storage, sampler=self._sampler(sampler))
                old = StudyRecord.of(study).settings
                if old:
                    self._keep_old_space(old)
                diff = self.settings.differences(old) if old else []   # none yet: another worker is creating it
                if diff:
                    # the objective's default changed (tg, then time): name the stored one, the usual cause
                    was = f" (it was made with --objective {old.objective})" if "objective" in diff else ""
                    raise InputError(f"study {self.study_name!r} in {self.storage_url} was made with other "
                                     f"{', '.join(diff)}{was}; pick another --study name, or --fresh to start it "
                                     "over")
                return study
        study = optuna.create_study(study_name=self.study_name, storage=storage, sampler=self._sampler(sampler),
                                    directions=self.objective.directions, load_if_exists=True)   # race-free
        StudyRecord.create(study, settings=self.settings, objective_names=list(self.objective.names))
        with warnings.catch_warnings():      # experimental in Optuna; optuna-dashboard titles its plots with them
            warnings.simplefilter("ignore")
            study.set_metric_names(list(self.objective.names))
        StudyRecord.save(study, margin_bytes=margin_prior,
                         margin_rule="learnt" if self.options.margin is None else "fixed",
                         created=time.strftime("%Y-%m-%d %H:%M:%S"))
        return study

    def _keep_old_space(self, old: Settings) -> None:
        """A study stored before a widening space option existed (LATER_SPACE_OPTIONS) ran without it: it resumes
        with that option's default, the space it was made with, instead of being refused as another study."""
        stored = old.space
        if "space" in old.absent:
            return
        missing = {f: getattr(SpaceConfig(), f) for f in LATER_SPACE_OPTIONS if f not in stored}
        if missing:
            self.config = replace(self.config, **missing)
            self.settings = replace(self.settings, space=self.config.to_dict())

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.study.get_trials(deepcopy=False):
            out[t.state.name.lower()] = out.get(t.state.name.lower(), 0) + 1
        return out

    # ---- seeding and baselines ------------------------------------------------------------------------------

    def enqueue_seeds(self) -> int:
        """Enqueue the planner's proposals and the cost model's predicted front (once per study;
        tuner.seeds.enqueue_seeds)."""
        return _seeds.enqueue_seeds(self.measurer, self.pool, self.scorer, self.max_seeds)

    def probe_repack(self) -> bool:
        """Once per study, the best-TG run again with a repacking knob on (tuner.seeds.probe_repack)."""
        return _seeds.probe_repack(self.measurer, self.pool)

    def baselines(self, deadline: float | None = None) -> list[dict[str, Any]]:
        """Measure the reference points once per study (tuner.baselines.measure_baselines; until
        `deadline`)."""
        if not self.want_baselines:
            return StudyRecord.of(self.study).baselines or []
        return _baselines.measure_baselines(self.measurer, deadline)

    # Optuna's objective: one piece because each early exit (over budget, duplicate, screened, failed) stores
    # why on the trial as it goes, in the order a reader of the trial sees them
    def objective_fn(self, trial) -> float | tuple[float, ...]:
        import optuna
        m = self.measurer
        self.n_trials_session += 1
        rec = RecordWriter(trial)       # an enqueued trial's record holds its source; the sampler's says "sampler"
        source = rec.update().source
        cand = m.space.decode(lambda dim: dim.suggest(trial))
        self.pool.add(cand)
        plan = cand.plan
        pooled = self.pool.get(plan.id)
        info = (m.describe(plan, pooled.terms if pooled else None, cand.memory) if cand.memory is not None
                else {"plan_id": plan.id, "label": plan.label})
        rec.update(plan_id=plan.id, plan_json=plan.to_json(), candidate=CandidateInfo.from_dict(info))
        if not cand.fits:
            rec.update(pruned_reason=f"over budget: {cand.reason}")
            raise optuna.TrialPruned(f"over budget: {cand.reason}")
        prev = m.measured.get(plan.id)
        if prev is not None:
            rec.update(duplicate_of=prev[0])
            if prev[1] is None:
                rec.update(pruned_reason=f"same plan as failed trial {prev[0]}")
                raise optuna.TrialPruned(f"same plan as failed trial {prev[0]}")
            return prev[1] if self.objective.n_values > 1 else prev[1][0]
        pred = info["predicted"]
        if self.prescreen and source == "sampler":
            ok, why = self.scorer.promising(pred["tg_tps"], pred["pp_tps"], m.measured_points())
            if not ok:
                rec.update(pruned_reason=why)
                raise optuna.TrialPruned(why)
        reused = m.baseline_runs.get(plan.id)
        if reused is not None:        # a baseline already ran this plan: its run is this trial's
            run = reused
            rec.update(reused_baseline_run=True)
        else:
            self._start_before_deadline(trial, plan, source, pred)
            run = m.judge_peak(plan, m.measure(plan))   # a baseline's run was judged when it ran
            self.n_measured += 1
        self.idle = -1                # the callback adds one per trial
        m.queued.discard(plan.id)
        rec.update(measured=MeasuredRun.from_measurement(run))
        if not run.ok:
            m.measured[plan.id] = (trial.number, None)
            if reused is None and OOM.search(run.error or ""):
                m.raise_margin(plan, run.error)
            raise MeasurementFailed(run.error or "the engine reported a failure without a message")
        terms = info["terms"]
        rec.update(terms=terms)
        values = self.objective.values(run.tg_tps if self.bench.n_gen else 0.0,
                                       run.pp_tps if self.bench.n_prompt else 0.0)
        if any(not math.isfinite(v) for v in values):
            m.measured[plan.id] = (trial.number, None)
            raise MeasurementFailed(f"objective {self.objective.text!r} is undefined at TG {run.tg_tps:.3g}, "
                                    f"PP {run.pp_tps:.3g}")
        improved = self.scorer.improves(run.tg_tps, run.pp_tps, m.measured_points())
        m.measured[plan.id] = (trial.number, values)
        if reused is None:            # the baseline's run is in the samples already
            m.samples.append((terms, run.tg_tps, run.pp_tps))
        m.refit()
        if improved and self.surrogate:
            self.pool.add_neighbours(m.space, cand.params, 40 if self.prescreen else 12)
        return values if self.objective.n_values > 1 else values[0]

    def run_seconds(self, tg_tps: float, pp_tps: float) -> float:
        """How long one run at these speeds takes, x1.2: its tokens (BenchRun.token_seconds) plus what the
        study's runs took beyond theirs (loading; the median of the timed runs, 0 before the first). Runs of one
        study differ fivefold (a --no-host run at depth 8192 took 143 s where --fit took 15 s), so a mean of past
        runs does not say whether the next one ends before a deadline."""
        from optuna.trial import TrialState
        rest = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            m = TrialRecord.from_trial(t).measured
            if m is not None and m.ok and m.seconds:
                rest.append(m.seconds - self.bench.token_seconds(m.pp_tps, m.tg_tps))
        rest += [float(b["measured"]["seconds"]) - self.bench.token_seconds(
                     float(b["measured"].get("pp_tps") or 0), float(b["measured"].get("tg_tps") or 0))
                 for b in StudyRecord.of(self.study).baselines or []
                 if (b.get("measured") or {}).get("seconds") and b["measured"].get("ok", True)]
        fixed = max(0.0, statistics.median(rest)) if rest else 0.0
        return 1.2 * (fixed + self.bench.token_seconds(pp_tps, tg_tps))

    def _start_before_deadline(self, trial, plan: Plan, source: str, pred: dict[str, float]) -> None:
        """Raise NotBeforeDeadline (and stop the study) when this run, at its predicted speeds, would end past
        run()'s deadline: a device call cut off mid-run loses the run; queued again, a later call runs it."""
        if self._deadline is None or not traits_of(self.engine).measured:     # the model's runs take no time
            return
        need, left = self.run_seconds(pred["tg_tps"], pred["pp_tps"]), self._deadline - time.monotonic()
        if need <= left:
            return
        self.measurer.enqueue(trial.params, plan.id, source, again=True)     # this very trial has the same params
        self._deadline_stop = (f"stopped at the deadline: the next run needs ~{need:.0f} s, {max(left, 0):.0f} s "
                               "were left (queued for the next call)")
        trial.study.stop()
        raise NotBeforeDeadline(self._deadline_stop)

    # ---- the loop ---------------------------------------------------------------------------------------------

    def run(self, n_trials: int, progress: Any = None, max_trials: int | None = None,
            patience: int = PATIENCE, deadline: float | None = None) -> TuneResult:
        """Measure `n_trials` more candidates. Stops early after `patience` trials in a row that ran nothing
        (with pre-screening: the cost model expects nothing the sampler proposes to improve on the runs made),
        after max_trials trials (default 10 n + 50), or once time.monotonic() passes `deadline` (between
        trials: a benchmark's device call must end in time; the study resumes later). With a deadline, a run
        that would end past it at its predicted speeds (run_seconds) is not started: its trial fails as "not
        run" and its plan is queued again for the next call."""
        if n_trials < 1:
            raise InputError(f"--trials must be at least 1, got {n_trials}")
        t0 = time.perf_counter()
        cap = max_trials if max_trials is not None else 10 * n_trials + 50
        start_measured = self.n_measured
        self.idle = 0
        if self.surrogate or self.seed_trials:
            self.pool.build(self.space, self.pool_size)
        if self.want_baselines:
            self.baselines(deadline)
            if StudyRecord.of(self.study).baselines is None:
                return TuneResult(self.study_name, self.storage_url, 0, 0, time.perf_counter() - t0, self.margin,
                                  self.fit, "stopped at the deadline during the baselines", self.counts)
        if self.seed_trials:
            # a run of a real engine costs seconds to minutes: seeds may take at most half the runs, the rest
            # goes to the sampler and the refitted model
            self.max_seeds = max(3, n_trials // 2) if self.prescreen else None
            self.enqueue_seeds()
        stop = {"why": ""}
        self._deadline, self._deadline_stop = deadline, ""

        def after(study, frozen) -> None:
            if progress is not None:
                progress(self, frozen)
            if SIGINT.pending:                  # Ctrl-C during Optuna's bookkeeping: stop here, raise below
                study.stop()
                return
            if self._deadline_stop:             # the next run would not have ended before the deadline
                stop["why"] = self._deadline_stop
                study.stop()
                return
            if self.n_measured - start_measured >= n_trials:
                study.stop()
                return
            if deadline is not None and time.monotonic() >= deadline:
                stop["why"] = f"stopped at the deadline after {self.n_measured - start_measured} runs"
                study.stop()
                return
            if self.n_trials_session >= cap:
                stop["why"] = f"stopped after {self.n_trials_session} trials ({cap} at most for {n_trials} runs)"
                study.stop()
                return
            self.idle += 1
            if self.idle >= patience:
                stop["why"] = (f"converged: {self.idle} trials in a row were screened out, duplicates or over budget; "
                               f"{self.n_measured - start_measured} of {n_trials} runs used")
                study.stop()
                return
            if not _waiting(study) and self.probe_repack():
                return
            if self.surrogate and (self.n_trials_session % 2 == 0) and not _waiting(study):
                skip = self.measured.keys() | self.measurer.queued
                for e in self.pool.pick(self.space, self.fit, self.scorer, self.samples, skip):
                    self.measurer.enqueue(e.params, e.plan_id, "surrogate")

        try:
            self.study.optimize(self.objective_fn, n_trials=None, catch=(MeasurementFailed, NotBeforeDeadline),
                                callbacks=[after], gc_after_trial=False)
        finally:
            self._deadline = None
        SIGINT.check()
        return TuneResult(self.study_name, self.storage_url, self.n_measured - start_measured, self.n_trials_session,
                          time.perf_counter() - t0, self.margin, self.fit, stop["why"], self.counts)

    # ---- confirmation (tuner.confirm) -------------------------------------------------------------------

    def reference(self) -> dict[str, Any] | None:
        """The baseline the study is judged against: the engine's own --fit, else the --fit-like imitation."""
        return _confirm.reference(StudyRecord.of(self.study).baselines or [])

    def finalists(self, n_tg: int = 2, ncmoe: bool = False) -> list[Contender]:
        """What confirmation re-measures (tuner.confirm.finalists)."""
        return _confirm.finalists(self.measurer, n_tg, ncmoe)

    def confirm_seconds(self, rounds: int, n_tg: int = 2, ncmoe: bool = False, default: float = 0.0,
                        repetitions: int | None = None) -> float:
        """How long confirm(rounds, n_tg, ncmoe, repetitions) runs (tuner.confirm.confirm_seconds)."""
        return _confirm.confirm_seconds(self.measurer, rounds, n_tg, ncmoe, default, repetitions)

    def confirm(self, rounds: int = CONFIRM_ROUNDS, n_tg: int = 2, progress: Any = None,
                deadline: float | None = None, ncmoe: bool = False, repetitions: int | None = None
                ) -> dict[str, Any]:
        """Re-measure the finalists and the reference interleaved and judge by the medians, stored as the study's
        "confirmed" attr (tuner.confirm.confirm: {} when stopped before `deadline`)."""
        return _confirm.confirm(self.measurer, rounds, n_tg, progress, deadline, ncmoe, repetitions)


# ---- helpers ------------------------------------------------------------------------------------------------------

def _waiting(study) -> bool:
    from optuna.trial import TrialState
    return bool(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


__all__ = ["Tuner", "StudyConfig", "TuneResult", "BenchRun", "Settings", "MeasurementFailed", "slug"]
