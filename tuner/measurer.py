"""The measuring seam: one study's Measurer measures a plan and records it. The search (tuner.search), the
baselines, the seeds, the confirmation and the served stage all take it; none of them takes the Tuner, and none
reads another's private members (tests/test_import_graph.py holds both).

What it holds: the model, the machine and the engine; the study (Optuna's, with our StudyRecord in its attrs);
the memory model that judges the engine's plans and the margins it is held to (tuner.margin), and the search
space they bound; the cost model's fit and the runs it is fitted on; which plans ran in which trial and which
are queued. What it does: a run of a plan (an engine's exception turned into a failed result), its GPU peaks
moved to the emitted context and judged against the budget, a baseline measured and recorded as a trial's would
be, a plan described with its commands, predictions and memory.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner.bench_run import BenchRun
from planner.cost import predict
from planner.engine_contract import Engine, MemoryModel
from planner.errors import InputError
from planner.gguf_header import first_shard
from planner.hardware import HardwareProfile
from planner.host import cache_ram_for, host_bill
from planner.memory import MemoryReport
from planner.model import ModelInventory
from planner.plan import DEFAULT_CTX, Knobs, Plan
from planner.propose import best_plans
from .cost_fit import CostFit, Terms, fit
from .failures import OOM
from .interrupt import SIGINT
from .margin import Margins
from planner.workload import Workload
from .objectives import Objective, RequestTime, request_time
from .options import Settings
from .records import MeasuredRun, StudyRecord, TrialRecord, measured_dict
from .space import Space, SpaceConfig


def contexts(bench: BenchRun, n_ctx: int | None, engine: Engine) -> tuple[int, int]:
    """(the emitted context, the one the engine's run holds: llama-bench's prompt test's; an engine whose
    run_context is None, sim, measures at the emitted one itself)."""
    need = bench.depth + bench.n_prompt + bench.n_gen
    emitted = n_ctx if n_ctx is not None else max(DEFAULT_CTX, -(-need // 256) * 256)
    if emitted < need:
        raise InputError(f"--ctx {emitted} is smaller than the bench run's depth + n_prompt + n_gen = {need}")
    run_ctx = engine.run_context(bench)
    return emitted, emitted if run_ctx is None else min(run_ctx, emitted)


class Measurer:
    """Measures plans for one study and records them (see the module docstring). `objective` and `requests` are
    what the study ranks by (the confirmation and the serving read them); `commands`: describe() renders the
    llama.cpp command lines of each plan."""

    def __init__(self, inv: ModelInventory, hw: HardwareProfile, engine: Engine, study: Any, settings: Settings,
                 margins: Margins, config: SpaceConfig, *, bench: BenchRun, estimate: MemoryModel,
                 n_ctx: int, run_ctx: int, objective: Objective, requests: Workload | None = None,
                 commands: bool = True, space: Space | None = None) -> None:
        self.inv, self.hw, self.engine, self.study, self.settings = inv, hw, engine, study, settings
        self.margins, self.config, self.bench, self.estimate = margins, config, bench, estimate
        self.dialect = settings.dialect
        self.n_ctx, self.run_ctx, self.objective, self.requests = n_ctx, run_ctx, objective, requests
        self.commands = commands
        if space is not None and (space.margin, space.ubatch_margins, space.config, space.n_ctx, space.dialect) == (
                self.margin, self.margins.by_ubatch, config, n_ctx, self.dialect) and space.estimate is estimate:
            self._space = space          # a prepared one
        else:
            self._space = self.new_space()
        self._space_changes = margins.changes
        rec = StudyRecord.of(study)
        self.fit = rec.cost_fit or CostFit()
        self.samples: list[tuple[Terms, float, float]] = []          # (terms, TG, PP) of every good run
        self.measured: dict[str, tuple[int, tuple[float, ...] | None]] = {}   # plan id -> (trial, values)
        self.queued: set[str] = set()                                # plan ids of enqueued trials not yet run
        # baseline runs by plan id: a trial of the same plan takes its measurement instead of running it again
        self.baseline_runs = {b["plan_id"]: MeasuredRun.from_dict(b["measured"]) for b in rec.baselines or []
                              if b.get("plan_id") and b.get("measured")}
        self.load_history()

    # ---- the margin (tuner.margin) and the space it bounds --------------------------------------------------------

    @property
    def margin(self) -> int:
        """The margin of an ubatch without runs (learnt), or the fixed one."""
        return self.margins.default

    @property
    def space(self) -> Space:
        """The search space under the current margins: built again whenever they move."""
        if self._space_changes != self.margins.changes:
            self._space, self._space_changes = self.new_space(), self.margins.changes
        return self._space

    def new_space(self) -> Space:
        return Space(self.inv, self.hw, dialect=self.dialect, n_ctx=self.n_ctx, margin=self.margin,
                     config=self.config, memory=self.estimate, ubatch_margins=self.margins.by_ubatch)

    def default_knobs(self) -> Knobs:
        return self.space.knobs(self.space.fixed(self.space.default_params()))

    @property
    def n_gpus(self) -> int | None:
        """The GPUs a baseline's command line spreads over when it has no -ts (None: one GPU, as the line says)."""
        return len(self.hw.gpus) if len(self.hw.gpus) > 1 else None

    def over_budget(self, plan: Plan, mem: MemoryReport | None = None) -> str:
        """'' when the memory model keeps `plan` within the budget its ubatch is held to; else why not."""
        return self.space.over_budget(mem or self.estimate(self.inv, plan, self.hw), n_ubatch=plan.knobs.n_ubatch)

    # ---- the study's record -----------------------------------------------------------------------------------------

    def load_history(self) -> None:
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
                self.queued.add(r.plan_id)
        if self.samples:
            self.fit = fit(self.samples)

    def trial(self, number: int) -> Any:
        """The study's trial `number` (Optuna's FrozenTrial)."""
        return next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)

    def enqueue(self, params: dict[str, Any], plan_id: str, source: str, again: bool = False) -> None:
        """Queue a candidate (once: a trial of the same params skips it, unless `again`, for one not run)."""
        self.study.enqueue_trial(params, user_attrs=TrialRecord(source=source, plan_id=plan_id).to_attrs(),
                                 skip_if_exists=not again)
        self.queued.add(plan_id)

    def refit(self) -> None:
        if self.samples:
            self.fit = fit(self.samples)
            StudyRecord.save(self.study, cost_fit=self.fit)

    def request_time(self) -> RequestTime:
        """The time objective's per-class speeds (objectives.request_time), computed once per study on the
        planner's pick for the budget and stored, so a resumed study scores its trials as before."""
        rec = StudyRecord.of(self.study)
        if rec.request_time is not None:
            return rec.request_time
        if self.requests is None:
            raise InputError("objective time needs the workload's request classes")
        knobs = self.default_knobs()
        try:
            plan = best_plans(self.inv, self.hw, knobs, self.dialect, "both", self.space.margin_for(knobs.n_ubatch),
                              n_prompt=max(self.bench.n_prompt, 1))[0].plan
        except (InputError, IndexError):    # nothing fits the budget: the ratios of the model on the CPU alone
            plan = Plan(self.inv.source or self.inv.name, {t.name: "CPU" for t in self.inv.allocated()}, knobs,
                        self.dialect)
        rt = request_time(self.inv, self.hw, plan, self.requests, self.bench)
        StudyRecord.save(self.study, request_time=rt)
        return rt

    # ---- predictions ----------------------------------------------------------------------------------------------

    def terms(self, plan: Plan) -> Terms:
        w = self.bench
        return Terms.of(predict(self.inv, plan, self.hw, n_prompt=max(w.n_prompt, 1), depth=w.depth))

    def measured_points(self) -> list[tuple[float, float]]:
        return [(tg, pp) for _, tg, pp in self.samples]

    def describe(self, plan: Plan, terms: Terms | None = None, memory: MemoryReport | None = None
                 ) -> dict[str, Any]:
        """The plan as a trial records it: id, label, the llama.cpp commands, the cost model's predictions (fitted
        and prior), its memory."""
        from planner.flags import render_shell
        cmds: dict[str, str] = {}
        model = self.settings.model      # -m: llama.cpp loads a split model only from its first shard
        model_path = "MODEL.gguf" if model.startswith("preset:") else first_shard(model)
        memory = memory or self.estimate(self.inv, plan, self.hw)
        cache_ram = cache_ram_for(host_bill(memory, self.hw.host.ram_bytes))   # the server's prompt cache: what's left
        for tool in ("server", "cli", "bench") if self.commands else ():
            try:
                cmds[f"llama-{tool}"] = render_shell(plan, self.inv, tool, model_path=model_path,
                                                     bench=self.bench if tool == "bench" else None,
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

    def measure(self, plan: Plan, bench: BenchRun | None = None) -> Any:
        """engine.measure (at the study's bench run unless given), with an exception of the engine (not of our
        input) turned into a failed result."""
        try:
            with SIGINT.engine_run():          # Ctrl-C lands here at once, elsewhere at the next safe point
                return self.engine.measure(self.inv, plan, bench or self.bench)
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
        # llama-sweep-bench's context follows the plan's ubatch (one row of it): the engine is asked of the plan
        of_plan = self.engine.run_context(self.bench, plan)
        run_ctx = self.run_ctx if of_plan is None else of_plan
        if run_ctx == self.n_ctx or not peaks:
            return dict(peaks)
        at_ctx = self.estimate(self.inv, plan, self.hw).devices
        at_run = self.estimate(self.inv, replace(plan, knobs=replace(plan.knobs, n_ctx=run_ctx)), self.hw).devices
        return {d: max(int(v) + at_ctx[d].total - at_run[d].total, 0) if d in at_ctx and d in at_run else int(v)
                for d, v in peaks.items()}

    def judge_peak(self, plan: Plan, m: Any) -> Any:
        """`m` with its GPU peaks moved to the emitted context (`peaks_at_ctx`), or, when such a peak exceeds that
        GPU's budget (Margins.judge: VRAM minus the margin asked for), a failed result that keeps the measured
        speeds and peaks. Every successful run teaches the learnt margin the memory model's error; with a fixed
        margin an over-budget run raises it by at least the excess (as an out-of-memory does)."""
        if not m.ok:
            return m
        measured = {k: int(v) for k, v in dict(m.peak_bytes).items()}
        peaks = self.peaks_at_ctx(plan, measured)
        run = MeasuredRun.from_measurement(m)
        result = MeasuredRun(error="", ok=True, pp_tps=float(m.pp_tps), tg_tps=float(m.tg_tps), peak_bytes=measured,
                             host_bytes=int(m.host_bytes), peak_at_ctx=peaks if peaks != measured else {},
                             cv=run.cv, seen=str(run.seen or ""), seconds=run.seconds)
        error = self.margins.judge(plan, peaks, self.estimate(self.inv, plan, self.hw).devices,
                                   f" at -c {self.n_ctx}" if peaks != measured else "")
        return replace(result, ok=False, error=error) if error else result

    def raise_margin(self, plan: Plan, error: str, at_least: int = 0) -> None:
        """Raise the margin so that `plan` no longer fits any GPU it failed on (Margins.raise_for)."""
        self.margins.raise_for(plan, self.estimate(self.inv, plan, self.hw).devices, error, at_least)

    def plan_record(self, name: str, kind: str, plan: Plan | None, err: str = "", judged: bool = True
                    ) -> dict[str, Any]:
        """A baseline that is a plan: measured (and judged) like a trial, its run reused by a trial of it. An
        unjudged one (llama.cpp's own choice, a reference) is run whatever the memory model says of it, and a
        peak over the budget is noted rather than failed."""
        rec: dict[str, Any] = {"name": name, "kind": kind, "ok": False, "error": err, "runs": 0}
        if plan is None:
            return rec
        rec.update({k: v for k, v in self.describe(plan).items() if k != "terms"})
        reason = self.over_budget(plan)
        if reason and judged:
            rec["error"] = f"not run: over budget ({reason})"
            return rec
        m = self.measure(plan)
        if judged:
            m = self.judge_peak(plan, m)
        elif m.ok:
            rec["over_budget"] = self.margins.over(dict(m.peak_bytes))
        rec.update(measured=measured_dict(m), ok=bool(m.ok), error=m.error, runs=1, plan=plan.to_json())
        if not m.ok and OOM.search(m.error or ""):
            self.raise_margin(plan, m.error)
        if judged:     # a trial of the same plan takes this run (an unjudged one may be over the budget)
            self.baseline_runs[plan.id] = MeasuredRun.from_dict(measured_dict(m))
        if m.ok:
            self.samples.append((self.terms(plan), m.tg_tps, m.pp_tps))
        return rec
