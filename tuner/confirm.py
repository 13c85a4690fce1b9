"""Confirmation: re-measure a study's finalists and the engine's own `--fit` interleaved, and judge by the median.

A study picks its winners from one run each, and two runs of one config on these machines differ by 10% or more
between machines and by a few percent within one. So before a study reports, its finalists and the `--fit`
baseline are run again in rounds, A B C A B C ..., the order rotated each round (no contender always runs first,
after a cold GPU), and each is summarised by the median of its samples with their spread. A finalist whose edge
over `--fit` is inside the noise of either side is a tie, not a win.

    # C contenders, R rounds: R x C engine runs, samples[c] = R values of TG and of PP

`confirmed_record` turns the samples into what studies store and report: medians, spreads, ratios to --fit (and
to --fit's placement in a server) with their verdicts, and the picks by median. `finalists` and `confirm` do it
for a Tuner's study (Tuner.finalists and Tuner.confirm call them): which contenders, how long, the runs.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Sequence

from planner.bench_run import BenchRun
from planner.errors import InputError
from planner.plan import Plan
from .interrupt import SIGINT
from .records import ConfirmSample, MeasuredRun, StudyRecord, TrialRecord, measured_dict

if TYPE_CHECKING:
    from .measurer import Measurer

Verdict = Literal["win", "tie", "loss"]
CONFIRM_ROUNDS = 3        # interleaved re-measurements of each finalist and of --fit
NOISY_CV = 0.05           # a measurement whose repetitions vary more than this is flagged in the report
MIN_NOISE = 0.01          # never call an edge under 1% a win, however tight the samples
BALANCED_PP = 1.5         # "balanced": the best TG among configs with at least this x --fit's PP


@dataclass(frozen=True)
class Spread:
    """Samples of one speed: median, range and coefficient of variation."""
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples)) if self.samples else 0.0

    @property
    def lo(self) -> float:
        return min(self.samples) if self.samples else 0.0

    @property
    def hi(self) -> float:
        return max(self.samples) if self.samples else 0.0

    @property
    def cv(self) -> float:
        """Standard deviation over mean (0 for fewer than two samples)."""
        if len(self.samples) < 2:
            return 0.0
        mean = statistics.fmean(self.samples)
        return statistics.stdev(self.samples) / mean if mean > 0 else 0.0

    @property
    def rel_range(self) -> float:
        """(max - min) / median: how far apart the samples are, as a share."""
        m = self.median
        return (self.hi - self.lo) / m if m > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"samples": list(self.samples), "median": self.median, "lo": self.lo, "hi": self.hi, "cv": self.cv}


@dataclass(frozen=True)
class Contender:
    """One config to re-measure: a trial's plan (by trial number) or the engine's own --fit (by arguments)."""
    key: str                          # "fit", "fit-server", "ncmoe" or "trial:N"
    name: str                         # what the report calls it
    roles: tuple[str, ...] = ()       # "fit", "fit_server", "ncmoe", "best_tg", "balanced", "runner_up"
    trial: int | None = None


@dataclass(frozen=True)
class Confirmed:
    """A contender after the rounds: its speeds and peak VRAM over every sample, failures kept."""
    contender: Contender
    tg: Spread
    pp: Spread
    vram_bytes: int                   # the largest peak over its runs, all GPUs
    run_cv: tuple[float, ...] = ()    # each run's own coefficient of variation over its repetitions (worst of TG/PP)
    errors: tuple[str, ...] = ()
    seen: tuple[str, ...] = ()        # what the engine saw around noisy runs (other GPU processes, clocks, load)
    vram_device_bytes: dict[str, int] = field(default_factory=dict)   # the largest peak over its runs, per GPU

    @property
    def ok(self) -> bool:
        return bool(self.tg.samples or self.pp.samples)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.contender.key, "name": self.contender.name, "roles": list(self.contender.roles),
                "trial": self.contender.trial, "tg": self.tg.to_dict(), "pp": self.pp.to_dict(),
                "vram_bytes": self.vram_bytes, "vram_device_bytes": dict(self.vram_device_bytes),
                "run_cv": list(self.run_cv), "noisy": self.noisy,
                "errors": list(self.errors), "seen": list(self.seen)}

    @property
    def noisy(self) -> bool:
        return any(cv > NOISY_CV for cv in self.run_cv) or self.tg.cv > NOISY_CV or self.pp.cv > NOISY_CV


@dataclass(frozen=True)
class Ratio:
    """A contender against --fit on one speed: the ratio of medians and whether it is outside the noise."""
    ratio: float
    noise: float
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(a: Spread, ref: Spread, floor: float | None = None) -> Ratio | None:
    """a against ref (both medians); a tie when the edge is within the larger relative range of the two
    (at least MIN_NOISE, or `floor` when given: one sample has no range of its own). None when either side has no
    sample."""
    if not a.samples or not ref.samples or ref.median <= 0:
        return None
    ratio = a.median / ref.median
    noise = max(a.rel_range, ref.rel_range, MIN_NOISE if floor is None else floor)
    verdict: Verdict = "win" if ratio > 1 + noise else "loss" if ratio < 1 - noise else "tie"
    return Ratio(ratio, noise, verdict)


def schedule(contenders: Sequence[Contender], rounds: int) -> list[tuple[int, Contender]]:
    """The interleaved order: round r runs every contender once, starting r places further along."""
    n = len(contenders)
    return [(r, contenders[(r + i) % n]) for r in range(rounds) for i in range(n)]


@dataclass
class SampleLog:
    """Samples as they come (stored after each run, so a killed confirmation resumes where it stopped)."""
    rows: list[ConfirmSample] = field(default_factory=list)

    def done(self, rnd: int, key: str) -> bool:
        return any(r.round == rnd and r.key == key for r in self.rows)

    def add(self, rnd: int, key: str, m: dict[str, Any]) -> None:
        self.rows.append(ConfirmSample.from_dict({"round": rnd, "key": key, **m}))

    def summarise(self, c: Contender) -> Confirmed:
        mine = [r for r in self.rows if r.key == c.key]
        good = [r for r in mine if r.ok]
        return Confirmed(
            c, Spread(tuple(r.tg_tps for r in good if r.tg_tps)), Spread(tuple(r.pp_tps for r in good if r.pp_tps)),
            max((sum((r.peak_bytes or {}).values()) for r in good), default=0),
            tuple(r.cv for r in good if r.cv is not None),
            tuple(r.error for r in mine if not r.ok),
            tuple(dict.fromkeys(r.seen for r in good if r.seen and (r.cv or 0) > NOISY_CV)),
            _per_device_max(r.peak_bytes or {} for r in good))


def _per_device_max(peaks) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in peaks:
        for d, b in p.items():
            out[d] = max(out.get(d, 0), int(b))
    return dict(sorted(out.items()))


def vram_of(measured: dict[str, Any]) -> int:
    """The VRAM a stored measurement stands for: its peaks at the emitted context, else as measured, all GPUs."""
    return sum((measured.get("peak_at_ctx") or measured.get("peak_bytes") or {}).values())


def confirmed_record(results: list[Confirmed], rounds: int) -> dict[str, Any]:
    """Each contender's medians and spreads, its ratios to the reference (win / tie / loss), and the picks by
    median: the best TG at no more VRAM than the reference, and the best TG with >= BALANCED_PP x its PP."""
    ref = next((r for r in results if "fit" in r.contender.roles), None)
    server = next((r for r in results if "fit_server" in r.contender.roles), None)
    rows = []
    for r in results:
        d = r.to_dict()
        for tag, base in (("fit", ref), ("fit_server", server)):
            if base is not None and r is not base:
                for name, a, b in (("tg", r.tg, base.tg), ("pp", r.pp, base.pp)):
                    cmp = compare(a, b)
                    d[f"{name}_vs_{tag}"] = cmp.to_dict() if cmp else None
                d[f"vram_vs_{tag}"] = r.vram_bytes / base.vram_bytes if base.vram_bytes else None
        rows.append(d)
    # baselines measured beside --fit (the best -ncmoe, role "ncmoe") get ratios, never a pick
    others = [r for r in results if r is not ref and r is not server and r.tg.samples
              and "ncmoe" not in r.contender.roles]
    picks: dict[str, Any] = {}
    cap = ref.vram_bytes if ref is not None and ref.vram_bytes else math.inf
    tg_ok = [r for r in others if r.vram_bytes <= cap]
    if tg_ok:
        picks["best_tg"] = max(tg_ok, key=lambda r: r.tg.median).contender.key
    elif others:      # nothing at or under the reference's VRAM: the fastest, named so
        picks["best_tg_over_fit_vram"] = max(others, key=lambda r: r.tg.median).contender.key
    floor = BALANCED_PP * ref.pp.median if ref is not None else 0.0
    bal = [r for r in others if r.pp.median >= floor]
    if bal:
        picks["balanced"] = max(bal, key=lambda r: r.tg.median).contender.key
    return {"rounds": rounds, "results": rows, "picks": picks, "reference": ref.contender.key if ref else None}


# ---- a study's confirmation ---------------------------------------------------------------------------------------

def reference(baselines: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The baseline a study is judged against: the engine's own --fit, else the --fit-like imitation (when it
    ran)."""
    return next((b for b in baselines if b.get("kind") in ("engine-fit", "fit-like") and b.get("ok")), None)


def finalists(measurer: Measurer, n_tg: int = 2, ncmoe: bool = False) -> list[Contender]:
    """What confirmation re-measures: the reference (--fit), the n_tg fastest-TG trials that use no more VRAM
    than it measured, the best TG among trials with >= BALANCED_PP x its PP ("balanced"), and for a PP
    objective the fastest PP; a trial in several roles is one contender. `ncmoe`: the best -ncmoe baseline
    too (when it ran), measured beside --fit for its ratios, never picked."""
    from optuna.trial import TrialState
    baselines = StudyRecord.of(measurer.study).baselines or []
    ref = reference(baselines)
    rows = []
    for t in measurer.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
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
    if measurer.objective.kind == "pp" and rows:
        roles.setdefault(max(rows, key=lambda r: r[2])[0], []).append("best_pp")
    out = [Contender("fit", ref["name"], ("fit",))] if ref else []
    server = next((b for b in baselines if b.get("kind") == "engine-fit-server" and b.get("ok")), None)
    if server is not None:
        out.append(Contender("fit-server", server["name"], ("fit_server",)))
    nc = next((b for b in baselines if b.get("kind") == "ncmoe" and b.get("ok") and b.get("plan")), None)
    if ncmoe and nc is not None:
        out.append(Contender("ncmoe", nc["name"], ("ncmoe",)))
    out += [Contender(f"trial:{n}", f"trial {n}", tuple(rs), n) for n, rs in sorted(roles.items())]
    return out


def confirm_seconds(measurer: Measurer, rounds: int, n_tg: int = 2, ncmoe: bool = False, default: float = 0.0,
                    repetitions: int | None = None) -> float:
    """How long confirm(rounds, n_tg, ncmoe, repetitions) runs, from each contender's own run (its wall time
    at this bench run, taken to `repetitions` by BenchRun.seconds_at), `default` seconds for one whose time is
    not known: one mean per run misjudges a cell whose contenders differ, e.g. a --no-host config at depth
    8192 ran 80 s where the others ran 14 s (H100, 2026-11-24)."""
    reps = repetitions or measurer.bench.repetitions
    return rounds * sum(contender_seconds(measurer, c, reps) or default for c in finalists(measurer, n_tg, ncmoe))


def _contender_record(measurer: Measurer, c: Contender) -> dict[str, Any]:
    """What a reference contender stands for as stored: --fit's record (the reference), else its baseline."""
    baselines = StudyRecord.of(measurer.study).baselines or []
    if c.key == "fit":
        return reference(baselines) or {}
    kind = {"fit-server": "engine-fit-server", "ncmoe": "ncmoe"}[c.key]
    return next((b for b in baselines if b.get("kind") == kind), {})


def contender_seconds(measurer: Measurer, c: Contender, repetitions: int) -> float:
    """A contender's run time at `repetitions` (0: not known), from its stored run. A trial stored before runs
    were timed has Optuna's own start and end, unless its run was a baseline's (reused, so the trial itself
    took no time)."""
    if c.trial is not None:
        trial = measurer.trial(c.trial)
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
        d = _contender_record(measurer, c).get("measured") or {}
        seconds, pp, tg = float(d.get("seconds") or 0.0), float(d.get("pp_tps") or 0), float(d.get("tg_tps") or 0)
    return measurer.bench.seconds_at(seconds, pp, tg, repetitions) if seconds else 0.0


def _measure_contender(measurer: Measurer, c: Contender, bench: BenchRun) -> dict[str, Any]:
    """One sample of a contender, as a stored row: a trial's plan judged like a trial, --fit by its own arguments,
    another reference as a plan (measured, never failed for its peak)."""
    if c.trial is not None:
        plan = TrialRecord.from_trial(measurer.trial(c.trial)).plan()
        m = measurer.judge_peak(plan, measurer.measure(plan, bench))
    elif c.key == "fit" and _contender_record(measurer, c).get("argv"):
        ref = _contender_record(measurer, c)
        m = _measure_args(measurer, with_repetitions(ref["argv"], bench.repetitions), ref.get("env") or {}, bench)
    else:
        plan = Plan.from_json(_contender_record(measurer, c)["plan"])
        m = measurer.measure(plan, bench)
        if m.ok:
            m = replace(MeasuredRun.from_dict(measured_dict(m)),
                        peak_at_ctx=measurer.peaks_at_ctx(plan, dict(m.peak_bytes)))
    d = measured_dict(m)
    row = {k: d[k] for k in ("ok", "tg_tps", "pp_tps", "error")}
    row.update(peak_bytes=d.get("peak_at_ctx") or d["peak_bytes"], cv=d.get("cv"), seen=d.get("seen", ""))
    return row


def _measure_args(measurer: Measurer, argv: list[str], env: dict[str, str], bench: BenchRun):
    try:
        with SIGINT.engine_run():
            return measurer.engine.measure_args(argv, bench, env)
    except InputError:
        raise
    except Exception as e:   # as Tuner.measure: an engine bug is a failed sample, not the end of the study
        return MeasuredRun.failed(f"engine raised {type(e).__name__}: {e}")


def with_repetitions(argv: list[str], reps: int) -> list[str]:
    """A benchmark's arguments with their repetitions set to `reps` (llama-bench -r, llama-sweep-bench -nrep)."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a in ("-r", "--repetitions", "-nrep"):
            out[i + 1] = str(reps)
    return out


def confirm(measurer: Measurer, rounds: int = CONFIRM_ROUNDS, n_tg: int = 2, progress: Any = None,
            deadline: float | None = None, ncmoe: bool = False, repetitions: int | None = None) -> dict[str, Any]:
    """Re-measure the finalists and the reference interleaved for `rounds` rounds and judge by the medians:
    stored as the study's "confirmed" attr, each sample as it comes (a killed confirmation resumes). Returns that
    record (one with no results when there is nothing to confirm; {} when a sample was left because it would not
    end before `deadline` (its contender's stored run time says how long it takes): call again to go on).
    `ncmoe`: the best -ncmoe baseline is re-measured with them (finalists). `repetitions`: each run's repetitions
    when not the bench run's (fewer, so that every sample fits in one device call; stored in the record)."""
    contenders = finalists(measurer, n_tg, ncmoe)
    if rounds < 1 or not contenders:     # nothing to confirm: an empty record, so callers see it done
        return {"rounds": rounds, "results": [], "picks": {}, "reference": None}
    keys = [c.key for c in contenders]
    reps = repetitions or measurer.bench.repetitions
    stored = StudyRecord.of(measurer.study).confirmation or {}
    same = stored.get("keys") == keys and stored.get("repetitions", measurer.bench.repetitions) == reps
    log = SampleLog([ConfirmSample.from_dict(r) for r in stored.get("rows", [])] if same else [])
    bench = replace(measurer.bench, repetitions=reps)
    for rnd, c in schedule(contenders, rounds):
        if log.done(rnd, c.key):
            continue
        # a device call cut off mid-run loses the sample and whatever the caller had not saved yet
        if deadline is not None and time.monotonic() + contender_seconds(measurer, c, reps) >= deadline:
            return {}
        log.add(rnd, c.key, _measure_contender(measurer, c, bench))
        StudyRecord.save(measurer.study, confirmation={"keys": keys, "rounds": rounds, "repetitions": reps,
                                                    "rows": [r.to_dict() for r in log.rows]})
        if progress is not None:
            progress(len(log.rows), rounds * len(contenders))
    record = confirmed_record([log.summarise(c) for c in contenders], rounds)
    if reps != measurer.bench.repetitions:
        record["repetitions"] = reps
    StudyRecord.save(measurer.study, confirmed=record)
    return record
