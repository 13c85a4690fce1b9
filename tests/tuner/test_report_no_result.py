"""`report` of a study without a finished trial (issue 43, item 4): an empty study, one with only waiting trials,
one with a stale running trial, one whose every trial failed, a plain Optuna study without our attrs, and a
read-only study file. Each writes a report that says what the study holds, exits 0 without a traceback, leaves the
database as it was (its bytes, its mtime, no -wal/-shm/-journal beside it) and no temporary folder; a report that
fails while writing leaves nothing half-written."""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from cli_outcome import run_cli
from tuner.options import Settings
from tuner.records import RECORD_VERSION, StudyRecord

SETTINGS = {"model": "preset:Qwen3-30B-A3B", "model_id": "Qwen3-30B-A3B", "engine": "sim", "dialect": "mainline",
            "objective": "tg", "n_ctx": 8192, "hardware": {"name": "box", "gpus": [["CUDA0", 16 << 30]]},
            "workload": {"n_prompt": 512, "n_gen": 128, "depth": 0}}
CRASH = "crashed with SIGSEGV: ggml_cuda_compute_forward: MUL_MAT failed"
REPORT_FILES = {"summary.md", "summary.html", "trials.csv", "report.json", "throughput_vs_vram.png",
                "throughput_vs_vram.svg", "pareto.png", "pareto.svg", "history.png", "history.svg"}


def _ours(study) -> None:
    StudyRecord.create(study, settings=Settings.from_dict(SETTINGS), objective_names=["tg_tps"])


def _waiting(study, n: int) -> None:
    for i in range(n):
        study.enqueue_trial({}, user_attrs={"record_version": RECORD_VERSION, "source": "default",
                                            "plan_id": f"p{i}"})


def _running(study) -> None:
    t = study.ask()         # left RUNNING: its worker "died" (no heartbeat storage here: it stays RUNNING)
    t.set_user_attr("source", "sampler")


def _failed(study, errors: list[str | None]) -> None:
    for e in errors:
        t = study.ask()
        if e is not None:
            t.set_user_attr("measured", {"ok": False, "error": e, "pp_tps": 0.0, "tg_tps": 0.0, "peak_bytes": {},
                                         "host_bytes": 0})
        study.tell(t, state=TrialState.FAIL)


def _plant(kind: str, url: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    if kind != "plain optuna":
        _ours(study)
    if kind == "waiting only":
        _waiting(study, 2)
    elif kind == "stale running":
        _running(study)
    elif kind == "all failed":
        _failed(study, [CRASH, CRASH, "out of memory: cudaMalloc of 2048 MiB on CUDA0 failed", None])
    elif kind == "mixed":
        _running(study)
        _failed(study, [CRASH, CRASH, CRASH])
        _waiting(study, 2)                 # last: study.ask() takes a waiting trial first
    elif kind == "plain optuna":          # made by optuna.create_study, without the tuner's attrs
        _failed(study, [None])
        _waiting(study, 1)


# what each study holds, as the report's first words say it
HOLDS = {
    "empty": ["no finished trial: 0 complete, 0 waiting, 0 running, 0 failed", "holds no trial yet"],
    "waiting only": ["no finished trial: 0 complete, 2 waiting, 0 running, 0 failed"],
    "stale running": ["no finished trial: 0 complete, 0 waiting, 1 running, 0 failed"],
    "all failed": ["no finished trial: 0 complete, 0 waiting, 0 running, 4 failed",
                   "every trial failed: 2 crashed (SIGSEGV: ggml_cuda_compute_forward: MUL_MAT failed)",
                   "1 failed (no result recorded (interrupted, or the worker died))",
                   "1 out of memory (out of memory: cudaMalloc of 2048 MiB on CUDA0 failed)"],
    "mixed": ["no finished trial: 0 complete, 2 waiting, 1 running, 3 failed",
              "the failures: 3 crashed (SIGSEGV: ggml_cuda_compute_forward: MUL_MAT failed), 0 out of memory"],
    "plain optuna": ["no finished trial: 0 complete, 1 waiting, 0 running, 1 failed"],
}


def _state(db: Path) -> tuple[str, int, list[str]]:
    """The database file's bytes (a hash), its mtime and what lies beside it."""
    return hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns, sorted(os.listdir(db.parent))


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("kind", list(HOLDS))
def test_report_of_a_study_without_a_finished_trial_says_what_it_holds(kind, tmp_path):
    db = tmp_path / "db" / "s.db"
    db.parent.mkdir()
    url = f"sqlite:///{db}"
    _plant(kind, url)
    before = _state(db)
    out = tmp_path / "rep"
    o = run_cli(["report", "s", "--storage", url, "--out", str(out)], time_limit_s=120)
    assert o.kind == "ok", (o.kind, o.rc, o.stderr[-3000:])
    assert "Traceback" not in o.stderr
    assert _state(db) == before                    # not a byte, not the mtime, no -wal/-shm/-journal left
    assert {p.name for p in out.iterdir()} == REPORT_FILES and not _leftovers(tmp_path)
    md = (out / "summary.md").read_text()
    for words in HOLDS[kind]:
        assert words in md, (words, md[:800])
    rep = json.loads((out / "report.json").read_text())
    assert rep["no_result"].startswith(HOLDS[kind][0]) and rep["n_trials"] == sum(rep["counts"].values())

    o = run_cli(["report", "s", "--storage", url, "--out", str(out), "--json"], time_limit_s=120)   # again, --json
    assert o.kind == "ok", (o.kind, o.rc, o.stderr[-3000:])
    assert _state(db) == before and {p.name for p in out.iterdir()} == REPORT_FILES and not _leftovers(tmp_path)


def test_report_json_says_what_the_study_holds(tmp_path, capsys):
    from offload_tuner import cli
    url = f"sqlite:///{tmp_path / 's.db'}"
    _plant("mixed", url)
    assert cli.main(["report", "s", "--storage", url, "--out", str(tmp_path / "rep"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["no_result"].startswith(HOLDS["mixed"][0]) and HOLDS["mixed"][1] in rep["no_result"]
    assert rep["counts"] == {"waiting": 2, "running": 1, "fail": 3} and rep["best"] == {"tg": None, "pp": None}


def test_a_read_only_study_file_is_read_through_a_copy_and_left_as_it_was(tmp_path, monkeypatch):
    """A 0444 file in a 0555 folder (in WAL mode, as tune leaves it). Root writes through chmod, so besides its
    bytes and mtime the test checks that every SQLite connection to the file itself is read-only (mode=ro) and
    that Optuna opens a copy."""
    folder = tmp_path / "ro"
    folder.mkdir()
    db = folder / "s.db"
    url = f"sqlite:///{db}"
    _plant("all failed", url)
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode=WAL")
    con.close()
    db.chmod(0o444)
    folder.chmod(0o555)
    before = _state(db)
    opened: list[str] = []
    connect = sqlite3.connect

    def spy(database, *a, **kw):
        opened.append(str(database))
        return connect(database, *a, **kw)
    monkeypatch.setattr(sqlite3, "connect", spy)
    try:
        o = run_cli(["report", "s", "--storage", url, "--out", str(tmp_path / "rep")], time_limit_s=120)
    finally:
        monkeypatch.undo()
        folder.chmod(0o755)
    assert o.kind == "ok", (o.kind, o.rc, o.stderr[-3000:])
    assert _state(db) == before
    mine = [c for c in opened if str(db.resolve()) in c or c == str(db)]
    assert mine and all("mode=ro" in c for c in mine), opened
    assert any(c.endswith("study.db") and str(db) not in c for c in opened), opened    # Optuna read the copy
    assert HOLDS["all failed"][1] in (tmp_path / "rep" / "summary.md").read_text()


@pytest.mark.parametrize("existing", [False, True])
def test_a_report_that_fails_while_writing_leaves_nothing_half_written(existing, tmp_path, monkeypatch):
    from tuner import report
    url = f"sqlite:///{tmp_path / 's.db'}"
    _plant("all failed", url)
    out = tmp_path / "reports" / "deeper" / "rep"
    if existing:                        # an earlier report stays as it was
        out.mkdir(parents=True)
        (out / "summary.md").write_text("the earlier report")

    def broken(*a, **kw):
        raise RuntimeError("the disk went away while plotting")
    monkeypatch.setattr(report, "write_plots", broken)
    from tuner.storage import read_study
    with read_study("s", url) as study, pytest.raises(RuntimeError, match="went away"):
        report.write_study_report(study, out)
    if existing:
        assert [p.name for p in out.iterdir()] == ["summary.md"]
        assert (out / "summary.md").read_text() == "the earlier report"
        assert not _leftovers(out.parent)
    else:
        assert not (tmp_path / "reports").exists()     # nor the folders it made above it


def test_a_plain_optuna_study_with_complete_trials_reports(tmp_path):
    """Complete trials without the tuner's records: a report without a best configuration, not a traceback."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    o = run_cli(["report", "s", "--storage", url, "--out", str(tmp_path / "rep")], time_limit_s=120)
    assert o.kind == "ok", (o.kind, o.rc, o.stderr[-3000:])
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["counts"] == {"complete": 3} and "no_result" not in rep
