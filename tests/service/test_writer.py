"""Who writes a study, read from the storage (offload_tuner/service/studies.py): the SQLite worker lock through
/proc/locks without taking it, and for other storages a RUNNING trial's heartbeat (or its start) within Optuna's
grace period."""
from __future__ import annotations

import fcntl
import warnings

import pytest

from offload_tuner.service.studies import StudyRef, StudyStore, flock_held, running_trial


def test_flock_held_reads_without_taking(tmp_path):
    lock = tmp_path / "s.db.lock"
    if flock_held(lock) is None:
        pytest.skip("no /proc/locks here")
    assert flock_held(lock) is False                   # no file: nobody ever ran there
    with open(lock, "a+b") as f:
        assert flock_held(lock) is False
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert flock_held(lock) is True
        with open(lock, "a+b") as g, pytest.raises(OSError):      # the holder still holds it
            fcntl.flock(g.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        assert flock_held(lock) is False


def test_running_trial_by_heartbeat(tmp_path):
    import optuna
    import sqlalchemy
    from optuna.storages._rdb import models

    from tuner.storage import make_storage
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path / 's.db'}"
    storage = make_storage(url)
    study = optuna.create_study(study_name="s", storage=storage)
    assert running_trial(study, storage) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                # Optuna: heartbeats are meant for optimize()
        t = study.ask()                                # RUNNING, no heartbeat yet, just started
    assert "started within" in running_trial(study, storage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage.record_heartbeat(t._trial_id)
    assert "heartbeat is live" in running_trial(study, storage)
    with storage.engine.begin() as conn:               # a worker that died a minute ago
        conn.execute(sqlalchemy.update(models.TrialHeartbeatModel).values(
            heartbeat=sqlalchemy.text("datetime('now', '-60 seconds')")))
    assert running_trial(study, storage) is None
    # the store: with /proc/locks readable, the lock decides for SQLite: a live heartbeat without it is a trial
    # whose worker was killed a moment ago
    storage.record_heartbeat(t._trial_id)
    assert running_trial(study, storage)
    store = StudyStore(url, tmp_path)
    if flock_held(tmp_path / "s.db.lock") is not None:
        assert store.writer(StudyRef("s", url)) is None
        with open(tmp_path / "s.db.lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert "SQLite lock" in store.writer(StudyRef("s", url))
