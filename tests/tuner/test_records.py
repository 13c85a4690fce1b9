"""The trial record (tuner.records): what a trial stores, read back typed, in every version this tuner knows
(version 1: the attrs tuners wrote before records had versions; data/old_study_v1.db.gz is such a study), and a
newer version refused with one line."""
from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
from pathlib import Path

import optuna
import pytest

from offload_tuner import cli
from planner.errors import InputError, RecordError
from planner.engine_contract import Measurement
from tuner.cost_fit import Terms
from tuner.records import (
    RECORD_VERSION, CandidateInfo, MeasuredRun, PredictedSpeeds, RecordWriter, TrialRecord,
)
from tuner.records import measured_dict as _mdict

DATA = Path(__file__).resolve().parent / "data" / "old_study_v1.db.gz"
V1_KEYS = {"source", "plan_id", "plan", "candidate", "pruned_reason", "duplicate_of", "reused_baseline_run",
           "measured", "terms"}


def _full_record() -> TrialRecord:
    return TrialRecord(
        source="proposal:experts-cpu+fill-last", plan_id="0123456789ab", plan_json='{"label":"x"}',
        candidate=CandidateInfo("fill 1.00 last out gpu", PredictedSpeeds(150.0, 1500.0, 140.0, 1400.0),
                                {"devices": {"CUDA0": {"total": 15 << 30}, "CPU": {"total": 3 << 30}}},
                                {"llama-server": "llama-server -m MODEL.gguf -ngl 99"}),
        duplicate_of=None, reused_baseline_run=True,
        measured=MeasuredRun(pp_tps=1543.5, tg_tps=151.8, peak_bytes={"CUDA0": 17 << 30}, host_bytes=3 << 30,
                             peak_at_ctx={"CUDA0": (17 << 30) + 4096}, cv=0.012, seen="load 0.3"),
        terms=Terms({"gpu": 0.002, "cpu": 0.003, "fixed": 0.001}, {"gpu": 0.03, "cpu": 1e-5, "link": 0.29,
                                                                   "fixed": 0.006}, 512.0))


def test_a_record_round_trips_through_attrs_json_and_an_optuna_trial():
    rec = _full_record()
    attrs = rec.to_attrs()
    assert attrs["record_version"] == RECORD_VERSION == 2
    assert set(attrs) == {"record_version"} | V1_KEYS - {"pruned_reason", "duplicate_of"}
    assert TrialRecord.from_attrs(attrs) == rec
    assert TrialRecord.from_attrs(json.loads(json.dumps(attrs))) == rec          # as a database gives it back
    pruned = TrialRecord(source="sampler", plan_id="ab", candidate=CandidateInfo("unplaceable"),
                         pruned_reason="over budget: CUDA0", duplicate_of=3)
    assert pruned.to_attrs()["candidate"] == {"label": "unplaceable"}             # what is unknown is absent
    assert TrialRecord.from_attrs(pruned.to_attrs()) == pruned
    study = optuna.create_study()
    trial = study.ask()
    for k, v in attrs.items():
        trial.set_user_attr(k, v)
    study.tell(trial, 1.0)
    assert TrialRecord.from_trial(study.trials[0]) == rec
    assert rec.label == "fill 1.00 last out gpu" and rec.candidate.gpu_bytes == {"CUDA0": 15 << 30}
    assert rec.measured.vram_bytes == (17 << 30) + 4096 and not rec.engine_run     # a baseline's run, taken over


def test_the_stored_measurement_is_the_shape_tuners_always_wrote():
    m = Measurement(pp_tps=100.0, tg_tps=10.0, peak_bytes={"CUDA0": 5}, host_bytes=7, raw={"cv": 0.02, "log": "x"})
    assert _mdict(m) == {"pp_tps": 100.0, "tg_tps": 10.0, "ok": True, "error": "", "peak_bytes": {"CUDA0": 5},
                         "host_bytes": 7, "cv": 0.02}
    run = MeasuredRun.from_dict(_mdict(m))
    assert run.to_dict() == _mdict(m) and MeasuredRun.from_measurement(run) is run
    assert MeasuredRun.failed("oom").to_dict() == {"pp_tps": 0.0, "tg_tps": 0.0, "ok": False, "error": "oom",
                                                   "peak_bytes": {}, "host_bytes": 0}


def _old_db(tmp_path) -> str:
    db = tmp_path / "old.db"
    with gzip.open(DATA, "rb") as src, db.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return f"sqlite:///{db}"


def test_version_1_trials_of_the_checked_in_study_read_and_keep_their_stored_form(tmp_path):
    study = optuna.load_study(study_name="old", storage=_old_db(tmp_path))
    trials = study.get_trials(deepcopy=False)
    records = [TrialRecord.from_trial(t) for t in trials]
    assert all(r.version == 1 for r in records)                  # no record_version key: written before versions
    done = [(t, r) for t, r in zip(trials, records) if t.state.name == "COMPLETE"]
    assert len(done) == 7
    for t, r in done:
        assert r.plan().id == r.plan_id and r.measured.ok and r.terms is not None
        assert r.measured.tg_tps > 0 and r.candidate.predicted.tg_tps > 0 and r.commands["llama-server"]
        # the stored form has not changed: a v1 record writes back exactly its attrs, plus the version
        assert r.to_attrs() == dict(t.user_attrs, record_version=1)
    assert sum(r.reused_baseline_run for _, r in done) == 1 and sum(r.engine_run for _, r in done) == 6
    waiting = [r for t, r in zip(trials, records) if t.state.name == "WAITING"]
    assert len(waiting) == 9 and all(r.plan_id and r.source != "sampler" and r.measured is None for r in waiting)


def test_a_resumed_old_study_writes_version_2_records_and_leaves_the_old_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    url = _old_db(tmp_path)
    before = {t.number: dict(t.user_attrs) for t in optuna.load_study(study_name="old", storage=url).trials
              if t.state.name == "COMPLETE"}
    assert cli.main(["tune", "preset:Qwen3-30B-A3B", "--engine", "sim", "--hardware", "rtx4090-ddr5", "--gpu",
                     "16GiB", "--trials", "1", "--pool", "20", "--storage", url, "--study", "old", "--no-report",
                     "--quiet", "--objective", "tg"]) == 0
    capsys.readouterr()
    trials = optuna.load_study(study_name="old", storage=url).trials
    assert {t.number: dict(t.user_attrs) for t in trials if t.number in before} == before
    ran = [TrialRecord.from_trial(t) for t in trials if t.number not in before and t.state.name != "WAITING"]
    assert ran and all(r.version == RECORD_VERSION for r in ran)


@pytest.mark.parametrize("version", [3, 99])
def test_a_newer_record_version_is_refused_with_one_clear_error(version):
    attrs = _full_record().to_attrs() | {"record_version": version}
    with pytest.raises(RecordError, match=rf"trial 7 was stored by a newer offload-tuner \(trial record version "
                                          rf"{version}; this one reads versions 1 to {RECORD_VERSION}\)"):
        TrialRecord.from_attrs(attrs, 7)
    assert issubclass(RecordError, InputError)       # the CLI prints it on one line and exits 2


@pytest.mark.parametrize("attrs, what", [({"record_version": 0}, "no offload-tuner writes"),
                                         ({"record_version": "2"}, "no offload-tuner writes"),
                                         ({"record_version": True}, "no offload-tuner writes"),
                                         ({"measured": [1, 2]}, "'measured' cannot be read"),
                                         ({"candidate": {"label": "x", "predicted": {"tg_tps": 1}}},
                                          "'candidate' cannot be read"),
                                         ({"terms": {"tg": {"CUDA0_read": 1.0}, "pp": {}, "pp_tokens": 1}},
                                          "'terms' cannot be read"),
                                         ({"plan": {"not": "json text"}}, "'plan' cannot be read")])
def test_a_damaged_record_names_the_trial_and_the_key(attrs, what):
    with pytest.raises(RecordError, match=what):
        TrialRecord.from_attrs(attrs, 4)


def test_report_on_a_study_with_a_newer_record_says_so_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    url = _old_db(tmp_path)
    with sqlite3.connect(url[len("sqlite:///"):]) as con:
        trial_id = con.execute("SELECT MIN(trial_id) FROM trial_user_attributes").fetchone()[0]
        con.execute("INSERT INTO trial_user_attributes (trial_id, key, value_json) VALUES (?, ?, ?)",
                    (trial_id, "record_version", "3"))
    assert cli.main(["report", "old", "--storage", url, "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "newer offload-tuner" in err and "record version 3" in err


class _FakeTrial:
    """The part of optuna.Trial a RecordWriter uses, counting the attrs it sets (each one a commit)."""

    def __init__(self, attrs: dict) -> None:
        self.user_attrs, self.number, self.sets = dict(attrs), 5, []

    def set_user_attr(self, key, value) -> None:
        self.sets.append(key)
        self.user_attrs[key] = value


def test_the_writer_sets_each_attr_once_as_the_trial_learns_it():
    trial = _FakeTrial(TrialRecord(source="surrogate", plan_id="ab").to_attrs())       # as enqueued
    w = RecordWriter(trial)
    assert w.update().source == "surrogate" and trial.sets == []                         # nothing new to store
    w.update(plan_id="ab", plan_json="{}", candidate=CandidateInfo("x"))
    assert trial.sets == ["plan", "candidate"]
    w.update(measured=MeasuredRun(tg_tps=1.0))
    assert trial.sets == ["plan", "candidate", "measured"]
    assert TrialRecord.from_trial(trial) == w.record
    v1 = _FakeTrial({"source": "default", "plan_id": "cd"})        # enqueued by an older tuner: made version 2
    RecordWriter(v1).update()
    assert v1.sets == ["record_version"] and v1.user_attrs["record_version"] == RECORD_VERSION
    fresh = _FakeTrial({})                                         # the sampler's: its source is written too
    RecordWriter(fresh).update()
    assert fresh.sets == ["record_version", "source"] and fresh.user_attrs["source"] == "sampler"
