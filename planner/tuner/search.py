"""The autotuner: an Optuna study over planner.tuner.space, measured on any Engine, screened by the memory model.

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
coefficients are refitted (planner.tuner.cost_fit) and, every other trial, the pool's best unmeasured candidate under
the refitted model is enqueued ("surrogate"); the sampler (TPE) proposes the rest.

Budgets mean what users mean: `--gpu 16GiB` is the peak VRAM the emitted command may use at the emitted
context (`--ctx`). A run measures at the engine's own context (llama-bench: n_prompt + depth), so the memory
model's difference between the two contexts is added to each measured peak before it is judged. The margin is
the memory model's own error, learnt from the runs per ubatch (`margin=None`, the default: an ubatch not yet run is
held to the engine's known error, a measured one to the largest under-prediction seen at it plus MARGIN_SLACK);
a fixed margin is kept as given.

Baselines (planner.tuner.baselines): the engine's own `--fit` where it has one, `-ngl 99 -cmoe` and the best
`-ncmoe N`. Confirmation (planner.tuner.confirm, `Tuner.confirm`): the finalists and `--fit` re-measured interleaved,
judged by the median and its spread.

Storage is Optuna's RDBStorage (SQLite under studies/ by default, any SQLAlchemy URL): every finished trial is
committed when it ends, so Ctrl-C or kill -9 loses none; a heartbeat lets a resumed study fail (and retry once)
trials a killed worker left RUNNING. Each trial stores its plan JSON, plan id, rendered commands, predicted and
measured PP/TG and peak bytes per device (user attrs), so reports need neither the model file nor the engine.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import statistics
import random
import re
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..cost import predict
from .confirm import BALANCED_PP, CONFIRM_ROUNDS, Contender, SampleLog, confirmed_record, schedule, vram_of
from .baselines import NCMOE_TRIES, flag_plan, ncmoe_split, smallest_ncmoe
from .cost_fit import CostFit, Terms, fit
from .interrupt import SIGINT
from ..engine import EngineFit, memory_model
from ..errors import InputError, OffloadTunerError
from ..hardware import GiB, MiB, HardwareProfile
from ..memory import MemoryReport
from ..model import ModelInventory
from .objectives import Objective, RequestTime, parse_objective, request_time
from .records import CandidateInfo, MeasuredRun, RecordWriter, TrialRecord
from ..plan import DEFAULT_CTX, Dialect, Plan, gpu_index, is_gpu
from ..engines import traits_of
from ..propose import Budget, best_plans, proposals
from .space import Candidate, Space, SpaceConfig
from ..bench_workload import BenchWorkload
from ..workload import Workload

log = logging.getLogger(__name__)

STUDIES_DIR = Path("studies")
HEARTBEAT_S = 10
GRACE_S = 30
SCHEMA_RETRIES = 5        # opening a storage that other workers are creating at the same moment
PATIENCE = 60              # trials in a row without a run before a session stops as converged
SCREEN_RATIO = 0.85        # measure a sampler candidate only if predicted >= this x the best measured
OOM_STEP = 256 * MiB       # an OOM raises the margin by at least this much
MARGIN_SLACK = 64 * MiB    # learnt margin = the memory model's worst under-prediction so far + this
SERVER_FIT = "--fit's placement in a server"   # llama-fit-params' pick for the whole workload, run as a plan
MAX_MARGIN_SHARE = 0.5     # ... but never above half of the smallest GPU
_OOM = re.compile(r"out of memory|\boom\b|cudaMalloc|failed to allocate|CUBLAS_STATUS_ALLOC_FAILED", re.I)


class MeasurementFailed(OffloadTunerError):
    """A run that failed for a reason of the run (OOM, crash, time limit): the trial is FAIL, the study goes on."""


class NotBeforeDeadline(OffloadTunerError):
    """A run not started because it would end past run()'s deadline: the trial is FAIL, its plan queued again."""


# ---- settings and storage -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What a study was made for; a resumed study must match (else it would mix incomparable trials)."""
    model: str
    model_id: str
    engine: str
    hardware: dict[str, Any]
    dialect: str
    objective: str
    workload: dict[str, int]
    n_ctx: int
    space: dict[str, Any]
    requests: dict[str, Any] | None = None     # the user's workload the time objective serves (None: other ones)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, other: dict[str, Any]) -> list[str]:
        """The settings that make `other` (a stored study's) another study. A space option added after the
        study was made is absent from it: the study ran with that option's default, so the default matches."""
        mine = self.to_dict()
        out = []
        for k in ("model_id", "engine", "hardware", "dialect", "objective", "workload", "n_ctx", "space", "requests"):
            theirs = other.get(k)
            if k == "space" and isinstance(theirs, dict):
                defaults = json.loads(json.dumps(asdict(SpaceConfig())))    # as stored: lists, not tuples
                theirs = {f: theirs.get(f, defaults.get(f)) for f in mine[k]}
            if theirs != mine[k]:
                out.append(k)
        return out


BUDGET_SHARES = (0.25, 0.5, 0.75, 1.0)
# SpaceConfig options that only widen the space, added after studies were stored: a study without one keeps its
# default (Tuner._keep_old_space). Not op_per_class: an old ik llama-bench study cannot go on without it.
LATER_SPACE_OPTIONS = ("no_host",)
# The knobs that repack the weights kept in RAM for the CPU's matmuls (TG up; those weights are never op-offloaded,
# so PP with experts in RAM falls): mainline's --no-host, ik's -rtr. Each has one probe per study, the best-TG run
# again with it on; the value is the probe trial's source (and the study attr is probed_<knob>).
REPACK_PROBES = {"no_host": "probe:no-host", "rtr": "probe:rtr"}
PROBE_NO_HOST, PROBE_RTR = REPACK_PROBES["no_host"], REPACK_PROBES["rtr"]


def budget_levels(total_vram: int) -> list[int]:
    """VRAM budgets the report lists a best config for: shares of all VRAM, rounded to whole GiB."""
    levels = sorted({max(GiB, int(round(total_vram * f / GiB)) * GiB) for f in BUDGET_SHARES})
    return [lv for lv in levels if lv <= max(total_vram, GiB)] or [total_vram]


def default_storage(study: str) -> str:
    return f"sqlite:///{STUDIES_DIR / (study + '.db')}"


def sqlite_path(url: str) -> Path | None:
    if url.startswith("sqlite:///"):
        p = url[len("sqlite:///"):]
        return None if p in ("", ":memory:") else Path(p)
    return None


def make_storage(url: str | None):
    """RDBStorage with heartbeat (stale RUNNING trials of a killed worker are failed and retried once);
    None: in-memory (benchmarks, tests)."""
    import optuna
    if url is None:
        return optuna.storages.InMemoryStorage()
    from .storage import check_sqlite_folder, resolve_url
    path = sqlite_path(url)
    kwargs: dict[str, Any] = {}
    if path is not None:
        check_sqlite_folder(path, create=path.parent == STUDIES_DIR)
        kwargs = {"connect_args": {"timeout": 60}}
    else:
        url = resolve_url(url)
    for attempt in range(SCHEMA_RETRIES + 1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                storage = optuna.storages.RDBStorage(
                    url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
            break
        except Exception as e:   # sqlalchemy.exc.ArgumentError, OperationalError, ImportError of a DB driver
            # workers started together on an empty database race to create Optuna's tables; the losers see
            # "duplicate key" / "already exists" and find the tables there on a second try
            text = str(e).lower()
            if attempt < SCHEMA_RETRIES and ("duplicate" in text or "already exists" in text
                                             or "unique constraint" in text):
                time.sleep(0.5 * (attempt + 1))
                continue
            raise InputError(f"cannot open storage {url}: {str(e).splitlines()[0]}") from e
    if path is not None:
        _sqlite_wal(storage.engine)
    return storage


def _sqlite_wal(engine) -> None:
    """WAL journal with synchronous=NORMAL: a commit no longer waits for fsync (a trial costs ~15 commits), and a
    killed process still loses no committed trial (only a power cut could lose the last ones)."""
    import sqlalchemy

    def pragmas(dbapi_conn, _record) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()
    sqlalchemy.event.listen(engine, "connect", pragmas)
    engine.dispose()          # connections opened while creating the tables predate the listener


def study_exists(storage, name: str) -> bool:
    return any(s.study_name == name for s in storage.get_all_studies())


def load_study(name: str, url: str | None):
    """An existing study (for `report`); InputError naming the studies there when it is missing."""
    import optuna
    path = sqlite_path(url) if url else None
    if path is not None and not path.exists():
        raise InputError(f"no study {name!r}: {path} does not exist (give --storage URL where the study lives)")
    storage = make_storage(url)
    names = [s.study_name for s in storage.get_all_studies()]
    if name not in names:
        raise InputError(f"no study {name!r} in {url}; studies there: {', '.join(names) or 'none'}")
    return optuna.load_study(study_name=name, storage=storage)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "study"


# ---- the tuner ------------------------------------------------------------------------------------------------

@dataclass
class _PoolEntry:
    params: dict[str, Any]
    plan_id: str
    terms: Terms
    gpu_bytes: dict[str, int]
    host_need: int
    n_ubatch: int


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
    """One study: `Tuner(...).run(n)` measures n more candidates (screened and duplicate trials do not count).

    `engine` is anything with the planner.engine.Engine protocol; `hw` the machine as the memory model and the
    cost model see it (the cost model's prior; for sim it is the engine's own). `prescreen` (default: the engine
    is not sim) skips sampler candidates the refitted cost model predicts to be poor; `surrogate` enqueues the
    pool's best candidate every other trial; `seed_trials` enqueues proposals, the predicted front and the
    best-per-budget candidates. Switching those three off (and sampler="random") gives the plain baselines the
    benchmark compares with. `storage` None keeps the study in memory."""

    def __init__(self, inv: ModelInventory, hw: HardwareProfile, engine: Any, *, model: str = "",
                 objective: Objective | str = "tg", workload: BenchWorkload = BenchWorkload(n_prompt=2048),
                 dialect: Dialect = "mainline",
                 n_ctx: int | None = None, margin: int | None = None, config: SpaceConfig = SpaceConfig(),
                 study_name: str = "study", storage: str | None = None, fresh: bool = False, seed: int = 0,
                 prescreen: bool | None = None, surrogate: bool = True, seed_trials: bool = True,
                 sampler: str = "tpe", pool_size: int = 200, baselines: bool = True, commands: bool = True,
                 space: Space | None = None, requests: Workload | None = None) -> None:
        import optuna
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self.inv, self.hw, self.engine = inv, hw, engine
        # the memory model that judges this engine's plans: its own prediction where it has one (the torch engine),
        # else planner.memory's (llama.cpp's memory; the sim engine's own)
        self.estimate = memory_model(engine, workload)
        self.objective = parse_objective(objective) if isinstance(objective, str) else objective
        self.workload, self.dialect = workload, dialect
        if self.objective.kind == "time" and requests is None:
            raise InputError("objective time needs the workload's request classes: say --workload (chat, agent, rag, "
                             "batch, or a file)")
        self.requests = requests if self.objective.kind == "time" else None
        need = workload.depth + workload.n_prompt + workload.n_gen
        self.n_ctx = n_ctx if n_ctx is not None else max(DEFAULT_CTX, -(-need // 256) * 256)
        if self.n_ctx < need:
            raise InputError(f"--ctx {self.n_ctx} is smaller than the workload's depth + n_prompt + n_gen = {need}")
        self.config, self.seed, self.rng = config, seed, random.Random(seed)
        traits = traits_of(engine)
        self.prescreen = traits.measured if prescreen is None else prescreen
        self.surrogate, self.seed_trials = surrogate, seed_trials
        self.pool_size, self.want_baselines = pool_size, baselines
        self.study_name, self.storage_url = study_name, storage
        if margin is not None and margin < 0:
            raise InputError(f"--margin must be >= 0, got {margin}")
        # the budget runs are judged against: VRAM minus the margin asked for (none when the margin is learnt)
        self.margin_asked = margin
        self.margin_initial = margin if margin is not None else 0
        prior = margin if margin is not None else traits.memory_error_prior
        # the context the engine's run holds (llama-bench: the prompt test's); the emitted commands hold n_ctx.
        # An engine without run_context (sim: the memory model at n_ctx) measures at n_ctx itself.
        run_context = getattr(engine, "run_context", None)
        self.run_ctx = min(run_context(workload), self.n_ctx) if run_context else self.n_ctx
        # llama-sweep-bench's context follows the plan's ubatch (one row of it): such engines take the plan
        self._run_ctx_of_plan = run_context if run_context and "plan" in inspect.signature(run_context).parameters \
            else None
        self.settings = Settings(model=model or inv.source or inv.name, model_id=inv.source or inv.name,
                                 engine=getattr(engine, "name", type(engine).__name__), hardware=_hw_key(hw),
                                 dialect=dialect, objective=self.objective.text, workload=asdict(workload),
                                 n_ctx=self.n_ctx, space=config.to_dict(),
                                 requests=self.requests.to_dict() if self.requests is not None else None)
        self._margin_prior = prior
        self.study = self._open(fresh, sampler)
        attrs = self.study.user_attrs
        # a learnt margin is per ubatch (`ubatch_margins`, from the runs at that ubatch); an ubatch without runs
        # yet is held to the prior (or what an out-of-memory raised the floor to); a fixed margin is one number
        if margin is None:
            self.margin = max(prior, int(attrs.get("margin_floor", 0)))
            self.ubatch_margins = {int(k): int(v) for k, v in attrs.get("margin_by_ubatch", {}).items()}
        else:
            self.margin, self.ubatch_margins = max(margin, int(attrs.get("margin_bytes", margin))), {}
        self.want_commands = commands
        self.max_seeds: int | None = None      # run() caps the seed trials of an expensive engine
        config = self.config        # _open may have kept a resumed study's space (LATER_SPACE_OPTIONS)
        if space is not None and (space.margin, space.ubatch_margins, space.config, space.n_ctx, space.dialect) == \
                (self.margin, self.ubatch_margins, config, self.n_ctx, dialect) and space.estimate is self.estimate:
            self.space = space          # a prepared one (benchmarks share a cached grid between methods)
        else:
            self.space = Space(inv, hw, dialect=dialect, n_ctx=self.n_ctx, margin=self.margin, config=config,
                               memory=self.estimate, ubatch_margins=self.ubatch_margins)
        if self.requests is not None:
            self.objective = self.objective.with_request(self._request_time(attrs))
        self.fit = CostFit.from_dict(attrs.get("cost_fit"))
        self.pool: dict[str, _PoolEntry] = {}
        self.measured: dict[str, tuple[int, tuple[float, ...] | None]] = {}   # plan id -> (trial, values)
        self.samples: list[tuple[Terms, float, float]] = []
        self.n_measured = 0
        self.n_trials_session = 0
        self.idle = 0                 # trials in a row that ran nothing (screened, duplicate, over budget)
        self._deadline: float | None = None     # run()'s, for the trial about to measure
        self._deadline_stop = ""
        self._queued_ids: set[str] = set()
        # baseline runs by plan id: a trial of the same plan takes its measurement instead of running it again
        self._baseline_runs = {b["plan_id"]: MeasuredRun.from_dict(b["measured"]) for b in attrs.get("baselines", [])
                               if b.get("plan_id") and b.get("measured")}
        self._load_history()

    # ---- study ----------------------------------------------------------------------------------------------

    def _sampler(self, kind: str):
        import optuna
        if kind == "random":
            return optuna.samplers.RandomSampler(seed=self.seed)
        if kind != "tpe":
            raise InputError(f"unknown sampler {kind!r}; expected tpe or random")
        return optuna.samplers.TPESampler(seed=self.seed, multivariate=True, group=True, n_startup_trials=10,
                                          constant_liar=True)

    def _open(self, fresh: bool, sampler: str):
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
                old = study.user_attrs.get("settings")
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
        study.set_user_attr("settings", self.settings.to_dict())
        study.set_user_attr("objective_names", self.objective.names)
        with warnings.catch_warnings():      # experimental in Optuna; optuna-dashboard titles its plots with them
            warnings.simplefilter("ignore")
            study.set_metric_names(list(self.objective.names))
        study.set_user_attr("margin_bytes", self._margin_prior)
        study.set_user_attr("margin_rule", "learnt" if self.margin_asked is None else "fixed")
        study.set_user_attr("created", time.strftime("%Y-%m-%d %H:%M:%S"))
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

    # ---- predictions and the pool ---------------------------------------------------------------------------

    def terms(self, plan: Plan) -> Terms:
        w = self.workload
        return Terms.of(predict(self.inv, plan, self.hw, n_prompt=max(w.n_prompt, 1), depth=w.depth))

    def _score(self, tg: float, pp: float) -> float:
        """One number per point (the objective; the geometric mean for "both"); a speed the workload does not
        measure (n_gen or n_prompt 0) counts as 0."""
        return self.objective.scalar(tg if self.workload.n_gen else 0.0, pp if self.workload.n_prompt else 0.0)

    def _add_pool(self, cand: Candidate) -> None:
        if not cand.fits or cand.key in self.pool or cand.memory is None:
            return
        cpu = cand.memory.devices.get("CPU")
        host = cand.memory.host_pinned + (cpu.kv + cpu.compute + cpu.overhead if cpu else 0)
        self.pool[cand.key] = _PoolEntry(dict(cand.params), cand.key, self.terms(cand.plan), cand.gpu_bytes(), host,
                                         cand.plan.knobs.n_ubatch)

    def _fits_now(self, e: _PoolEntry) -> bool:
        b = self.space.budget_for(e.n_ubatch)
        return e.host_need <= b.host and all(v <= b.gpus.get(d, 0) for d, v in e.gpu_bytes.items())

    def build_pool(self) -> None:
        for _ in range(self.pool_size):
            self._add_pool(self.space.decode(self.space.random(self.rng)))

    def _add_neighbours(self, params: dict[str, Any], limit: int = 40) -> None:
        nb = self.space.neighbours(params)
        self.rng.shuffle(nb)
        for p in nb[:limit]:
            self._add_pool(self.space.decode(self.space.fixed(p, default=lambda d: d.values[0])))

    def _measured_points(self) -> list[tuple[float, float]]:
        return [(tg, pp) for _, tg, pp in self.samples]

    def _pick(self, k: int = 1, optimism: float = 1.03) -> list[_PoolEntry]:
        """The pool's best unmeasured, not yet queued candidates under the refitted cost model: by predicted
        objective, or (for "both") by predicted hypervolume improvement over the measured front."""
        cands = [e for e in self.pool.values() if e.plan_id not in self.measured and e.plan_id not in self._queued_ids
                 and self._fits_now(e)]
        if not cands:
            return []
        tg, pp = self.fit.predict_many([e.terms for e in cands])
        # candidates the model cannot tell apart from a measured plan (knobs it does not price) wait for the sampler
        mtg, mpp = self.fit.predict_many([t for t, _, _ in self.samples])
        seen = {_bin(a, b) for a, b in zip(mtg, mpp)}
        keep = [i for i in range(len(cands)) if _bin(tg[i], pp[i]) not in seen]
        cands, tg, pp = [cands[i] for i in keep], tg[keep], pp[keep]
        if not cands:
            return []
        if self.objective.kind == "both":
            front = _front(self._measured_points())
            scale = (max([p[0] for p in front] + [float(tg.max()), 1e-9]),
                     max([p[1] for p in front] + [float(pp.max()), 1e-9]))
            scaled_front = [(x / scale[0], y / scale[1]) for x, y in front]
            scores = [_hvi((a * optimism / scale[0], b * optimism / scale[1]), scaled_front)
                      for a, b in zip(tg, pp)]
        else:
            scores = [self._score(a, b) for a, b in zip(tg, pp)]
        order = sorted(range(len(cands)), key=lambda i: -scores[i])
        if self.samples:
            if self.objective.kind == "both" and scores[order[0]] <= 0:
                return []     # the model expects nothing of the pool to extend the measured front
            if self.objective.kind != "both" and not self._promising(tg[order[0]], pp[order[0]])[0]:
                return []
        return [cands[i] for i in order[:k]]

    def _front_seeds(self, k: int) -> list[_PoolEntry]:
        """The cost model's predicted Pareto front (or top-k) of the pool, spread along the front."""
        cands = [e for e in self.pool.values() if self._fits_now(e)]
        if not cands:
            return []
        tg, pp = self.fit.predict_many([e.terms for e in cands])
        if self.objective.kind != "both":
            order = sorted(range(len(cands)), key=lambda i: -self._score(tg[i], pp[i]))
            return [cands[i] for i in order[:k]]
        idx = _front_indices(list(zip(tg.tolist(), pp.tolist())))
        idx.sort(key=lambda i: tg[i])
        if len(idx) <= k:
            return [cands[i] for i in idx]
        picks = sorted({round(j * (len(idx) - 1) / (k - 1)) for j in range(k)})
        return [cands[idx[j]] for j in picks]

    def _budget_seeds(self) -> list[tuple[int, _PoolEntry]]:
        """For each smaller VRAM budget of the report (a quarter, half, three quarters of all VRAM), the pool's
        best predicted candidate that stays under it: the report's best-per-budget rows get measured points."""
        total = sum(g.vram_bytes for g in self.hw.gpus)
        out = []
        for level in budget_levels(total)[:-1]:
            cands = [e for e in self.pool.values() if self._fits_now(e) and sum(e.gpu_bytes.values()) <= level]
            if not cands:
                continue
            tg, pp = self.fit.predict_many([e.terms for e in cands])
            if self.objective.kind == "both":     # the report lists the best TG and the best PP per budget
                keys = [lambda j, tg=tg, pp=pp: (tg[j], pp[j]), lambda j, tg=tg, pp=pp: (pp[j], tg[j])]
            else:
                keys = [lambda j, tg=tg, pp=pp: self._score(tg[j], pp[j])]
            for key in keys:
                out.append((level, cands[max(range(len(cands)), key=key)]))
        return out

    def _request_time(self, attrs: dict[str, Any]) -> RequestTime:
        """The time objective's per-class speeds (objectives.request_time), computed once per study on the
        planner's pick for the budget and stored, so a resumed study scores its trials as before."""
        if "request_time" in attrs:
            return RequestTime.from_dict(attrs["request_time"])
        knobs = self._default_knobs()
        try:
            plan = best_plans(self.inv, self.hw, knobs, self.dialect, "balanced", self.space.margin_for(knobs.n_ubatch),
                              n_prompt=max(self.workload.n_prompt, 1))[0].plan
        except (InputError, IndexError):    # nothing fits the budget: the ratios of the model on the CPU alone
            plan = Plan(self.inv.source or self.inv.name, {t.name: "CPU" for t in self.inv.allocated()}, knobs,
                        self.dialect)
        rt = request_time(self.inv, self.hw, plan, self.requests, self.workload)
        self.study.set_user_attr("request_time", rt.to_dict())
        return rt

    # ---- seeding and baselines ------------------------------------------------------------------------------

    def _objective_for_planner(self) -> str:
        return {"tg": "tg", "pp": "pp"}.get(self.objective.kind, "balanced")

    def _default_knobs(self):
        return self.space.knobs(self.space.fixed(self.space.default_params()))

    def enqueue_seeds(self) -> int:
        """Enqueue the planner's proposals and the cost model's predicted front (once per study)."""
        if self.study.user_attrs.get("seeded"):
            return 0
        seeds: list[tuple[dict[str, Any], str]] = self._fill_max_seeds()
        try:
            knobs = self._default_knobs()
            ranked = best_plans(self.inv, self.hw, knobs, self.dialect, self._objective_for_planner(),
                                self.space.margin_for(knobs.n_ubatch), n_prompt=max(self.workload.n_prompt, 1))
        except InputError:
            ranked = []
        for s in ranked[:6]:
            seeds.append((self.space.proposal_params(s.proposal), f"proposal:{s.proposal.label}"))
        seeds.append((self.space.default_params(), "default"))
        for e in self._front_seeds(6):
            seeds.append((e.params, "cost-front"))
        for level, e in self._budget_seeds():
            seeds.append((e.params, f"budget:{level / GiB:.0f}GiB"))
        n, seen = 0, set(self._queued_ids)
        for params, source in seeds:
            if self.max_seeds is not None and n >= self.max_seeds:
                break
            cand = self.space.decode(self.space.fixed(self.space.legal(params), default=lambda d: d.values[0]))
            self._add_pool(cand)
            if not cand.fits or cand.key in seen:
                continue
            seen.add(cand.key)
            self._enqueue(cand.params, cand.key, source)
            n += 1
        self.study.set_user_attr("seeded", True)
        return n

    def _fill_max_seeds(self) -> list[tuple[dict[str, Any], str]]:
        """Every GPU filled with experts as far as the budget goes: for TG at the smallest ubatch (the least
        compute buffer, so the most experts; llama-bench's generation test caps its ubatch at its context anyway)
        and at 512; for PP at the largest two ubatches. TG rises with every expert tensor moved to VRAM, so these
        are where a TG study ends up."""
        d = self.space.dims
        if not any(name.startswith("fill.") for name in d):
            return []
        # the default (full-precision) KV: on the H100 runs of issue 10 a q8_0 cache cost ~10% TG at the same
        # placement (flash-attention decode over a quantized cache), more than the experts its room bought
        kv = self.space.default_params()["kv"]
        ubs = list(d["ubatch_log2"].values)
        wanted = [(ubs[0], "tg"), (d["ubatch_log2"].snap(9), "tg"), (ubs[-1], "pp"), (ubs[max(len(ubs) - 2, 0)], "pp")]
        if self.objective.kind == "pp":
            wanted.reverse()
        out = []
        for ub, why in dict.fromkeys(wanted):
            p = self.space.default_params()
            p.update({f"fill.{g}": 1.0 for g in self.space.gpus}, kv=kv, ubatch_log2=ub, order="last", partial=True)
            out.append((p, f"fill-max:{why}"))
        return out

    def _enqueue(self, params: dict[str, Any], plan_id: str, source: str, again: bool = False) -> None:
        """Queue a candidate (once: a trial of the same params skips it, unless `again`, for one not run)."""
        self.study.enqueue_trial(params, user_attrs=TrialRecord(source=source, plan_id=plan_id).to_attrs(),
                                 skip_if_exists=not again)
        self._queued_ids.add(plan_id)

    def baselines(self, deadline: float | None = None) -> list[dict[str, Any]]:
        """Measure the reference points once per study (planner.tuner.baselines): the engine's own --fit (or, for an
        engine without one, the --fit-like fill, labelled an imitation), -ngl 99 -cmoe, and the best -ngl 99
        -ncmoe N that fits. Each record is stored as it is made (a killed study resumes after the last one); once
        time.monotonic() passes `deadline` no further one starts (the list comes back unfinished, the study attr
        `baselines` unset: the next call goes on where this one stopped)."""
        if "baselines" in self.study.user_attrs or not self.want_baselines:
            return self.study.user_attrs.get("baselines", [])
        out: list[dict[str, Any]] = list(self.study.user_attrs.get("baselines_partial", []))
        done = {b["name"] for b in out}

        def keep(rec: dict[str, Any]) -> None:
            out.append(rec)
            self.study.set_user_attr("baselines_partial", out)

        def late() -> bool:
            return deadline is not None and time.monotonic() >= deadline

        knobs = self._default_knobs()
        own_fit = getattr(self.engine, "own_fit", None)
        if own_fit is not None and "--fit" not in done and "--fit-like fill (imitation)" not in done:
            fit = own_fit(self.inv, self.workload, Budget.from_hardware(self.hw, self.margin_initial).gpus)
            if fit is not None:
                keep(self._fit_record(fit))
                done.add("--fit")
                if fit.chosen_args:
                    try:
                        plan = flag_plan(self.inv, list(fit.chosen_args), knobs, self.dialect, self.settings.model_id,
                                         self._n_gpus)
                        keep(self._plan_record(SERVER_FIT, "engine-fit-server", plan, judged=False))
                    except InputError as e:
                        keep(self._plan_record(SERVER_FIT, "engine-fit-server", None, str(e)))
        if late():
            return out
        if "--fit" not in done and "--fit-like fill (imitation)" not in done:
            try:
                margin = self.space.margin_for(knobs.n_ubatch)
                fitlike = next((p.plan for p in proposals(self.inv, self.hw, knobs, self.dialect, margin)
                                if p.strategy == "experts-cpu+fill" and p.order == "last"), None)
                keep(self._plan_record("--fit-like fill (imitation)", "fit-like", fitlike,
                                       "" if fitlike else "no experts-cpu proposal"))
            except InputError as e:
                keep(self._plan_record("--fit-like fill (imitation)", "fit-like", None, str(e)))
        if late():
            return out
        if "-ngl 99 -cmoe" not in done:
            try:
                plan = flag_plan(self.inv, ["-ngl", "99", "-cmoe"], knobs, self.dialect, self.settings.model_id,
                                 self._n_gpus)
                keep(self._plan_record("-ngl 99 -cmoe", "cmoe", plan))
            except InputError as e:
                keep(self._plan_record("-ngl 99 -cmoe", "cmoe", None, str(e)))
        if late():
            return out
        if not any(b.get("kind") == "ncmoe" for b in out):
            keep(self._ncmoe_record(knobs))
        self.study.set_user_attr("baselines", out)
        self._refit()
        return out

    def redo_references(self) -> list[str]:
        """Measure again the reference baselines that never ran (llama.cpp's placement in a server refused by a
        budget check that studies before this one applied to it), and drop the confirmation so the next
        `confirm` interleaves them. Returns the names re-measured."""
        base = list(self.study.user_attrs.get("baselines", []))
        fit = next((b for b in base if b.get("kind") == "engine-fit" and b.get("chosen_args")), None)
        redone = []
        for i, b in enumerate(base):
            if b.get("kind") == "engine-fit-server" and not b.get("ok") and fit is not None:
                try:
                    plan = flag_plan(self.inv, list(fit["chosen_args"]), self._default_knobs(), self.dialect,
                                     self.settings.model_id, self._n_gpus)
                    base[i] = self._plan_record(SERVER_FIT, "engine-fit-server", plan, judged=False)
                except InputError as e:
                    base[i] = self._plan_record(SERVER_FIT, "engine-fit-server", None, str(e))
                redone.append(SERVER_FIT)
        if redone:
            self.study.set_user_attr("baselines", base)
            for key in ("confirmed", "confirmation"):
                if key in self.study.user_attrs:
                    self.study.set_user_attr(f"{key}_before_redo", self.study.user_attrs[key])
                    self.study.set_user_attr(key, None)
        return redone

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
            rec["over_budget"] = self._over(dict(m.peak_bytes))
        rec.update(measured=_mdict(m), ok=bool(m.ok), error=m.error, runs=1, plan=plan.to_json())
        if not m.ok and _OOM.search(m.error or ""):
            self._raise_margin(plan, m.error)
        if judged:     # a trial of the same plan takes this run (an unjudged one may be over the budget)
            self._baseline_runs[plan.id] = MeasuredRun.from_dict(_mdict(m))
        if m.ok:
            self.samples.append((self.terms(plan), m.tg_tps, m.pp_tps))
        return rec

    def _over_budget(self, plan: Plan, mem: MemoryReport | None = None) -> str:
        """'' when the memory model keeps `plan` within the budget its ubatch is held to; else why not."""
        return self.space.over_budget(mem or self.estimate(self.inv, plan, self.hw), n_ubatch=plan.knobs.n_ubatch)

    def _over(self, peaks: dict[str, int]) -> str:
        """Which GPUs a reference run's peaks put over the budget ('' when none)."""
        budget = Budget.from_hardware(self.hw, self.margin_initial).gpus
        return "; ".join(f"{d} {v / MiB:.0f} MiB > {budget[d] / MiB:.0f} MiB" for d, v in sorted(peaks.items())
                         if d in budget and v > budget[d])

    @property
    def _n_gpus(self) -> int | None:
        """The GPUs a baseline's command line spreads over when it has no -ts (None: one GPU, as the line says)."""
        return len(self.hw.gpus) if len(self.hw.gpus) > 1 else None

    def _ncmoe_record(self, knobs) -> dict[str, Any]:
        """The best -ngl 99 -ncmoe N: the memory model's smallest N that fits, then N+1.. while runs measure
        over the budget (NCMOE_TRIES runs at most). Several GPUs: the best hand -ncmoe N -ts a,b
        (baselines.ncmoe_split)."""
        if self._n_gpus:
            return self._ncmoe_split_record(knobs)

        def fits(plan: Plan) -> bool:
            return not self._over_budget(plan)
        n = smallest_ncmoe(self.inv, knobs, self.dialect, self.settings.model_id, fits)
        if n is None:
            return {"name": "best -ncmoe", "kind": "ncmoe", "ok": False, "runs": 0,
                    "error": "not run: not even -ncmoe with every layer fits the budget"}
        runs, rec = 0, {}
        for k in range(n, min(n + NCMOE_TRIES, self.inv.n_layer + 1)):
            plan = flag_plan(self.inv, ["-ngl", "99", "-ncmoe", str(k)], knobs, self.dialect, self.settings.model_id)
            rec = self._plan_record(f"-ngl 99 -ncmoe {k}", "ncmoe", plan)
            runs += rec.get("runs", 0)
            rec.update(runs=runs, ncmoe=k)
            if rec["ok"] or not rec.get("runs") or "over the budget" not in (rec.get("error") or ""):
                break
        return rec

    def _ncmoe_split_record(self, knobs) -> dict[str, Any]:
        """Several GPUs: -ngl 99 -ncmoe N -ts a,b with the smallest N that fits and the -ts that leaves the most
        room on the fuller GPU, then the next N (its own -ts) while runs measure over the budget."""

        def headroom(plan: Plan) -> int | None:
            mem = self.estimate(self.inv, plan, self.hw)
            if self._over_budget(plan, mem).startswith("host"):
                return -1
            budget = self.space.budget_for(plan.knobs.n_ubatch).gpus
            return min(budget[g] - mem.gpu_total(g) for g in budget)
        runs, rec, start = 0, {}, 0
        for _ in range(NCMOE_TRIES):
            found = ncmoe_split(self.inv, knobs, self.dialect, self.settings.model_id, headroom, len(self.hw.gpus),
                                start)
            if found is None:
                if not rec:
                    return {"name": "best -ncmoe -ts", "kind": "ncmoe", "ok": False, "runs": 0,
                            "error": "not run: not even -ncmoe with every layer fits the budget"}
                break
            n, ts = found
            args = ["-ngl", "99", "-ncmoe", str(n)] + (["-ts", ",".join(map(str, ts))] if ts else [])
            plan = flag_plan(self.inv, args, knobs, self.dialect, self.settings.model_id, self._n_gpus)
            rec = self._plan_record(" ".join(args), "ncmoe", plan)
            runs += rec.get("runs", 0)
            rec.update(runs=runs, ncmoe=n, ts=list(ts) if ts else None)
            if rec["ok"] or not rec.get("runs") or "over the budget" not in (rec.get("error") or ""):
                break
            start = n + 1
        return rec

    def _fit_record(self, fit: EngineFit) -> dict[str, Any]:
        """The engine's own --fit: its run (kept as measured; judged against the budget only to say so) and the
        arguments to run it again."""
        from ..flags.common import shell_join
        m = fit.measurement
        rec: dict[str, Any] = {
            "name": "--fit", "kind": "engine-fit", "ok": bool(m.ok), "error": str(m.error or ""), "runs": 1,
            "measured": _mdict(m), "argv": list(fit.argv), "env": dict(fit.env), "target_bytes": fit.target_bytes,
            "chosen_args": list(fit.chosen_args), "note": fit.note, "over_budget": self._over(dict(m.peak_bytes)),
            # keyed "llama-bench" (the benchmark's line) whatever the program: ik's is llama-sweep-bench
            "commands": {"llama-bench": shell_join([fit.program, *fit.argv], fit.env)},
            "label": "llama.cpp's own --fit" + (f" ({fit.note})" if fit.note else "")}
        if fit.chosen_args:
            rec["commands"]["llama-server"] = shell_join(["llama-server", "-m", "MODEL.gguf", *fit.chosen_args])
        return rec

    def _describe(self, plan: Plan, terms: Terms | None = None, memory: Any = None) -> dict[str, Any]:
        from ..flags import render_shell
        cmds: dict[str, str] = {}
        model_path = "MODEL.gguf" if self.settings.model.startswith("preset:") else self.settings.model
        for tool in ("server", "cli", "bench") if self.want_commands else ():
            try:
                cmds[f"llama-{tool}"] = render_shell(plan, self.inv, tool, model_path=model_path,
                                                     workload=self.workload if tool == "bench" else None)
            except InputError as e:
                cmds[f"llama-{tool}"] = f"# not expressible for llama-{tool}: {e}"
            except Exception as e:    # a renderer bug must not end the study; the trial says what happened
                cmds[f"llama-{tool}"] = f"# could not render for llama-{tool}: {type(e).__name__}: {e}"
        terms = terms or self.terms(plan)
        tg_fit, pp_fit = self.fit.predict(terms)
        tg_prior, pp_prior = CostFit().predict(terms)
        return {"plan_id": plan.id, "label": plan.label, "commands": cmds, "terms": terms,
                "predicted": {"tg_tps": tg_fit, "pp_tps": pp_fit, "prior_tg_tps": tg_prior, "prior_pp_tps": pp_prior},
                "memory": (memory or self.estimate(self.inv, plan, self.hw)).to_dict()}

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
        GPU's budget, a failed result that keeps the measured speeds and peaks. Every successful run teaches the
        learnt margin the memory model's error; with a fixed margin an over-budget run raises it by at least the
        excess (as an out-of-memory does). The worst GPU (largest excess) names the error.

        The budget here is VRAM minus the margin the study was asked for (none when the margin is learnt), not
        the current one: the current margin is the memory model's allowance for its own error, and judging runs
        against it would ratchet (an engine that holds a constant X bytes more than predicted would exceed every
        budget the margin moves to, by X, until the margin reached its cap)."""
        if not m.ok:
            return m
        measured = {k: int(v) for k, v in dict(m.peak_bytes).items()}
        peaks = self.peaks_at_ctx(plan, measured)
        predicted = self.estimate(self.inv, plan, self.hw).devices
        gap = max((p - predicted[d].total for d, p in peaks.items() if d in predicted), default=None)
        if gap is not None and self.margin_asked is None:
            self._learn_margin(plan, gap)
        budget = Budget.from_hardware(self.hw, self.margin_initial).gpus
        worst: tuple[int, str, int, int] | None = None
        for dev, peak in sorted(peaks.items()):
            have = budget.get(dev)
            if have is not None and peak > have and (worst is None or peak - have > worst[0]):
                worst = (peak - have, dev, int(peak), have)
        result = MeasuredRun(error="", ok=True, pp_tps=float(m.pp_tps), tg_tps=float(m.tg_tps), peak_bytes=measured,
                         host_bytes=int(m.host_bytes), peak_at_ctx=peaks if peaks != measured else {},
                         cv=dict(getattr(m, "raw", {}) or {}).get("cv"),
                         seen=str(dict(getattr(m, "raw", {}) or {}).get("seen", "")),
                         seconds=MeasuredRun.from_measurement(m).seconds)
        if worst is None:
            return result
        excess, dev, peak, have = worst
        vram = self.hw.gpu(dev).vram_bytes
        at = f" at -c {self.n_ctx}" if peaks != measured else ""
        error = (f"measured peak {peak / GiB:.2f} GiB{at} on {dev} over the budget {have / GiB:.2f} GiB "
                 f"(VRAM {vram / GiB:.2f} GiB - margin {(vram - have) / MiB:.0f} MiB)")
        # later candidates are held to VRAM - (the asked margin + the model's error on this run), which this plan
        # no longer fits (a learnt margin has just taken that error in)
        if self.margin_asked is not None:
            self._raise_margin(plan, error, at_least=self.margin_initial + max(gap or 0, 0))
        return replace(result, ok=False, error=error)

    def _learn_margin(self, plan: Plan, gap: int) -> None:
        """The learnt margin of the plan's ubatch: the worst under-prediction (measured - predicted peak, worst
        GPU) seen at that ubatch in this study plus MARGIN_SLACK, never below what an out-of-memory raised the
        floor to. It moves both ways: a memory model exact at some ubatch frees its prior allowance for experts
        there. Per ubatch because the error is the compute buffer's: on the H100 (tune_vs_fit, 327 runs) the
        model never under-predicted by more than 4 MiB at ubatch <= 1024, by up to 29 MiB at 2048 and by up to
        92 MiB at 4096 with a deep context, so one margin learnt at 512 put a first 4096 run over its budget."""
        attrs = self.study.user_attrs
        ub = plan.knobs.n_ubatch
        self.study.set_user_attr("memory_errors", [*attrs.get("memory_errors", []), int(gap)])
        by_ub = {k: list(v) for k, v in attrs.get("memory_errors_by_ubatch", {}).items()}
        errors = by_ub.setdefault(str(ub), [])
        errors.append(int(gap))
        self.study.set_user_attr("memory_errors_by_ubatch", by_ub)
        cap = int(MAX_MARGIN_SHARE * min(g.vram_bytes for g in self.hw.gpus)) if self.hw.gpus else 0
        worst = max(errors)
        # an engine the model never under-predicts (sim) needs no slack either
        new = min(max(worst + MARGIN_SLACK if worst > 0 else 0, int(attrs.get("margin_floor", 0))), cap)
        if new != self.ubatch_margins.get(ub):
            self._set_margin(new, plan, f"ubatch {ub}: memory model error {gap / MiB:+.0f} MiB (worst at this "
                                        f"ubatch {worst / MiB:+.0f} MiB) + {MARGIN_SLACK // MiB} MiB", ubatch=ub)

    def _set_margin(self, new: int, plan: Plan, why: str, ubatch: int | None = None) -> None:
        """The margin of one ubatch (learnt), or the default one (an unmeasured ubatch's, or a fixed margin)."""
        events = list(self.study.user_attrs.get("margin_events", []))
        before = self.margin if ubatch is None else self.ubatch_margins.get(ubatch, self.margin)
        events.append({"from": before, "to": new, "plan_id": plan.id, "error": why[:200], "ubatch": ubatch})
        if ubatch is None:
            self.margin = new
        else:
            self.ubatch_margins[ubatch] = new
        # both, always: _raise_margin may have floored other ubatches' margins before calling this
        self.study.set_user_attr("margin_bytes", self.margin)
        self.study.set_user_attr("margin_by_ubatch", {str(k): v for k, v in sorted(self.ubatch_margins.items())})
        self.study.set_user_attr("margin_events", events)
        self.space = Space(self.inv, self.hw, dialect=self.dialect, n_ctx=self.n_ctx, margin=self.margin,
                           config=self.config, memory=self.estimate, ubatch_margins=self.ubatch_margins)

    def _raise_margin(self, plan: Plan, error: str, at_least: int = 0) -> None:
        """Raise the margin (for every later trial) so that `plan` no longer fits any GPU it failed on: by the
        predicted shortfall plus OOM_STEP, by at least OOM_STEP, and to at least `at_least` bytes; capped at
        MAX_MARGIN_SHARE of the smallest GPU. A learnt margin keeps it as the floor of every ubatch's."""
        mem = self.estimate(self.inv, plan, self.hw)
        step = OOM_STEP
        for dev, m in mem.devices.items():
            if is_gpu(dev) and gpu_index(dev) < len(self.hw.gpus):
                step = max(step, self.hw.gpu(dev).vram_bytes - m.total + OOM_STEP)
        current = self.space.margin_for(plan.knobs.n_ubatch)
        cap = int(MAX_MARGIN_SHARE * min(g.vram_bytes for g in self.hw.gpus)) if self.hw.gpus else current
        new = min(max(current + OOM_STEP, step, at_least), max(cap, current))
        if new <= current:
            return
        ub = plan.knobs.n_ubatch
        if self.margin_asked is None:
            self.study.set_user_attr("margin_floor", new)
            for k, m in list(self.ubatch_margins.items()):
                if m < new and k != ub:       # the plan's own: _set_margin below, with its event
                    self.ubatch_margins[k] = new
            if ub in self.ubatch_margins:
                self._set_margin(new, plan, error, ubatch=ub)
        if new > self.margin:                 # a fixed margin, or the floor now above an unmeasured ubatch's
            self._set_margin(new, plan, error)

    def _refit(self) -> None:
        if self.samples:
            self.fit = fit(self.samples)
            self.study.set_user_attr("cost_fit", self.fit.to_dict())

    def _promising(self, tg: float, pp: float) -> tuple[bool, str]:
        pts = self._measured_points()
        if not pts:
            return True, ""
        if self.objective.kind == "both":
            for mt, mp in pts:
                if tg <= SCREEN_RATIO * mt and pp <= SCREEN_RATIO * mp:
                    return False, (f"screened: predicted TG {tg:.2f} / PP {pp:.1f} t/s is dominated by measured "
                                   f"{mt:.2f} / {mp:.1f} with a {1 - SCREEN_RATIO:.0%} allowance")
            return True, ""
        best = max(self._score(a, b) for a, b in pts)
        s = self._score(tg, pp)
        if best > 0 and s < SCREEN_RATIO * best:
            return False, (f"screened: predicted {self.objective.text} {s:.4g} < {SCREEN_RATIO} x best measured "
                           f"{best:.4g}")
        return True, ""

    def objective_fn(self, trial) -> float | tuple[float, ...]:
        import optuna
        self.n_trials_session += 1
        rec = RecordWriter(trial)       # an enqueued trial's record holds its source; the sampler's says "sampler"
        source = rec.update().source
        cand = self.space.decode(lambda dim: dim.suggest(trial))
        self._add_pool(cand)
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
            ok, why = self._promising(pred["tg_tps"], pred["pp_tps"])
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
        improved = self._improves(m.tg_tps, m.pp_tps)
        self.measured[plan.id] = (trial.number, values)
        if reused is None:            # the baseline's run is in the samples already
            self.samples.append((terms, m.tg_tps, m.pp_tps))
        self._refit()
        if improved and self.surrogate:
            self._add_neighbours(cand.params, 40 if self.prescreen else 12)
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
                 for b in self.study.user_attrs.get("baselines", [])
                 if (b.get("measured") or {}).get("seconds") and b["measured"].get("ok", True)]
        fixed = max(0.0, statistics.median(rest)) if rest else 0.0
        return 1.2 * (fixed + self.workload.token_seconds(pp_tps, tg_tps))

    def _start_before_deadline(self, trial, plan: Plan, source: str, pred: dict[str, float]) -> None:
        """Raise NotBeforeDeadline (and stop the study) when this run, at its predicted speeds, would end past
        run()'s deadline: a device call cut off mid-run loses the run; queued again, a later call runs it."""
        if self._deadline is None:
            return
        need, left = self.run_seconds(pred["tg_tps"], pred["pp_tps"]), self._deadline - time.monotonic()
        if need <= left:
            return
        self._enqueue(trial.params, plan.id, source, again=True)     # this very trial has the same params
        self._deadline_stop = (f"stopped at the deadline: the next run needs ~{need:.0f} s, {max(left, 0):.0f} s "
                               "were left (queued for the next call)")
        trial.study.stop()
        raise NotBeforeDeadline(self._deadline_stop)

    def probe_repack(self) -> bool:
        """Once per study, when the space has a repacking dim (REPACK_PROBES: mainline's no_host, ik's rtr):
        enqueue the best-TG run so far again with it on (source REPACK_PROBES[knob]), so the knob gets one engine
        run on the plan where it could matter most (the sampler alone may never pair it with a good placement;
        --no-host configs were the confirmed best TG in most of the H100's tune_vs_fit cells, and ik's best 8 GiB
        config was an -rtr one that the sampler found in one study of two). Where that twin does not fit or ran
        already, the next-best TG run's twin. The outcome is kept in the study attr `probed_<knob>` (the trial it
        copies and the plan, or why none was queued), so a study without a probe says why. True when it enqueued
        one."""
        from optuna.trial import TrialState
        knob = next((k for k in REPACK_PROBES if k in self.space.dims), None)
        if knob is None:
            return False
        dim, attr = self.space.dims[knob], f"probed_{knob}"
        if True not in dim.values or not self.workload.n_gen or self.study.user_attrs.get(attr):
            return False
        runs: list[tuple[float, int, dict[str, Any]]] = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            m = TrialRecord.from_trial(t).measured
            if m is not None and m.ok and not t.params.get(knob):
                runs.append((m.tg_tps, t.number, dict(t.params)))
        if not runs:
            return False
        tried = set(self._queued_ids) | {t.user_attrs.get("plan_id") for t in self.study.get_trials(deepcopy=False)}
        outcome: dict[str, Any] = {"queued": False, "why": f"no run's {knob} twin fits and is new"}
        for tg, number, params in sorted(runs, key=lambda r: -r[0]):
            cand = self.space.decode(self.space.fixed(self.space.legal({**params, knob: True}),
                                                      default=lambda d: d.values[0]))
            if not cand.fits or cand.key in self.measured or cand.key in tried:
                continue
            self._add_pool(cand)
            # enqueued before the mark: a study killed in between finds it waiting, not lost; not skipped where
            # an earlier trial (a screened one, say) had the same params
            self.study.enqueue_trial(cand.params, user_attrs=TrialRecord(source=REPACK_PROBES[knob],
                                                                         plan_id=cand.key).to_attrs())
            self._queued_ids.add(cand.key)
            outcome = {"queued": True, "trial": number, "tg_tps": tg, "plan_id": cand.key}
            break
        self.study.set_user_attr(attr, outcome)
        log.info("%s probe: %s", knob, outcome)
        return outcome["queued"]

    def _improves(self, tg: float, pp: float) -> bool:
        pts = self._measured_points()
        if not pts:
            return True
        if self.objective.kind == "both":
            return not any(a >= tg and b >= pp for a, b in pts)
        return self._score(tg, pp) > max(self._score(a, b) for a, b in pts)

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
            self.build_pool()
        if self.want_baselines:
            self.baselines(deadline)
            if "baselines" not in self.study.user_attrs:
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
                for e in self._pick():
                    self._enqueue(e.params, e.plan_id, "surrogate")

        try:
            self.study.optimize(self.objective_fn, n_trials=None, catch=(MeasurementFailed, NotBeforeDeadline),
                                callbacks=[after], gc_after_trial=False)
        finally:
            self._deadline = None
        SIGINT.check()
        return TuneResult(self.study_name, self.storage_url, self.n_measured - start_measured, self.n_trials_session,
                          time.perf_counter() - t0, self.margin, self.fit, stop["why"], self.counts)


    # ---- confirmation -------------------------------------------------------------------------------------------

    def reference(self) -> dict[str, Any] | None:
        """The baseline the study is judged against: the engine's own --fit, else the --fit-like imitation (when
        it ran)."""
        for b in self.study.user_attrs.get("baselines", []):
            if b.get("kind") in ("engine-fit", "fit-like") and b.get("ok"):
                return b
        return None

    def finalists(self, n_tg: int = 2, ncmoe: bool = False) -> list[Contender]:
        """What confirmation re-measures: the reference (--fit), the n_tg fastest-TG trials that use no more VRAM
        than it measured, the best TG among trials with >= BALANCED_PP x its PP ("balanced"), and for a PP
        objective the fastest PP; a trial in several roles is one contender. `ncmoe`: the best -ncmoe baseline
        too (when it ran), measured beside --fit for its ratios, never picked."""
        from optuna.trial import TrialState
        ref = self.reference()
        rows = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            r = TrialRecord.from_trial(t)
            m = r.measured
            if m is not None and m.ok and r.duplicate_of is None and r.plan_json is not None:
                rows.append((t.number, m.tg_tps, m.pp_tps, m.vram_bytes))
        roles: dict[int, list[str]] = {}
        cap = vram_of(ref["measured"]) if ref and vram_of(ref["measured"]) else math.inf
        under = [r for r in rows if r[3] <= cap] or rows     # none at its VRAM: the fastest still, to show the gap
        for i, r in enumerate(sorted(under, key=lambda r: -r[1])[:n_tg]):
            roles.setdefault(r[0], []).append("best_tg" if i == 0 else "runner_up")
        pp_floor = BALANCED_PP * ref["measured"]["pp_tps"] if ref else 0.0
        balanced = [r for r in rows if r[2] >= pp_floor]
        if balanced:
            key = (lambda r: r[1]) if ref else (lambda r: math.sqrt(max(r[1], 0) * max(r[2], 0)))
            roles.setdefault(max(balanced, key=key)[0], []).append("balanced")
        if self.objective.kind == "pp" and rows:
            roles.setdefault(max(rows, key=lambda r: r[2])[0], []).append("best_pp")
        out = [Contender("fit", ref["name"], ("fit",))] if ref else []
        server = next((b for b in self.study.user_attrs.get("baselines", [])
                       if b.get("kind") == "engine-fit-server" and b.get("ok")), None)
        if server is not None:
            out.append(Contender("fit-server", server["name"], ("fit_server",)))
        nc = next((b for b in self.study.user_attrs.get("baselines", [])
                   if b.get("kind") == "ncmoe" and b.get("ok") and b.get("plan")), None)
        if ncmoe and nc is not None:
            out.append(Contender("ncmoe", nc["name"], ("ncmoe",)))
        out += [Contender(f"trial:{n}", f"trial {n}", tuple(rs), n) for n, rs in sorted(roles.items())]
        return out

    def confirm_seconds(self, rounds: int, n_tg: int = 2, ncmoe: bool = False, default: float = 0.0,
                        repetitions: int | None = None) -> float:
        """How long confirm(rounds, n_tg, ncmoe, repetitions) runs, from each contender's own run (its wall time
        at this workload, taken to `repetitions` by BenchWorkload.seconds_at), `default` seconds for one whose time is
        not known: one mean per run misjudges a cell whose contenders differ, e.g. a --no-host config at depth
        8192 ran 80 s where the others ran 14 s (H100, 2026-11-24)."""
        reps = repetitions or self.workload.repetitions
        return rounds * sum(self._contender_seconds(c, reps) or default for c in self.finalists(n_tg, ncmoe))

    def _trial(self, number: int):
        return next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)

    def _contender_record(self, c: Contender) -> dict[str, Any]:
        """What a reference contender stands for as stored: --fit's record (the reference), else its baseline."""
        if c.key == "fit":
            return self.reference() or {}
        kind = {"fit-server": "engine-fit-server", "ncmoe": "ncmoe"}[c.key]
        return next((b for b in self.study.user_attrs.get("baselines", []) if b.get("kind") == kind), {})

    def _contender_seconds(self, c: Contender, repetitions: int) -> float:
        """A contender's run time at `repetitions` (0: not known), from its stored run. A trial stored before runs
        were timed has Optuna's own start and end, unless its run was a baseline's (reused, so the trial itself
        took no time)."""
        if c.trial is not None:
            trial = self._trial(c.trial)
            rec = TrialRecord.from_trial(trial)
            m = rec.measured
            if m is not None and m.seconds:
                seconds = m.seconds
            elif rec.reused_baseline_run or trial.datetime_start is None or trial.datetime_complete is None:
                return 0.0
            else:
                seconds = (trial.datetime_complete - trial.datetime_start).total_seconds()
            pp, tg = (m.pp_tps, m.tg_tps) if m is not None else (0.0, 0.0)
        else:
            m = self._contender_record(c).get("measured") or {}
            seconds, pp, tg = float(m.get("seconds") or 0.0), float(m.get("pp_tps") or 0), float(m.get("tg_tps") or 0)
        return self.workload.seconds_at(seconds, pp, tg, repetitions) if seconds else 0.0

    def _measure_contender(self, c: Contender, workload: BenchWorkload) -> dict[str, Any]:
        if c.trial is not None:
            trial = self._trial(c.trial)
            plan = TrialRecord.from_trial(trial).plan()
            m = self._judge_peak(plan, self._measure(plan, workload))
        elif c.key == "fit" and self._contender_record(c).get("argv"):
            ref = self._contender_record(c)
            m = self._measure_args(with_repetitions(ref["argv"], workload.repetitions), ref.get("env") or {},
                                   workload)
        else:       # references, like --fit: measured, never failed for their peak
            plan = Plan.from_json(self._contender_record(c)["plan"])
            m = self._measure(plan, workload)
            if m.ok:
                m = replace(MeasuredRun.from_dict(_mdict(m)), peak_at_ctx=self.peaks_at_ctx(plan, dict(m.peak_bytes)))
        d = _mdict(m)
        row = {k: d[k] for k in ("ok", "tg_tps", "pp_tps", "error")}
        row.update(peak_bytes=d.get("peak_at_ctx") or d["peak_bytes"], cv=d.get("cv"), seen=d.get("seen", ""))
        return row

    def _measure_args(self, argv: list[str], env: dict[str, str], workload: BenchWorkload):
        try:
            with SIGINT.engine_run():
                return self.engine.measure_args(argv, workload, env)
        except InputError:
            raise
        except Exception as e:   # as _measure: an engine bug is a failed sample, not the end of the study
            return MeasuredRun.failed(f"engine raised {type(e).__name__}: {e}")

    def confirm(self, rounds: int = CONFIRM_ROUNDS, n_tg: int = 2, progress: Any = None,
                deadline: float | None = None, ncmoe: bool = False, repetitions: int | None = None
                ) -> dict[str, Any]:
        """Re-measure the finalists and the reference interleaved for `rounds` rounds (planner.tuner.confirm) and
        judge by the medians: stored as the study's "confirmed" attr, each sample as it comes (a killed
        confirmation resumes). Returns that record (one with no results when there is nothing to confirm; {}
        when a sample was left because it would not end before `deadline` (its contender's stored run time says
        how long it takes): call again to go on). `ncmoe`: the best -ncmoe baseline
        is re-measured with them (finalists). `repetitions`: each run's repetitions when not the workload's
        (fewer, so that every sample fits in one device call; stored in the record)."""
        contenders = self.finalists(n_tg, ncmoe)
        if rounds < 1 or not contenders:     # nothing to confirm: an empty record, so callers see it done
            return {"rounds": rounds, "results": [], "picks": {}, "reference": None}
        keys = [c.key for c in contenders]
        reps = repetitions or self.workload.repetitions
        stored = self.study.user_attrs.get("confirmation") or {}
        same = stored.get("keys") == keys and stored.get("repetitions", self.workload.repetitions) == reps
        log = SampleLog(list(stored.get("rows", [])) if same else [])
        workload = replace(self.workload, repetitions=reps)
        for rnd, c in schedule(contenders, rounds):
            if log.done(rnd, c.key):
                continue
            # a device call cut off mid-run loses the sample and whatever the caller had not saved yet
            if deadline is not None and time.monotonic() + self._contender_seconds(c, reps) >= deadline:
                return {}
            log.add(rnd, c.key, self._measure_contender(c, workload))
            self.study.set_user_attr("confirmation", {"keys": keys, "rounds": rounds, "repetitions": reps,
                                                      "rows": log.rows})
            if progress is not None:
                progress(len(log.rows), rounds * len(contenders))
        results = [log.summarise(c) for c in contenders]
        record = confirmed_record(results, rounds)
        if reps != self.workload.repetitions:
            record["repetitions"] = reps
        self.study.set_user_attr("confirmed", record)
        return record


# ---- helpers ------------------------------------------------------------------------------------------------------

def with_repetitions(argv: list[str], reps: int) -> list[str]:
    """A benchmark's arguments with their repetitions set to `reps` (llama-bench -r, llama-sweep-bench -nrep)."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a in ("-r", "--repetitions", "-nrep"):
            out[i + 1] = str(reps)
    return out


def _mdict(m: Any) -> dict[str, Any]:
    """A Measurement as stored on a trial or a baseline (MeasuredRun.to_dict: the engine's `raw` stays out)."""
    return MeasuredRun.from_measurement(m).to_dict()


def _hw_key(hw: HardwareProfile) -> dict[str, Any]:
    return {"name": hw.name, "gpus": [[g.name, g.vram_bytes] for g in hw.gpus], "host_ram": hw.host.ram_bytes}


def _waiting(study) -> bool:
    from optuna.trial import TrialState
    return bool(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


def _bin(tg: float, pp: float) -> tuple[int, int]:
    """Predicted speeds equal to 0.1%."""
    return (round(math.log(max(tg, 1e-12)) * 1000), round(math.log(max(pp, 1e-12)) * 1000))


def _front_indices(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points (both coordinates maximised)."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    out, best_pp = [], -math.inf
    for i in order:
        if points[i][1] > best_pp:
            out.append(i)
            best_pp = points[i][1]
    return out


def _front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [points[i] for i in _front_indices(points)]


def _hvi(p: tuple[float, float], front: list[tuple[float, float]]) -> float:
    """Hypervolume (reference 0,0) that point p adds to `front` (both maximised)."""
    def hv(pts: list[tuple[float, float]]) -> float:
        pts = _front(pts)
        pts.sort(key=lambda x: -x[0])
        area, prev_y = 0.0, 0.0
        for x, y in pts:
            if y > prev_y:
                area += x * (y - prev_y)
                prev_y = y
        return area
    return hv(front + [p]) - hv(front)


__all__ = ["Tuner", "TuneResult", "BenchWorkload", "Settings", "MeasurementFailed", "default_storage", "make_storage",
           "load_study", "slug", "budget_levels"]
