"""A trial's record: what the tuner stores on each Optuna trial (its user attrs), typed, and how it is read back.

The tuner writes a TrialRecord as the trial goes (RecordWriter: each attr set once known, so a killed worker keeps
what it had); every reader of a study (the report, the CLI, the service, the benchmarks, the tests) reads it back
with TrialRecord.from_trial, so the stored keys are named in this module only.

Stored keys (Optuna user attrs, JSON): record_version, source, plan_id, plan (Plan.to_json), candidate (label,
predicted speeds, memory per device, rendered commands), pruned_reason, duplicate_of, reused_baseline_run,
measured (MeasuredRun.to_dict) and terms (cost_fit.Terms.to_dict). A key is absent until the trial knows it.

Versions (RECORD_VERSION is the one written):
  1  the attrs as tuners wrote them before this module: the keys above without record_version (a trial without
     that key is version 1, e.g. tests/tuner/data/old_study_v1.db.gz);
  2  the same keys plus record_version.
A record of a version above RECORD_VERSION comes from a newer offload-tuner: reading it raises RecordError (one
line; the CLI exits 2) instead of guessing at keys this version does not know. A record that cannot be read
(a key of the wrong shape) raises RecordError too, naming the trial and the key.

A study's record: StudyRecord, the study's own attrs (Optuna study user attrs: settings, margins, baselines,
confirmation, cost fit, ...), read with StudyRecord.of(study) and written with StudyRecord.save(study, field=...):
the one place that names them. Versions (STUDY_RECORD_VERSION is the one written, when a study is created):
  1  the attrs as tuners wrote them before StudyRecord: the same keys without study_record_version (an older
     study, e.g. tests/tuner/data/old_study_v1.db.gz, stays version 1 when it resumes);
  2  the same keys plus study_record_version.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any
from collections.abc import Callable, Mapping

from planner.engine_contract import Measurement
from planner.errors import InputError, RecordError
from planner.plan import Plan
from .cost_fit import CostFit, Terms
from .objectives import RequestTime
from .options import Settings
from .stored import StoredRow
from .threads import ThreadProbe

RECORD_VERSION = 2
VERSION_KEY = "record_version"


def stored_version(attrs: Mapping[str, Any], key: str, newest: int, which: str, kind: str) -> int:
    """The version a trial's or a study's record stores under `key` (1 without the key: written before records had
    versions). RecordError for one no offload-tuner writes (a damaged database) or one above `newest` (a newer
    offload-tuner wrote it: this one would guess at keys it does not know). `which` names the record in the message
    ("trial 7"), `kind` its sort ("trial", "study")."""
    version = attrs.get(key, 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RecordError(f"{which} has record version {version!r}, which no offload-tuner writes: the study "
                          "database is damaged")
    if version > newest:
        raise RecordError(f"{which} was stored by a newer offload-tuner ({kind} record version {version}; this "
                          f"one reads versions 1 to {newest}): update offload-tuner to read this study")
    return version


@dataclass(frozen=True)
class MeasuredRun(Measurement):
    """A run as a trial (or a baseline) stores it: the engine's Measurement without its `raw` (it can be large),
    with what the tuner adds. The stored shape is to_dict's; from_dict reads it back."""
    peak_at_ctx: dict[str, int] = field(default_factory=dict)   # peaks moved to the emitted context ({}: the same)
    cv: float | None = None                                      # the run's own noise over its repetitions
    seen: str = ""                                               # the machine's state around the run
    seconds: float = 0.0                                         # the run's wall time (0: the engine did not say)

    @classmethod
    def from_measurement(cls, m: Measurement) -> MeasuredRun:
        """An engine's measurement as stored: its noise and machine state come from `raw` when it has no fields."""
        if isinstance(m, MeasuredRun) and not m.raw:
            return m
        raw = dict(getattr(m, "raw", {}) or {})
        return cls(pp_tps=float(m.pp_tps), tg_tps=float(m.tg_tps), ok=bool(m.ok), error=str(m.error or ""),
                   peak_bytes={k: int(v) for k, v in dict(m.peak_bytes).items()}, host_bytes=int(m.host_bytes),
                   peak_at_ctx=dict(getattr(m, "peak_at_ctx", None) or {}),
                   cv=getattr(m, "cv", None) or raw.get("cv"), seen=getattr(m, "seen", None) or raw.get("seen") or "",
                   seconds=float(getattr(m, "seconds", 0.0) or raw.get("wall_s") or 0.0))

    def to_dict(self) -> dict[str, Any]:
        """The stored shape (as tuners have always written it): the optional keys only when set."""
        out: dict[str, Any] = {"pp_tps": float(self.pp_tps), "tg_tps": float(self.tg_tps), "ok": bool(self.ok),
                               "error": str(self.error or ""),
                               "peak_bytes": {k: int(v) for k, v in self.peak_bytes.items()},
                               "host_bytes": int(self.host_bytes)}
        for key, value in (("peak_at_ctx", self.peak_at_ctx), ("cv", self.cv), ("seen", self.seen),
                           ("seconds", self.seconds)):
            if value:
                out[key] = value
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MeasuredRun:
        return cls(error=d.get("error", ""), ok=bool(d.get("ok")), pp_tps=float(d.get("pp_tps", 0.0)),
                   tg_tps=float(d.get("tg_tps", 0.0)), peak_bytes=dict(d.get("peak_bytes") or {}),
                   host_bytes=int(d.get("host_bytes", 0)), peak_at_ctx=dict(d.get("peak_at_ctx") or {}),
                   cv=d.get("cv"), seen=d.get("seen", ""), seconds=float(d.get("seconds") or 0.0))

    @property
    def command_peak_bytes(self) -> dict[str, int]:
        """Peak bytes per GPU the emitted command uses: at its context when that differs, else as measured."""
        return self.peak_at_ctx or self.peak_bytes

    @property
    def vram_bytes(self) -> int:
        """All GPUs' peaks as the emitted command uses them (tuner.confirm.vram_of of the stored shape)."""
        return sum(self.command_peak_bytes.values())


@dataclass(frozen=True)
class PredictedSpeeds:
    """The cost model's speeds for a candidate: refitted on the study's runs so far, and the prior profile's."""
    tg_tps: float
    pp_tps: float
    prior_tg_tps: float
    prior_pp_tps: float

    def to_dict(self) -> dict[str, float]:
        return {"tg_tps": self.tg_tps, "pp_tps": self.pp_tps, "prior_tg_tps": self.prior_tg_tps,
                "prior_pp_tps": self.prior_pp_tps}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PredictedSpeeds:
        return cls(float(d["tg_tps"]), float(d["pp_tps"]), float(d["prior_tg_tps"]), float(d["prior_pp_tps"]))


@dataclass(frozen=True)
class CandidateInfo:
    """What the tuner knew of a candidate before running it. A candidate the memory model could not place has its
    label only (the other fields None, absent from the stored dict)."""
    label: str
    predicted: PredictedSpeeds | None = None
    memory: dict[str, Any] | None = None        # MemoryReport.to_dict(): bytes per device under "devices"
    commands: dict[str, str] | None = None      # rendered lines by tool (llama-server, llama-cli, llama-bench)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label}
        if self.predicted is not None:
            out["predicted"] = self.predicted.to_dict()
        if self.memory is not None:
            out["memory"] = self.memory
        if self.commands is not None:
            out["commands"] = self.commands
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CandidateInfo:
        """From the stored dict, or from the tuner's description of a plan (its other keys are ignored)."""
        return cls(str(d.get("label", "")),
                   PredictedSpeeds.from_dict(d["predicted"]) if "predicted" in d else None,
                   dict(d["memory"]) if "memory" in d else None,
                   dict(d["commands"]) if "commands" in d else None)

    @property
    def gpu_bytes(self) -> dict[str, int]:
        """Predicted bytes per GPU (the memory model's total), {} when unknown."""
        devices = (self.memory or {}).get("devices", {})
        return {d: v["total"] for d, v in devices.items() if d != "CPU"}


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One trial as stored. Defaults stand for "not known (yet)": a pruned trial has no measurement, a trial the
    sampler is still deciding has no plan, a waiting (enqueued) one has its source and plan id only."""
    version: int = RECORD_VERSION
    source: str = "sampler"                     # what proposed it: sampler, surrogate, default, cost-front,
                                                # proposal:LABEL, fill-max:tg|pp, budget:NGiB,
                                                # probe:no-host / probe:rtr (the best-TG plan rerun with
                                                # --no-host / -rtr)
    plan_id: str = ""                           # Plan.id ("" before the candidate is decoded)
    plan_json: str | None = None                # Plan.to_json() (the stored "plan")
    candidate: CandidateInfo | None = None
    pruned_reason: str | None = None            # over budget, the same plan as a failed trial, screened
    duplicate_of: int | None = None             # the trial that measured this plan already (its values reused)
    reused_baseline_run: bool = False           # a baseline's run of the same plan is this trial's
    measured: MeasuredRun | None = None
    terms: Terms | None = None                  # the cost model's terms of a successful run (refit samples)

    def to_attrs(self) -> dict[str, Any]:
        """The Optuna user attrs, as tuners before record versions wrote them plus `record_version`."""
        out: dict[str, Any] = {VERSION_KEY: self.version, "source": self.source}
        if self.plan_id:
            out["plan_id"] = self.plan_id
        if self.plan_json is not None:
            out["plan"] = self.plan_json
        if self.candidate is not None:
            out["candidate"] = self.candidate.to_dict()
        if self.pruned_reason is not None:
            out["pruned_reason"] = self.pruned_reason
        if self.duplicate_of is not None:
            out["duplicate_of"] = self.duplicate_of
        if self.reused_baseline_run:
            out["reused_baseline_run"] = True
        if self.measured is not None:
            out["measured"] = self.measured.to_dict()
        if self.terms is not None:
            out["terms"] = self.terms.to_dict()
        return out

    @classmethod
    def from_trial(cls, trial: Any) -> TrialRecord:
        """The record of an Optuna trial (FrozenTrial or a running Trial): any version up to RECORD_VERSION."""
        return cls.from_attrs(trial.user_attrs, getattr(trial, "number", None))

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any], trial: int | None = None) -> TrialRecord:
        which = "a trial" if trial is None else f"trial {trial}"
        version = stored_version(attrs, VERSION_KEY, RECORD_VERSION, which, "trial")
        # versions 1 and 2 store the same keys (2 adds record_version): one reader serves both

        def read(key: str, parse: Callable[[Any], Any], default: Any = None) -> Any:
            if key not in attrs:
                return default
            try:
                return parse(attrs[key])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise RecordError(f"{which} has a damaged record: {key!r} cannot be read "
                                  f"({type(e).__name__}: {e})") from e
        return cls(version=version, source=read("source", _text, "sampler"), plan_id=read("plan_id", _text, ""),
                   plan_json=read("plan", _text), candidate=read("candidate", CandidateInfo.from_dict),
                   pruned_reason=read("pruned_reason", _text), duplicate_of=read("duplicate_of", int),
                   reused_baseline_run=read("reused_baseline_run", bool, False),
                   measured=read("measured", MeasuredRun.from_dict), terms=read("terms", Terms.from_dict))

    # ---- what readers ask of a record ---------------------------------------------------------------------------

    @property
    def label(self) -> str:
        return self.candidate.label if self.candidate is not None else ""

    @property
    def commands(self) -> dict[str, str]:
        return dict((self.candidate.commands if self.candidate is not None else None) or {})

    @property
    def engine_run(self) -> bool:
        """This trial made an engine run (not a repeat of a measured plan, nor a baseline's run taken over)."""
        return self.measured is not None and self.duplicate_of is None and not self.reused_baseline_run

    def plan(self) -> Plan | None:
        """The trial's Plan (parsed from its stored JSON), None before it was decoded."""
        return Plan.from_json(self.plan_json) if self.plan_json is not None else None


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, found {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ConfirmSample(StoredRow):
    """One llama-bench run of a contender in a confirmation round (tuner.confirm; the study's
    confirmation["rows"]): its speeds, its peaks at the emitted context, its noise, or why it failed."""
    round: int
    key: str                                    # the contender (tuner.confirm.Contender.key)
    ok: bool = False
    tg_tps: float = 0.0
    pp_tps: float = 0.0
    error: str = ""
    peak_bytes: dict[str, int] | None = None
    cv: float | None = None                     # the run's own noise over its repetitions
    seen: str = ""                              # the machine's state around a noisy run
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)


@dataclass(frozen=True)
class ServedRun(StoredRow):
    """One llama-server run of a contender in a round of the served stage (tuner.served; the study's
    serving["rows"]): what replaying the workload gave, or why it failed (a failed engine call stores ok and error
    only; a row stored before machines were told apart has no machine)."""
    round: int
    key: str                                    # the contender (tuner.served.Served.key)
    machine: str | None = None                  # the boot that served it (tuner.served.machine_id)
    threads: int | None = None                  # -t every contender was served at (absent: each its own)
    ok: bool = False
    error: str | None = None
    request_s: float | None = None              # mean request time over the workload's classes
    ttft_s: float | None = None                 # mean time to first token
    ttft_max_s: float | None = None             # the slowest class's TTFT (absent in rows before it was kept)
    pp_tps: float | None = None
    tg_tps: float | None = None
    peak_bytes: dict[str, int] | None = None    # per GPU, the server's
    command: str | None = None
    seconds: float | None = None                # the run's wall time, the load included
    ready_s: float | None = None                # seconds until the server answered
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)


def measured_dict(m: Measurement) -> dict[str, Any]:
    """A Measurement as stored on a trial or a baseline (MeasuredRun.to_dict: the engine's `raw` stays out)."""
    return MeasuredRun.from_measurement(m).to_dict()


class RecordWriter:
    """Stores a running trial's record as it grows. Each `update` sets only the attrs that changed: every
    set_user_attr is a commit, and a trial killed midway keeps what was known by then (a resumed study reads it)."""

    def __init__(self, trial: Any) -> None:
        self.trial = trial
        self._stored = dict(trial.user_attrs)      # an enqueued trial holds its source and plan id already
        self.record = replace(TrialRecord.from_attrs(self._stored, trial.number), version=RECORD_VERSION)

    def update(self, **changes: Any) -> TrialRecord:
        self.record = replace(self.record, **changes)
        for key, value in self.record.to_attrs().items():
            if key not in self._stored or self._stored[key] != value:
                self.trial.set_user_attr(key, value)
                self._stored[key] = value
        return self.record


# ---- the study's record ------------------------------------------------------------------------------------------

STUDY_RECORD_VERSION = 2
STUDY_VERSION_KEY = "study_record_version"


@dataclass(frozen=True, kw_only=True)
class StudyRecord:
    """A study's own attrs, typed. Each field is stored under its own name (the keys tuners have always written);
    a field absent from the study, or stored as None, reads as its default. The records inside (baselines,
    confirmation, serving, served) stay dicts, their shapes their modules' (tuner.baselines, .confirm, .served);
    the rows of samples in them are typed where those modules work with them (ConfirmSample, ServedRun)."""
    version: int = STUDY_RECORD_VERSION
    # what the study was made for, written when it is created (a resumed study must match: options.Settings)
    settings: Settings | None = None
    objective_names: list[str] = field(default_factory=list)
    created: str = ""                                   # "%Y-%m-%d %H:%M:%S"
    request_time: RequestTime | None = None             # the time objective's per-class speeds
    # the memory margin (tuner.margin)
    margin_rule: str = "learnt"                         # "learnt" or "fixed"
    margin_bytes: int | None = None                     # an unmeasured ubatch's margin, or the fixed one
    margin_floor: int = 0                               # what out-of-memory errors raised a learnt margin to
    margin_by_ubatch: dict[int, int] = field(default_factory=dict)
    margin_events: list[dict[str, Any]] = field(default_factory=list)   # each change: from, to, plan_id, error
    memory_errors: list[int] = field(default_factory=list)              # measured - predicted peak, every run
    memory_errors_by_ubatch: dict[int, list[int]] = field(default_factory=dict)
    # the search
    cost_fit: CostFit | None = None                     # the cost model's last refit
    seeded: bool = False                                # the seed trials were enqueued
    probed_no_host: dict[str, Any] | None = None        # the repack probes' outcomes (seeds.REPACK_PROBES)
    probed_rtr: dict[str, Any] | None = None
    # the baselines: `baselines` is set once all ran (None: not yet), `baselines_partial` as each one does
    baselines: list[dict[str, Any]] | None = None
    baselines_partial: list[dict[str, Any]] = field(default_factory=list)
    # the llama-bench confirmation (tuner.confirm): its samples as they come, then the verdict
    confirmation: dict[str, Any] | None = None
    confirmed: dict[str, Any] | None = None
    # the llama-server confirmation (tuner.served): its samples as they come, then the verdict
    serving: dict[str, Any] | None = None
    served: dict[str, Any] | None = None
    explored: bool = False                              # the search is done (tune --llama-server resumes serving)
    threads_probe: ThreadProbe | None = None            # the thread probe's runs and the -t it settled

    @classmethod
    def of(cls, study: Any) -> StudyRecord:
        """The record of an Optuna study (Study or FrozenStudy): any version up to STUDY_RECORD_VERSION."""
        return cls.from_attrs(study.user_attrs, getattr(study, "study_name", None))

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any], study: str | None = None) -> StudyRecord:
        which = "a study" if study is None else f"study {study!r}"
        version = stored_version(attrs, STUDY_VERSION_KEY, STUDY_RECORD_VERSION, which, "study")
        values: dict[str, Any] = {"version": version}
        for name in _STUDY_KEYS:
            if attrs.get(name) is None:
                continue
            try:
                values[name] = _LOAD.get(name, _same)(attrs[name])
            except (KeyError, TypeError, ValueError, AttributeError, InputError) as e:
                raise RecordError(f"{which} has a damaged record: {name!r} cannot be read "
                                  f"({type(e).__name__}: {e})") from e
        return cls(**values)

    @staticmethod
    def save(study: Any, **changes: Any) -> None:
        """Store the named fields (one set_user_attr, a commit, each: name only what changed)."""
        for name, value in changes.items():
            if name not in _STUDY_KEYS:
                raise TypeError(f"StudyRecord has no field {name!r}")
            study.set_user_attr(name, None if value is None else _DUMP.get(name, _same)(value))

    @staticmethod
    def create(study: Any, **values: Any) -> None:
        """Store a new study's first fields, with the version this offload-tuner writes."""
        study.set_user_attr(STUDY_VERSION_KEY, STUDY_RECORD_VERSION)
        StudyRecord.save(study, **values)

    def probed(self, knob: str) -> dict[str, Any] | None:
        """The outcome of a repack knob's probe (probed_no_host, probed_rtr)."""
        return getattr(self, f"probed_{knob}")


def _same(value: Any) -> Any:
    return value


def _int_keys(parse: Callable[[Any], Any]) -> Callable[[Any], dict[int, Any]]:
    return lambda d: {int(k): parse(v) for k, v in d.items()}


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values]


_STUDY_KEYS = tuple(f.name for f in fields(StudyRecord) if f.name != "version")
# how a field is read from its stored JSON (absent: as it is) and written to it: ubatches are JSON object keys
_LOAD: dict[str, Callable[[Any], Any]] = {
    "settings": Settings.from_dict, "objective_names": list, "created": str, "margin_rule": str, "margin_bytes": int,
    "margin_floor": int, "margin_by_ubatch": _int_keys(int), "memory_errors": _ints,
    "memory_errors_by_ubatch": _int_keys(_ints), "margin_events": list, "seeded": bool, "explored": bool,
    "baselines": list, "baselines_partial": list, "cost_fit": CostFit.from_dict, "request_time": RequestTime.from_dict,
    "threads_probe": ThreadProbe.from_dict}
_DUMP: dict[str, Callable[[Any], Any]] = {
    "settings": Settings.to_dict, "cost_fit": CostFit.to_dict, "request_time": RequestTime.to_dict,
    "threads_probe": ThreadProbe.to_dict,
    "margin_by_ubatch": lambda d: {str(k): int(v) for k, v in d.items()},
    "memory_errors_by_ubatch": lambda d: {str(k): _ints(v) for k, v in d.items()}}
