"""Work a request repeats is done once: an answer per request (memo.py), a study's reads until its file changes
(studies.py), the package's presets read once; and each is redone when its input changes."""
from __future__ import annotations

import threading
import time

import optuna
import pytest

from offload_tuner.app import PlanRequest
from offload_tuner.service.memo import Memo
from offload_tuner.service import studies
from offload_tuner.service.studies import StorageBusy, StudyStore
from tuner.storage import make_storage


def test_the_same_request_is_answered_once_and_an_error_is_not_kept():
    memo, calls = Memo(size=2), []

    def answer(text: str):
        return lambda: calls.append(text) or text.encode()
    a, b, c = (PlanRequest(model="preset:Qwen3-30B-A3B", gpu=g) for g in ("8GiB", "16GiB", "24GiB"))
    assert memo.get("plan", a, answer("a")) == b"a"
    assert memo.get("plan", a, answer("again")) == b"a"          # kept
    memo.get("plan", b, answer("b"))
    memo.get("plan", c, answer("c"))                              # size 2: a, the oldest, goes
    assert memo.get("plan", a, answer("a2")) == b"a2"
    assert calls == ["a", "b", "c", "a2"] and (memo.hits, memo.misses) == (1, 4)
    with pytest.raises(ValueError):
        memo.get("plan", b, lambda: (_ for _ in ()).throw(ValueError("no")))   # b was dropped by a2: asked again
    assert memo.get("plan", b, answer("b2")) == b"b2"


def test_clients_asking_at_once_get_one_computation():
    memo, calls, gate = Memo(), [], threading.Event()

    def slow():
        calls.append(1)
        gate.wait(5)
        return b"x"
    req = PlanRequest(model="preset:Qwen3-30B-A3B", gpu="16GiB")
    out = []
    threads = [threading.Thread(target=lambda: out.append(memo.get("plan", req, slow))) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join()
    assert out == [b"x"] * 8 and calls == [1]


def test_an_edited_model_file_is_read_again(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"one")
    memo, req = Memo(), PlanRequest(model=str(f), gpu="16GiB")
    assert memo.get("plan", req, lambda: b"1") == b"1"
    assert memo.get("plan", req, lambda: b"2") == b"1"
    f.write_bytes(b"other")                                  # size and mtime change
    assert memo.get("plan", req, lambda: b"3") == b"3"


def _trial(study, x: float) -> None:
    t = study.ask()
    study.tell(t, x)


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_a_study_is_read_again_after_each_commit_and_not_before(tmp_path, monkeypatch):
    d = tmp_path / "studies"
    d.mkdir()
    url = f"sqlite:///{d / 's.db'}"
    study = optuna.create_study(study_name="s", storage=make_storage(url))
    _trial(study, 1.0)
    monkeypatch.setattr(studies, "MIN_AGE_S", 0.0)        # the once-a-second bound: its own test below
    store = StudyStore(None, d)
    reads = []
    real = StudyStore._open
    monkeypatch.setattr(StudyStore, "_open", lambda self, r: reads.append(r.name) or real(self, r))
    assert store.progress("s")["n_trials"] == 1
    assert store.progress("s")["n_trials"] == 1 and store.listing()[0]["n_trials"] == 1
    assert reads == ["s", "s"]                       # progress once, the listing's brief once
    _trial(study, 2.0)                               # a worker's commit
    assert store.progress("s")["n_trials"] == 2 and store.listing()[0]["n_trials"] == 2
    assert reads == ["s"] * 4


def test_a_storage_that_does_not_answer_is_a_503_not_a_500(tmp_path, monkeypatch):
    d = tmp_path / "studies"
    d.mkdir()
    optuna.create_study(study_name="s", storage=make_storage(f"sqlite:///{d / 's.db'}"))
    store = StudyStore(None, d)

    def locked(self, r):
        raise optuna.exceptions.StorageInternalError("database is locked")
    monkeypatch.setattr(StudyStore, "_open", locked)
    with pytest.raises(StorageBusy, match="did not answer") as e:
        store.progress("s")
    assert e.value.status == 503


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_a_study_written_many_times_a_second_is_summarised_at_most_once_a_second(tmp_path, monkeypatch):
    d = tmp_path / "studies"
    d.mkdir()
    study = optuna.create_study(study_name="s", storage=make_storage(f"sqlite:///{d / 's.db'}"))
    _trial(study, 1.0)
    monkeypatch.setattr(studies, "MIN_AGE_S", 0.5)
    store = StudyStore(None, d)
    assert store.detail("s")["n_trials"] == 1
    _trial(study, 2.0)
    assert store.detail("s")["n_trials"] == 1              # kept: computed less than 0.5 s ago
    assert store.progress("s")["n_trials"] == 2            # the progress events: every commit
    time.sleep(0.6)
    assert store.detail("s")["n_trials"] == 2


@pytest.mark.filterwarnings("ignore:Heartbeat")
def test_what_is_kept_of_a_study_never_keeps_its_writer(tmp_path):
    # a tune stopped or killed leaves the SQLite file as it was: the JSON and page kept from before must not say
    # it still runs (the writer is asked on every call, beside what is kept)
    import fcntl

    from offload_tuner.service.studies import flock_held
    d = tmp_path / "studies"
    d.mkdir()
    study = optuna.create_study(study_name="s", storage=make_storage(f"sqlite:///{d / 's.db'}"))
    _trial(study, 1.0)
    lock = d / "s.db.lock"
    if flock_held(lock) is None:
        pytest.skip("no /proc/locks here")
    store, made = StudyStore(None, d), []
    with open(lock, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)          # a tune writes it
        value, writer = store.derived("s", "json", lambda dt: made.append(dt) or "x")
        assert value == "x" and "SQLite lock" in writer and store.detail("s")["writer"] == writer
    value, writer = store.derived("s", "json", lambda dt: made.append(dt) or "y")
    assert value == "x" and writer is None and store.detail("s")["writer"] is None   # kept, but nobody writes
    assert len(made) == 1 and "writer" not in made[0]


def test_the_event_streams_of_a_study_share_one_read_a_second():
    """Latest (app.py): fifty streams asking at once cost one progress read; a snapshot younger than max_age is
    answered without a read; an older one is read again; a failed read is not kept (the next ask reads)."""
    import asyncio

    from offload_tuner.service.app import Latest
    reads: list[str] = []

    async def read(name: str):
        reads.append(name)
        await asyncio.sleep(0.05)
        if name == "bad":
            raise StorageBusy("busy")
        return {"n": len(reads)}

    async def scenario():
        latest = Latest(read, max_age_s=0.3)
        got = await asyncio.gather(*(latest.get("s") for _ in range(50)))
        assert reads == ["s"] and all(g == {"n": 1} for g in got)
        assert await latest.get("s") == {"n": 1} and reads == ["s"]      # kept: no read
        await asyncio.sleep(0.35)
        assert await latest.get("s") == {"n": 2}                          # too old: read again
        for _ in range(2):
            with pytest.raises(StorageBusy):
                await latest.get("bad")
        assert reads.count("bad") == 2
    asyncio.run(scenario())
