"""Storage faults on the real thing (tuner/storage.py): the PostgreSQL server restarted under two tune
workers, the file system filling up under an SQLite study (a file-size limit on the worker), and damaged SQLite
files given to tune, report and serve. Each ends in one line naming the storage and exit 2, or carries on; no
finished trial is lost or stored twice, and the study resumes."""
from __future__ import annotations

import os
import resource
import signal
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from cli_outcome import run_cli
from tuner import storage as storage_module

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
MODEL = "preset:Qwen3-30B-A3B:Q4_K_M"


def _tune(storage: str, trials: int, seed: int = 1, study: str = "s") -> list[str]:
    return [sys.executable, "-m", "offload_tuner.cli", "tune", MODEL, "--engine", "sim", "--gpu", "16GiB", "--trials",
            str(trials), "--study", study, "--storage", storage, "--pool", "0", "--quiet", "--no-report",
            "--objective", "tg", "--seed", str(seed)]


def _trials(storage: str, study: str = "s") -> list:
    import optuna
    return optuna.load_study(study_name=study, storage=storage_module.make_storage(storage)).get_trials(deepcopy=False)


def _finished(trials: list) -> dict[int, tuple]:
    """trial number -> (state, values) of the finished trials."""
    return {t.number: (t.state, t.values) for t in trials if t.state.is_finished()}


def _one_line(err: str) -> str:
    """The error line of a worker's stderr (the "# tune ..." line it starts with aside)."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("# ")]
    assert len(lines) == 1 and lines[0].startswith("offload-tuner: ") and "Traceback" not in err, err[-3000:]
    return lines[0]


# ---- the PostgreSQL server restarted under two workers --------------------------------------------------------

@pytest.mark.slow
def test_postgresql_restarted_under_two_workers(postgres_server, tmp_path, monkeypatch):
    """Each worker carries on (a dead pooled connection is replaced: pool_pre_ping) or stops with one line that
    names the storage and says how to resume; afterwards every trial finished before is there unchanged, each
    trial number once, the trials left RUNNING are failed and retried by the heartbeat, and the study resumes."""
    import optuna
    url = postgres_server.url
    workers = [subprocess.Popen(_tune(url, 400, seed), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    try:
        deadline = time.monotonic() + 240
        while len(_finished(_safe_trials(url))) < 12:
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "the workers ran nothing"
            time.sleep(0.2)
        before = _finished(_trials(url))
        postgres_server.restart()
        ends = [(w.wait(timeout=400), w.stderr.read()) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    for rc, err in ends:
        if rc == 0:
            assert "Traceback" not in err, err[-3000:]
        else:
            line = _one_line(err)
            assert rc == 2 and "run the same command to resume" in line and "postgres" in line, (rc, err)
    after = _trials(url)
    numbers = [t.number for t in after]
    assert len(numbers) == len(set(numbers))                    # none counted twice
    now = _finished(after)
    assert {n: now.get(n) for n in before} == before            # none lost, none changed
    # what a stopped worker left RUNNING: failed and queued again once its heartbeat is stale (1 s here)
    monkeypatch.setattr(storage_module, "GRACE_S", 1)
    monkeypatch.setattr(storage_module, "HEARTBEAT_S", 1)
    time.sleep(2)
    study = optuna.load_study(study_name="s", storage=storage_module.make_storage(url))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    assert not [t.number for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING]
    # the study resumes: both workers again, to the end of their runs
    for seed in (3, 4):
        r = subprocess.run(_tune(url, 3, seed), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
    final = _trials(url)
    assert len(_finished(final)) >= len(now) + 6
    assert {n: _finished(final).get(n) for n in before} == before


def _safe_trials(url: str) -> list:
    try:
        return _trials(url)
    except Exception:           # the workers are creating the tables
        return []


# ---- the file system filling up under an SQLite study ---------------------------------------------------------

def _file_size_limit(limit: int):
    """preexec_fn: files the worker writes stop growing at `limit` bytes (write() fails with EFBIG, as on a full
    disk; SIGXFSZ ignored, else the kernel kills the writer)."""
    def setup() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return setup


def _integrity(db: Path) -> list:
    con = sqlite3.connect(db)
    try:
        return con.execute("PRAGMA integrity_check").fetchall()
    finally:
        con.close()


@pytest.mark.slow
def test_a_full_disk_under_an_sqlite_study(tmp_path):
    """The study file (and its WAL) may grow 100 kB more: the worker stops with one line naming the file, exit 2;
    the file is intact, every trial finished before is kept, and the same command resumes the study."""
    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    r = subprocess.run(_tune(url, 3), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    before = _finished(_trials(url))
    r = subprocess.run(_tune(url, 400), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400,
                       preexec_fn=_file_size_limit(db.stat().st_size + 100_000))
    line = _one_line(r.stderr)
    assert r.returncode == 2 and str(db) in line and "size limit" in line and "resume" in line, (r.returncode, line)
    assert _integrity(db) == [("ok",)]
    full = _finished(_trials(url))
    assert {n: full.get(n) for n in before} == before and len(full) < 400
    r = subprocess.run(_tune(url, 3), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _integrity(db) == [("ok",)]
    after = _trials(url)
    assert len(_finished(after)) >= len(full) + 3
    assert {n: _finished(after).get(n) for n in full} == full
    assert len({t.number for t in after}) == len(after)


# ---- damaged SQLite files given to tune, report and serve -----------------------------------------------------

@pytest.fixture(scope="module")
def good_study(tmp_path_factory) -> Path:
    """A real study file (a 3-run sim study), checkpointed: everything in the one file."""
    d = tmp_path_factory.mktemp("good")
    r = subprocess.run(_tune(f"sqlite:///{d / 'good.db'}", 3), cwd=d, env=ENV, capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    con = sqlite3.connect(d / "good.db")
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    return d / "good.db"


def _damage(good: Path, out: Path, how: str) -> Path:
    data = good.read_bytes()
    if how == "garbage":
        out.write_bytes(bytes((i * 131 + 7) % 256 for i in range(len(data))))
    elif how == "truncated":
        out.write_bytes(data[:len(data) // 3])
    elif how == "a page overwritten":         # the header and schema intact: SQLite opens it, a table is garbage
        mid = len(data) // 2 // 4096 * 4096
        out.write_bytes(data[:mid] + b"\xab" * 4096 + data[mid + 4096:])
    return out


COMMANDS = {
    "tune": ["tune", MODEL, "--engine", "sim", "--gpu", "16GiB", "--trials", "2", "--study", "s", "--pool", "0",
             "--quiet", "--no-report", "--storage"],
    "report": ["report", "s", "--out", "{tmp}/rep", "--storage"],
    "serve": ["serve", "--port", "0", "--storage"],
}


@pytest.mark.parametrize("how", ["garbage", "truncated", "a page overwritten"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_damaged_sqlite_file_is_one_line_naming_it(good_study, tmp_path, monkeypatch, command, how):
    monkeypatch.chdir(tmp_path)
    db = _damage(good_study, tmp_path / "bad.db", how)
    argv = [a.format(tmp=tmp_path) for a in COMMANDS[command]] + [f"sqlite:///{db}"]
    o = run_cli(argv, time_limit_s=120)
    assert o.kind == "error" and o.rc == 2, (o.kind, o.rc, o.stderr[-3000:])
    assert f"storage {db} is damaged" in o.stderr or f"storage {db} is not a readable SQLite" in o.stderr, o.stderr
