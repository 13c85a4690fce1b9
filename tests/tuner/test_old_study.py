"""A study database written by an older tuner still resumes and reports (issue 13): the trials' stored shape
(tuner.records' measured_dict / TrialRecord, the study's StudyRecord) is a format other code has on disk.
data/old_study_v1.db.gz was written at commit 1d60553, before the tuner moved to tuner/ (data/README.md)."""
from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
from pathlib import Path

from offload_tuner import cli

DATA = Path(__file__).resolve().parent / "data" / "old_study_v1.db.gz"
OLD_COMPLETE = 7     # what the old tuner left: 7 complete trials (6 runs and a reused baseline), 9 waiting


def test_old_study_resumes_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "old.db"
    with gzip.open(DATA, "rb") as src, db.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    url = f"sqlite:///{db}"
    before = _values(db)
    assert len(before) == OLD_COMPLETE
    # the same study as it was made (a different setting would be refused as another study), two more runs
    assert cli.main(["tune", "preset:Qwen3-30B-A3B", "--engine", "sim", "--hardware", "rtx4090-ddr5", "--gpu", "16GiB",
                     "--trials", "2", "--pool", "20", "--storage", url, "--study", "old", "--no-report",
                     "--quiet", "--objective", "tg"]) == 0
    capsys.readouterr()
    out = tmp_path / "report"
    assert cli.main(["report", "old", "--storage", url, "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["counts"]["complete"] >= OLD_COMPLETE + 1      # the old trials and at least one new run
    assert {b["name"] for b in summary["baselines"]} >= {"-ngl 99 -cmoe"}
    assert (out / "report.json").exists()
    after = _values(db)
    assert after.items() >= before.items() and len(after) > len(before)     # resumed: old values kept, runs added


def _values(db) -> dict[int, float]:
    """Objective value per trial id, read from the database itself (what an older tuner wrote stays as it was)."""
    with sqlite3.connect(db) as con:
        return dict(con.execute("SELECT trial_id, value FROM trial_values").fetchall())
