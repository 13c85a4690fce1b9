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

import inspect
import math
import random
import re
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from planner.bench_workload import BenchWorkload
from planner.cost import predict
from planner.engine import memory_model
from planner.engines import traits_of
from planner.errors import BudgetError, InputError, OffloadTunerError
from planner.gguf_header import first_shard
from planner.hardware import HardwareProfile
from planner.host import cache_ram_for, host_bill, ram_floor_error
from planner.memory import MemoryReport
from planner.model import ModelInventory
from planner.plan import DEFAULT_CTX, Plan
from planner.propose import best_plans
from . import baselines as _baselines, confirm as _confirm, seeds as _seeds
from .confirm import CONFIRM_ROUNDS, Contender
from .cost_fit import CostFit, Terms, fit
from .failures import OOM
from .interrupt import SIGINT
from .margin import Margins
from .objectives import RequestTime, parse_objective, request_time
from .options import LATER_SPACE_OPTIONS, Settings, TunerOptions, hardware_key
from .pool import Pool, Scorer
from .records import CandidateInfo, MeasuredRun, RecordWriter, StudyRecord, TrialRecord, measured_dict
from .space import Space, SpaceConfig
from .storage import make_storage, sqlite_path, study_exists

PATIENCE = 60              # trials in a row without a run before a session stops as converged
_OOM = OOM                 # an out-of-memory failure text (tuner.failures)


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
    """One study: `Tuner(inv, hw, engine, TunerOptions(...)).run(n)` measures n more candidates (screened and
    duplicate trials do not count).

    `engine` is anything with the planner.engine.Engine protocol; `hw` the machine as the memory model and the
    cost model see it (the cost model's prior; for sim it is the engine's own). The measuring methods
    (_measure, _judge_peak, _plan_record, _trial) serve tuner.baselines, .confirm and .served too."""

    def __init__(self, inv: ModelInventory, hw: HardwareProfile, engine: Any,
                 options: TunerOptions = TunerOptions()) -> None:
        import optuna
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        o = self.options = options
        self.inv, self.hw, self.engine = inv, hw, engine
        # the memory model that judges this engine's plans: its own prediction where it has one (the torch engine),
        # else planner.memory's (llama.cpp's memory; the sim engine's own)
        self.estimate = memory_model(engine, o.workload)
        self.objective = parse_objective(o.objective) if isinstance(o.objective, str) else o.objective
        self.workload, self.dialect = o.workload, o.dialect
        if self.objective.kind == "time" and o.requests is None:
            raise InputError("objective time needs the workload's request classes: say --workload (chat, agent, rag, "
                             "batch, or a file)")
        self.requests = o.requests if self.objective.kind == "time" else None
        self._contexts(o.n_ctx)
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
                                 engine=getattr(engine, "name", type(engine).__name__), hardware=hardware_key(hw),
                                 dialect=o.dialect, objective=self.objective.text, workload=asdict(o.workload),
                                 n_ctx=self.n_ctx, space=o.config.to_dict(),
                                 requests=self.requests.to_dict() if self.requests is not None else None)
        self.study = self._open(o.fresh, o.sampler, prior)
        self.margins = Margins(self.study, hw, o.margin, prior)
        self.max_seeds: int | None = None      # run() caps the seed trials of an expensive engine
        space = o.space     # self.config: _open may have kept a resumed study's space (LATER_SPACE_OPTIONS)
        if space is not None and (space.margin, space.ubatch_margins, space.config, space.n_ctx, space.dialect) == \
                (self.margin, self.ubatch_margins, self.config, self.n_ctx, o.dialect) and \
                space.estimate is self.estimate:
            self._space = space          # a prepared one
        else:
            self._space = self._new_space()
        self._space_changes = self.margins.changes
        rec = StudyRecord.of(self.study)
        if self.requests is not None:
            self.objective = self.objective.with_request(self._request_time(rec))
        self.scorer = Scorer(self.objective, self.workload)
        self.fit = CostFit.from_dict(rec.cost_fit)
        self.pool = Pool(self.terms, self.rng)
        self.measured: dict[str, tuple[int, tuple[float, ...] | None]] = {}   # plan id -> (trial, values)
        self.samples: list[tuple[Terms, float, float]] = []
        self.n_measured = 0
        self.n_trials_session = 0
        self.idle = 0                 # trials in a row that ran nothing (screened, duplicate, over budget)
        self._deadline: float | None = None     # run()'s, for the trial about to measure
        self._deadline_stop = ""
        self._queued_ids: set[str] = set()
        # baseline runs by plan id: a trial of the same plan takes its measurement instead of running it again
        self._baseline_runs = {b["plan_id"]: MeasuredRun.from_dict(b["measured"]) for b in rec.baselines or []
                               if b.get("plan_id") and b.get("measured")}
        self._load_history()

    def _contexts(self, n_ctx: int | None) -> None:
        """The emitted context (n_ctx) and the one the engine's run holds (llama-bench: the prompt test's). An
        engine without run_context (sim: the memory model at n_ctx) measures at n_ctx itself."""
        w = self.workload
        need = w.depth + w.n_prompt + w.n_gen
        self.n_ctx = n_ctx if n_ctx is not None else max(DEFAULT_CTX, -(-need // 256) * 256)
        if self.n_ctx < need:
            raise InputError(f"--ctx {self.n_ctx} is smaller than the workload's depth + n_prompt + n_gen = {need}")
        run_context = getattr(self.engine, "run_context", None)
        self.run_ctx = min(run_context(w), self.n_ctx) if run_context else self.n_ctx
        # llama-sweep-bench's context follows the plan's ubatch (one row of it): such engines take the plan
        self._run_ctx_of_plan = run_context if run_context and "plan" in inspect.signature(run_context).parameters \
            else None

    # ---- the margin (tuner.margin) and the space it bounds --------------------------------------------

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
        """The search space under the current margins: built again whenever they move."""
        if self._space_changes != self.margins.changes:
            self._space, self._space_changes = self._new_space(), self.margins.changes
        return self._space

    def _new_space(self) -> Space:
        return Space(self.inv, self.hw, dialect=self.dialect, n_ctx=self.n_ctx, margin=self.margin,
                     config=self.config, memory=self.estimate, ubatch_margins=self.ubatch_margins)

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
                    was = (f" (it was made with --objective {old['objective']})" if "objective" in diff
                           and isinstance(old.get("objective"), str) else "")
                    raise InputError(f"study {self.study_name!r} in {self.storage_url} was made with other "
                                     f"{', '.join(diff)}{was}; pick another --study name, or --fresh to start it "
                                     "over")
                return study
        study = optuna.create_study(study_name=self.study_name, storage=storage, sampler=self._sampler(sampler),
                                    directions=self.objective.directions, load_if_exists=True)   # race-free
        StudyRecord.create(study, settings=self.settings.to_dict(), objective_names=list(self.objective.names))
        with warnings.catch_warnings():      # experimental in Optuna; optuna-dashboard titles its plots with them
            warnings.simplefilter("ignore")
            study.set_metric_names(list(self.objective.names))
        StudyRecord.save(study, margin_bytes=margin_prior,
                         margin_rule="learnt" if self.options.margin is None else "fixed",
                         created=time.strftime("%Y-%m-%d %H:%M:%S"))
        return study

    def _keep_old_space(self, old: dict[str, Any]) -> None:
        """A study stored before a widening space option existed (LATER_SPACE_OPTIONS) ran without it: it resumes
        with that option's default, the space it was made with, instead of being refused as another study."""
        stored = old.get("space")
        if not isinstance(stored, dict):
            return
        missing = {f: getattr(SpaceConfig(), f) for f in LATER_SPACE_OPTIONS if f not in stored}
        if missing:
            self.config = replace(self.config, **missing)
            self.settings = replace(self.settings, space=self.config.to_dict())

    def _load_history(self) -> None:
        """Rebuild the measured-plan cache and the refit samples from the stored trials (resume)."""
        from optuna.trial import TrialState
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            r = TrialRecord.from_trial(t)
            m = r.measured
            if not r.plan_id or m is None or r.duplicate_of is not None:
                continue
            self.measured[r.plan_id] = (t.number, tuple(t.values) if t.state == TrialState.COMPLETE and t.values
                                        else None)
            if m.ok and r.terms is not None:
                self.samples.append((r.terms, m.tg_tps, m.pp_tps))
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            r = TrialRecord.from_trial(t)
            if r.plan_id:
                self._queued_ids.add(r.plan_id)
        if self.samples:
            self.fit = fit(self.samples)

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.study.get_trials(deepcopy=False):
            out[t.state.name.lower()] = out.get(t.state.name.lower(), 0) + 1
        return out

    def _trial(self, number: int):
        return next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)

    # ---- predictions ----------------------------------------------------------------------------------------

    def terms(self, plan: Plan) -> Terms:
        w = self.workload
        return Terms.of(predict(self.inv, plan, self.hw, n_prompt=max(w.n_prompt, 1), depth=w.depth))

    def _measured_points(self) -> list[tuple[float, float]]:
        return [(tg, pp) for _, tg, pp in self.samples]

    def _request_time(self, rec: StudyRecord) -> RequestTime:
        """The time objective's per-class speeds (objectives.request_time), computed once per study on the
        planner's pick for the budget and stored, so a resumed study scores its trials as before."""
        if rec.request_time is not None:
            return RequestTime.from_dict(rec.request_time)
        knobs = self._default_knobs()
        try:
            plan = best_plans(self.inv, self.hw, knobs, self.dialect, "both", self.space.margin_for(knobs.n_ubatch),
                              n_prompt=max(self.workload.n_prompt, 1))[0].plan
        except (InputError, IndexError):    # nothing fits the budget: the ratios of the model on the CPU alone
            plan = Plan(self.inv.source or self.inv.name, {t.name: "CPU" for t in self.inv.allocated()}, knobs,
                        self.dialect)
        rt = request_time(self.inv, self.hw, plan, self.requests, self.workload)
        StudyRecord.save(self.study, request_time=rt.to_dict())
        return rt

    # ---- seeding and baselines ------------------------------------------------------------------------------

    def _default_knobs(self):
        return self.space.knobs(self.space.fixed(self.space.default_params()))

    def enqueue_seeds(self) -> int:
        """Enqueue the planner's proposals and the cost model's predicted front (once per study;
        tuner.seeds.enqueue_seeds)."""
        return _seeds.enqueue_seeds(self)

    def probe_repack(self) -> bool:
        """Once per study, the best-TG run again with a repacking knob on (tuner.seeds.probe_repack)."""
        return _seeds.probe_repack(self)

    def _enqueue(self, params: dict[str, Any], plan_id: str, source: str, again: bool = False) -> None:
        """Queue a candidate (once: a trial of the same params skips it, unless `again`, for one not run)."""
        self.study.enqueue_trial(params, user_attrs=TrialRecord(source=source, plan_id=plan_id).to_attrs(),
                                 skip_if_exists=not again)
        self._queued_ids.add(plan_id)

    def baselines(self, deadline: float | None = None) -> list[dict[str, Any]]:
        """Measure the reference points once per study (tuner.baselines.measure_baselines; until
        `deadline`)."""
        return _baselines.measure_baselines(self, deadline)

    def redo_references(self) -> list[str]:
        """Measure again the reference baselines that never ran (tuner.baselines.redo_references)."""
        return _baselines.redo_references(self)

    def _plan_record(self, name: str, kind: str, plan: Plan | None, err: str = "", judged: bool = True
                     ) -> dict[str, Any]:
        """A baseline that is a plan: measured (and judged) like a trial, its run reused by a trial of it. An
        unjudged one (llama.cpp's own choice, a reference) is run whatever the memory model says of it, and a
        peak over the budget is noted rather than failed."""
        rec: dict[str, Any] = {"name": name, "kind": kind, "ok": False, "error": err, "runs": 0}
        if plan is None:
            return rec
        rec.update({k: v for k, v in self._describe(plan).items() if k != "terms"})
        reason = self._over_budget(plan)
        if reason and judged:
            rec["error"] = f"not run: over budget ({reason})"
            return rec
        m = self._measure(plan)
        if judged:
            m = self._judge_peak(plan, m)
        elif m.ok:
            rec["over_budget"] = self.margins.over(dict(m.peak_bytes))
        rec.update(measured=measured_dict(m), ok=bool(m.ok), error=m.error, runs=1, plan=plan.to_json())
        if not m.ok and _OOM.search(m.error or ""):
            self._raise_margin(plan, m.error)
        if judged:     # a trial of the same plan takes this run (an unjudged one may be over the budget)
            self._baseline_runs[plan.id] = MeasuredRun.from_dict(measured_dict(m))
        if m.ok:
            self.samples.append((self.terms(plan), m.tg_tps, m.pp_tps))
        return rec

    def _over_budget(self, plan: Plan, mem: MemoryReport | None = None) -> str:
        """'' when the memory model keeps `plan` within the budget its ubatch is held to; else why not."""
        return self.space.over_budget(mem or self.estimate(self.inv, plan, self.hw), n_ubatch=plan.knobs.n_ubatch)

    @property
    def _n_gpus(self) -> int | None:
        """The GPUs a baseline's command line spreads over when it has no -ts (None: one GPU, as the line says)."""
        return len(self.hw.gpus) if len(self.hw.gpus) > 1 else None

    def _describe(self, plan: Plan, terms: Terms | None = None, memory: Any = None) -> dict[str, Any]:
        from planner.flags import render_shell
        cmds: dict[str, str] = {}
        model = self.settings.model      # -m: llama.cpp loads a split model only from its first shard
        model_path = "MODEL.gguf" if model.startswith("preset:") else first_shard(model)
        memory = memory or self.estimate(self.inv, plan, self.hw)
        cache_ram = cache_ram_for(host_bill(memory, self.hw.host.ram_bytes))   # the server's prompt cache: what's left
        for tool in ("server", "cli", "bench") if self.want_commands else ():
            try:
                cmds[f"llama-{tool}"] = render_shell(plan, self.inv, tool, model_path=model_path,
                                                     workload=self.workload if tool == "bench" else None,
                                                     cache_ram_mib=cache_ram if tool == "server" else None)
            except InputError as e:
                cmds[f"llama-{tool}"] = f"# not expressible for llama-{tool}: {e}"
            except Exception as e:    # a renderer bug must not end the study; the trial says what happened
                cmds[f"llama-{tool}"] = f"# could not render for llama-{tool}: {type(e).__name__}: {e}"
        terms = terms or self.terms(plan)
        tg_fit, pp_fit = self.fit.predict(terms)
        tg_prior, pp_prior = CostFit().predict(terms)
        return {"plan_id": plan.id, "label": plan.label, "commands": cmds, "terms": terms,
                "predicted": {"tg_tps": tg_fit, "pp_tps": pp_fit, "prior_tg_tps": tg_prior, "prior_pp_tps": pp_prior},
                "memory": memory.to_dict()}

    # ---- measuring --------------------------------------------------------------------------------------------

    def _measure(self, plan: Plan, workload: BenchWorkload | None = None):
        """engine.measure (at the study's workload unless given), with an exception of the engine (not of our
        input) turned into a failed result."""
        try:
            with SIGINT.engine_run():          # Ctrl-C lands here at once, elsewhere at the next safe point
                return self.engine.measure(self.inv, plan, workload or self.workload)
        except InputError:
            raise
        except Exception as e:   # an engine bug must not end the study; the trial records it
            return MeasuredRun.failed(f"engine raised {type(e).__name__}: {e}")

    def peaks_at_ctx(self, plan: Plan, peaks: dict[str, int]) -> dict[str, int]:
        """Measured GPU peaks moved from the run's own context to the emitted --ctx by what the memory model says
        the two hold apart (KV and compute): the VRAM the user's command will use. Either way: llama-bench's
        prompt test holds less than --ctx, while sweep-bench's -c follows the plan's ubatch and can hold more
        (-ub 4096 runs at -c 4096, where an emitted -c 2112 caps the ubatch at 2112: ~1.3 GiB less compute on
        the H100 ik study, which a one-way move counted as a +1342 MiB memory model error)."""
        run_ctx = self._run_ctx_of_plan(self.workload, plan) if self._run_ctx_of_plan else self.run_ctx
        if run_ctx == self.n_ctx or not peaks:
            return dict(peaks)
        at_ctx = self.estimate(self.inv, plan, self.hw).devices
        at_run = self.estimate(self.inv, replace(plan, knobs=replace(plan.knobs, n_ctx=run_ctx)), self.hw).devices
        return {d: max(int(v) + at_ctx[d].total - at_run[d].total, 0) if d in at_ctx and d in at_run else int(v)
                for d, v in peaks.items()}

    def _judge_peak(self, plan: Plan, m: Any) -> Any:
        """`m` with its GPU peaks moved to the emitted context (`peaks_at_ctx`), or, when such a peak exceeds that
        GPU's budget (Margins.judge: VRAM minus the margin asked for), a failed result that keeps the measured
        speeds and peaks. Every successful run teaches the learnt margin the memory model's error; with a fixed
        margin an over-budget run raises it by at least the excess (as an out-of-memory does)."""
        if not m.ok:
            return m
        measured = {k: int(v) for k, v in dict(m.peak_bytes).items()}
        peaks = self.peaks_at_ctx(plan, measured)
        raw = dict(getattr(m, "raw", {}) or {})
        result = MeasuredRun(error="", ok=True, pp_tps=float(m.pp_tps), tg_tps=float(m.tg_tps), peak_bytes=measured,
                             host_bytes=int(m.host_bytes), peak_at_ctx=peaks if peaks != measured else {},
                             cv=raw.get("cv"), seen=str(raw.get("seen", "")),
                             seconds=MeasuredRun.from_measurement(m).seconds)
        error = self.margins.judge(plan, peaks, self.estimate(self.inv, plan, self.hw).devices,
                                   f" at -c {self.n_ctx}" if peaks != measured else "")
        return replace(result, ok=False, error=error) if error else result

    def _raise_margin(self, plan: Plan, error: str, at_least: int = 0) -> None:
        """Raise the margin so that `plan` no longer fits any GPU it failed on (Margins.raise_for)."""
        self.margins.raise_for(plan, self.estimate(self.inv, plan, self.hw).devices, error, at_least)

    def _refit(self) -> None:
        if self.samples:
            self.fit = fit(self.samples)
            StudyRecord.save(self.study, cost_fit=self.fit.to_dict())

    # Optuna's objective: one piece because each early exit (over budget, duplicate, screened, failed) stores
    # why on the trial as it goes, in the order a reader of the trial sees them
    def objective_fn(self, trial) -> float | tuple[float, ...]:
        import optuna
        self.n_trials_session += 1
        rec = RecordWriter(trial)       # an enqueued trial's record holds its source; the sampler's says "sampler"
        source = rec.update().source
        cand = self.space.decode(lambda dim: dim.suggest(trial))
        self.pool.add(cand)
        plan = cand.plan
        pooled = self.pool.get(plan.id)
        info = self._describe(plan, pooled.terms if pooled else None, cand.memory) if cand.memory is not None \
            else {"plan_id": plan.id, "label": plan.label}
        rec.update(plan_id=plan.id, plan_json=plan.to_json(), candidate=CandidateInfo.from_dict(info))
        if not cand.fits:
            rec.update(pruned_reason=f"over budget: {cand.reason}")
            raise optuna.TrialPruned(f"over budget: {cand.reason}")
        prev = self.measured.get(plan.id)
        if prev is not None:
            rec.update(duplicate_of=prev[0])
            if prev[1] is None:
                rec.update(pruned_reason=f"same plan as failed trial {prev[0]}")
                raise optuna.TrialPruned(f"same plan as failed trial {prev[0]}")
            return prev[1] if self.objective.n_values > 1 else prev[1][0]
        pred = info["predicted"]
        if self.prescreen and source == "sampler":
            ok, why = self.scorer.promising(pred["tg_tps"], pred["pp_tps"], self._measured_points())
            if not ok:
                rec.update(pruned_reason=why)
                raise optuna.TrialPruned(why)
        reused = self._baseline_runs.get(plan.id)
        if reused is not None:        # a baseline already ran this plan: its run is this trial's
            m = reused
            rec.update(reused_baseline_run=True)
        else:
            self._start_before_deadline(trial, plan, source, pred)
            m = self._judge_peak(plan, self._measure(plan))   # a baseline's run was judged when it ran
            self.n_measured += 1
        self.idle = -1                # the callback adds one per trial
        self._queued_ids.discard(plan.id)
        rec.update(measured=MeasuredRun.from_measurement(m))
        if not m.ok:
            self.measured[plan.id] = (trial.number, None)
            if reused is None and _OOM.search(m.error or ""):
                self._raise_margin(plan, m.error)
            raise MeasurementFailed(m.error or "the engine reported a failure without a message")
        terms = info["terms"]
        rec.update(terms=terms)
        values = self.objective.values(m.tg_tps if self.workload.n_gen else 0.0,
                                       m.pp_tps if self.workload.n_prompt else 0.0)
        if any(not math.isfinite(v) for v in values):
            self.measured[plan.id] = (trial.number, None)
            raise MeasurementFailed(f"objective {self.objective.text!r} is undefined at TG {m.tg_tps:.3g}, "
                                    f"PP {m.pp_tps:.3g}")
        improved = self.scorer.improves(m.tg_tps, m.pp_tps, self._measured_points())
        self.measured[plan.id] = (trial.number, values)
        if reused is None:            # the baseline's run is in the samples already
            self.samples.append((terms, m.tg_tps, m.pp_tps))
        self._refit()
        if improved and self.surrogate:
            self.pool.add_neighbours(self.space, cand.params, 40 if self.prescreen else 12)
        return values if self.objective.n_values > 1 else values[0]

    def run_seconds(self, tg_tps: float, pp_tps: float) -> float:
        """How long one run at these speeds takes, x1.2: its tokens (BenchWorkload.token_seconds) plus what the
        study's runs took beyond theirs (loading; the median of the timed runs, 0 before the first). Runs of one
        study differ fivefold (a --no-host run at depth 8192 took 143 s where --fit took 15 s), so a mean of past
        runs does not say whether the next one ends before a deadline."""
        from optuna.trial import TrialState
        rest = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            m = TrialRecord.from_trial(t).measured
            if m is not None and m.ok and m.seconds:
                rest.append(m.seconds - self.workload.token_seconds(m.pp_tps, m.tg_tps))
        rest += [float(b["measured"]["seconds"]) - self.workload.token_seconds(
                     float(b["measured"].get("pp_tps") or 0), float(b["measured"].get("tg_tps") or 0))
                 for b in StudyRecord.of(self.study).baselines or []
                 if (b.get("measured") or {}).get("seconds") and b["measured"].get("ok", True)]
        fixed = max(0.0, statistics.median(rest)) if rest else 0.0
        return 1.2 * (fixed + self.workload.token_seconds(pp_tps, tg_tps))

    def _start_before_deadline(self, trial, plan: Plan, source: str, pred: dict[str, float]) -> None:
        """Raise NotBeforeDeadline (and stop the study) when this run, at its predicted speeds, would end past
        run()'s deadline: a device call cut off mid-run loses the run; queued again, a later call runs it."""
        if self._deadline is None or not traits_of(self.engine).measured:     # the model's runs take no time
            return
        need, left = self.run_seconds(pred["tg_tps"], pred["pp_tps"]), self._deadline - time.monotonic()
        if need <= left:
            return
        self._enqueue(trial.params, plan.id, source, again=True)     # this very trial has the same params
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
                skip = self.measured.keys() | self._queued_ids
                for e in self.pool.pick(self.space, self.fit, self.scorer, self.samples, skip):
                    self._enqueue(e.params, e.plan_id, "surrogate")

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
        return _confirm.finalists(self, n_tg, ncmoe)

    def confirm_seconds(self, rounds: int, n_tg: int = 2, ncmoe: bool = False, default: float = 0.0,
                        repetitions: int | None = None) -> float:
        """How long confirm(rounds, n_tg, ncmoe, repetitions) runs (tuner.confirm.confirm_seconds)."""
        return _confirm.confirm_seconds(self, rounds, n_tg, ncmoe, default, repetitions)

    def confirm(self, rounds: int = CONFIRM_ROUNDS, n_tg: int = 2, progress: Any = None,
                deadline: float | None = None, ncmoe: bool = False, repetitions: int | None = None
                ) -> dict[str, Any]:
        """Re-measure the finalists and the reference interleaved and judge by the medians, stored as the study's
        "confirmed" attr (tuner.confirm.confirm: {} when stopped before `deadline`)."""
        return _confirm.confirm(self, rounds, n_tg, progress, deadline, ncmoe, repetitions)


# ---- helpers ------------------------------------------------------------------------------------------------------

def _waiting(study) -> bool:
    from optuna.trial import TrialState
    return bool(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


__all__ = ["Tuner", "TunerOptions", "TuneResult", "BenchWorkload", "Settings", "MeasurementFailed", "slug"]
