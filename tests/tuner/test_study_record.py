"""The study record (tuner.records.StudyRecord): a study's own attrs, typed, in every version this tuner
knows (version 1: the attrs tuners wrote before it; data/old_study_v1.db.gz is such a study), a newer version
refused with one line, and nothing a study stores that the record does not name."""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import optuna
import pytest

from offload_tuner import cli
from planner.errors import RecordError
from planner.hardware import GiB, load_hardware
from planner.presets import load_preset
from tuner.records import STUDY_RECORD_VERSION, STUDY_VERSION_KEY, StudyRecord
from tuner.search import BenchRun, Tuner, StudyConfig
from runtime.sim import SimEngine

DATA = Path(__file__).resolve().parent / "data" / "old_study_v1.db.gz"


def _old_db(tmp_path) -> str:
    db = tmp_path / "old.db"
    with gzip.open(DATA, "rb") as src, db.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return f"sqlite:///{db}"


def test_an_old_study_reads_as_version_1_and_stays_so_when_it_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    url = _old_db(tmp_path)
    old = StudyRecord.of(optuna.load_study(study_name="old", storage=url))
    assert old.version == 1 and old.settings.engine == "sim" and old.objective_names == ["tg"]
    assert old.margin_rule == "learnt" and old.margin_bytes == 0 and old.seeded and old.cost_fit
    assert [b["kind"] for b in old.baselines or []][:1] == ["fit-like"] and old.memory_errors == [0] * 9
    assert old.confirmed is None and old.margin_by_ubatch == {} and old.request_time is None
    assert cli.main(["tune", "preset:Qwen3-30B-A3B", "--engine", "sim", "--hardware", "rtx4090-ddr5", "--gpu",
                     "16GiB", "--trials", "1", "--pool", "20", "--storage", url, "--study", "old", "--no-report",
                     "--quiet", "--objective", "tg"]) == 0
    capsys.readouterr()
    study = optuna.load_study(study_name="old", storage=url)
    after = StudyRecord.of(study)
    assert STUDY_VERSION_KEY not in study.user_attrs and after.version == 1      # the same keys: still version 1
    assert after.settings == old.settings and after.baselines == old.baselines
    # typed, the settings still write back what the study stores (its "workload" key holds the bench run; the keys
    # an older offload-tuner did not store stay out)
    stored = study.user_attrs["settings"]
    assert after.settings.to_dict() == stored and "requests" not in stored and after.settings.requests is None
    assert after.settings.bench.n_prompt == stored["workload"]["n_prompt"]


def test_a_new_study_stores_only_what_the_record_names_with_its_version():
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("rtx4090-ddr5").with_vram([16 * GiB])
    t = Tuner(inv, hw, SimEngine(hw), StudyConfig(objective="both", bench=BenchRun(512, 32, 0, 1),
                                                   n_ctx=4096, pool_size=20, seed=2))
    t.run(4)
    t.confirm(2, n_tg=1)
    stored = t.study.user_attrs
    assert stored[STUDY_VERSION_KEY] == STUDY_RECORD_VERSION
    assert set(stored) - {STUDY_VERSION_KEY} <= {f for f in StudyRecord.__dataclass_fields__ if f != "version"}
    rec = StudyRecord.of(t.study)
    assert rec.version == STUDY_RECORD_VERSION and rec.baselines and rec.confirmed and rec.confirmation
    assert all(isinstance(k, int) for k in rec.memory_errors_by_ubatch)
    assert set(stored["memory_errors_by_ubatch"]) == {str(k) for k in rec.memory_errors_by_ubatch}


def test_fields_round_trip_through_the_stored_json():
    study = optuna.create_study()
    StudyRecord.save(study, margin_by_ubatch={4096: 3 * GiB, 512: 0}, memory_errors_by_ubatch={512: [1, -2]},
                     confirmation=None, explored=True)
    assert study.user_attrs["margin_by_ubatch"] == {"4096": 3 * GiB, "512": 0}    # as tuners always stored it
    rec = StudyRecord.of(study)
    assert rec.margin_by_ubatch == {4096: 3 * GiB, 512: 0} and rec.memory_errors_by_ubatch == {512: [1, -2]}
    assert rec.confirmation is None and rec.explored and rec.baselines is None and rec.baselines_partial == []
    with pytest.raises(TypeError, match="no field 'margins'"):
        StudyRecord.save(study, margins={})


@pytest.mark.parametrize("attrs, what", [({STUDY_VERSION_KEY: 3}, "newer offload-tuner"),
                                         ({STUDY_VERSION_KEY: "2"}, "no offload-tuner writes"),
                                         ({"margin_by_ubatch": {"x": 1}}, "'margin_by_ubatch' cannot be read"),
                                         ({"memory_errors": 5}, "'memory_errors' cannot be read")])
def test_a_newer_or_damaged_study_record_is_refused_naming_the_study(attrs, what):
    with pytest.raises(RecordError, match=what):
        StudyRecord.from_attrs(attrs, "s")
