"""Studies as the service reads them: the SQLite files under studies/ (one per study, as `tune` writes them by
default) or every study in one --storage URL. A study's JSON is `report --json`'s summary (tuner.report)
plus its trials and throughput-versus-VRAM fronts, for the API and the web view.

Reading a study costs a query per trial table and a DataFrame (~0.1-1 s); many clients read the same studies while
one worker writes a trial every second or so. So what is read from an SQLite file is kept until the file changes
(its and its WAL's size and modification time: a commit changes one of them), one read of a study runs at a time,
and a study's summary is read at most once a second (StudyStore._cached). A server database (PostgreSQL) is read
every time."""
from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import InputError
from tuner.storage import shown_url, sqlite_path
from .security import NotFound, ServiceError

log = logging.getLogger(__name__)
STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")      # fullmatch (a '$' would let a newline end it)
MAX_NAME = 1000        # longer is no study's name: refused before any storage is read
MIN_AGE_S = 1.0        # a study's summary and trials are read at most once a second (its progress: every commit)


@dataclass(frozen=True)
class StudyRef:
    name: str
    storage: str           # the SQLAlchemy URL it lives in


def clean(o: Any) -> Any:
    """JSON-safe: NaN and infinities to null, numpy scalars to Python, tuples to lists."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    if hasattr(o, "item") and callable(o.item):      # numpy scalar
        return clean(o.item())
    return o


class StorageBusy(ServiceError):
    """The storage did not answer this time (an SQLite file a worker is creating or holds locked): retry."""
    status = 503


def _version(url: str) -> tuple | None:
    """What changes with every commit to URL's SQLite file: its and its WAL's (size, mtime); None where that is
    not known (a server database)."""
    path = sqlite_path(url)
    if path is None:
        return None
    out = []
    for p in (path, path.with_name(path.name + "-wal")):
        try:
            st = p.stat()
            out.append((st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def _read(url: str, read):
    """read(); a storage error as StorageBusy (503: retry)."""
    try:
        return read()
    except InputError:
        raise
    except Exception as e:       # optuna's StorageInternalError, SQLAlchemy's OperationalError
        log.warning("reading %s: %s", shown_url(url), str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise StorageBusy(f"the storage {shown_url(url)} did not answer ({type(e).__name__}); retry in a "
                          "moment") from None


class StudyStore:
    def __init__(self, storage: str | None, studies_dir: Path):
        self.url = storage
        self.studies_dir = studies_dir
        self._storages: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._kept: dict[tuple, tuple[tuple, Any, float]] = {}   # (what, url, name) -> (version, value, when)
        self._reading: dict[tuple, threading.Lock] = {}        # one read of each at a time

    @property
    def shown(self) -> str:
        """Where the studies are, as the pages, the API and the log may show it: a URL without its password."""
        return shown_url(self.url) if self.url else str(self.studies_dir) + "/"

    def _cached(self, key: tuple, url: str, read, min_age_s: float = 0.0):
        """read(), kept until URL's storage changes, and at least MIN_AGE_S (a study a worker writes several times a
        second is not read again for every client: its answer is at most that old). One read of KEY at a time: a
        client that asks while the changed storage is being read gets the answer kept from before (as if it had
        asked a moment earlier) rather than waiting; one that asks when nothing is under way gets the storage as it
        is, MIN_AGE_S aside."""
        version = _version(url)       # taken before reading: a commit during the read makes the next call read
        if version is None:
            return _read(url, read)
        with self._lock:
            kept = self._kept.get(key)
            lock = self._reading.setdefault(key, threading.Lock())
        if kept is not None and (kept[0] == version or time.monotonic() - kept[2] < min_age_s):
            return kept[1]
        if not lock.acquire(blocking=kept is None):
            return kept[1]
        try:
            kept = self._kept.get(key)
            if kept is not None and kept[0] == version:
                return kept[1]
            value = _read(url, read)
            self._kept[key] = (version, value, time.monotonic())
            return value
        finally:
            lock.release()

    def derived(self, name: str, what: str, make) -> tuple[Any, str | None]:
        """make(NAME's detail as kept, without its writer) kept with the detail (the API's serialized JSON, the
        study page's HTML): built once per read of the study, not per request; and the study's writer now, asked on
        this call (never kept: a tune stopped or killed leaves the file as it was, so what was kept with a writer
        would say it runs until the next commit), for the caller to add to what it serves."""
        r = self.ref(name)
        made = self._cached((what, r.storage, name), r.storage, lambda: make(self._kept_detail(r)), MIN_AGE_S)
        return made, self.writer(r)

    def storage_for_new(self, name: str) -> str:
        """Where a tune the server starts writes study NAME (what `tune` does with the same --storage)."""
        return self.url or f"sqlite:///{self.studies_dir / (name + '.db')}"

    def _storage(self, url: str):
        """One storage per URL for the server's life (opening one costs a schema check), behind Optuna's trial
        cache (what load_study puts in front of an RDBStorage, kept here rather than made anew per read): a read
        fetches only the trials new or unfinished since the last."""
        with self._lock:
            if url not in self._storages:
                import optuna

                from tuner.storage import make_storage
                self._storages[url] = optuna.storages.get_storage(make_storage(url))
            return self._storages[url]

    def _urls(self) -> list[str]:
        if self.url:
            return [self.url]
        if not self.studies_dir.is_dir():
            return []
        return [f"sqlite:///{p}" for p in sorted(self.studies_dir.glob("*.db")) if p.stat().st_size > 0]

    def _names(self, url: str) -> list[str]:
        return self._cached(("names", url), url, lambda: [s.study_name for s in self._storage(url).get_all_studies()])

    def refs(self) -> list[StudyRef]:
        out = []
        for url in self._urls():
            try:
                out += [StudyRef(name, url) for name in self._names(url)]
            except Exception as e:     # an unreadable file must not hide the others
                log.warning("skipping %s: %s", shown_url(url),
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
        return out

    def ref(self, name: str) -> StudyRef:
        if len(name) > MAX_NAME or "\0" in name:
            raise NotFound(f"no study named {name[:60]!r}... ({len(name)} characters; a study name is at most "
                           f"{MAX_NAME})")
        # the file tune writes by default, before scanning every file; a name made of other characters than a
        # study file's (STUDY_NAME) never becomes a path
        if not self.url and STUDY_NAME.fullmatch(name):
            path = self.studies_dir / f"{name}.db"
            if path.is_file():
                url = f"sqlite:///{path}"
                try:
                    if name in self._names(url):
                        return StudyRef(name, url)
                except StorageBusy:
                    raise
                except InputError:
                    pass
        for r in self.refs():
            if r.name == name:
                return r
        known = ", ".join(sorted(r.name for r in self.refs())) or "none"
        raise NotFound(f"no study {name!r} in {self.shown}; studies there: {known}")

    def load(self, name: str):
        return self._open(self.ref(name))

    def exists(self, name: str) -> bool:
        try:
            self.ref(name)
            return True
        except NotFound:
            return False

    # ---- what the API and the pages show --------------------------------------------------------------------

    def listing(self) -> list[dict[str, Any]]:
        out = []
        for r in self.refs():
            try:
                out.append(self.brief(r))
            except Exception as e:
                log.warning("study %s: %s", r.name, e)
        return out

    def brief(self, r: StudyRef) -> dict[str, Any]:
        kept = self._cached(("brief", r.storage, r.name), r.storage, lambda: self._brief(r), MIN_AGE_S)
        return dict(kept, writer=self.writer(r))

    def _brief(self, r: StudyRef) -> dict[str, Any]:
        from tuner.options import Settings
        from tuner.records import StudyRecord
        study = self._open(r)
        p = progress(study)
        s = StudyRecord.of(study).settings or Settings()       # none yet: another worker is creating the study
        return {"study": r.name, "storage": r.storage, "model": s.model or None, "engine": s.engine or None,
                "hardware": hardware_words(s.hardware), "objective": s.objective or None, **p}

    def detail(self, name: str) -> dict[str, Any]:
        """`report --json` (tuner.report.study_summary) plus every trial and the VRAM fronts."""
        r = self.ref(name)
        return dict(self._kept_detail(r), writer=self.writer(r))

    def _kept_detail(self, r: StudyRef) -> dict[str, Any]:
        return self._cached(("detail", r.storage, r.name), r.storage, lambda: self._detail(r), MIN_AGE_S)

    def _detail(self, r: StudyRef) -> dict[str, Any]:
        from tuner.report import shown_dict, study_summary, trials_frame
        from tuner.records import StudyRecord
        from tuner.report_plots import vram_front
        from tuner.served import serving_view
        study = self._open(r)
        df = trials_frame(study)
        s = study_summary(study, df)
        trials = json.loads(df.to_json(orient="records")) if not df.empty else []
        fronts = {} if df.empty else {k: [int(t) for t in vram_front(df, f"{k}_tps")["trial"]] for k in ("tg", "pp")}
        rec = StudyRecord.of(study)
        shown = shown_dict(dict(s.to_dict(), trials=trials, serving=serving_view(rec.serving, rec.served)),
                           s.settings.model)     # files by their names, as the report (issue 40)
        return clean(dict(shown, storage=r.storage, vram_fronts=fronts,
                          hardware_words=hardware_words(s.settings.hardware)))

    def progress(self, name: str) -> dict[str, Any]:
        r = self.ref(name)
        kept = self._cached(("progress", r.storage, name), r.storage, lambda: progress(self._open(r)))
        return dict(kept, writer=self.writer(r))

    def writer(self, r: StudyRef) -> str | None:
        """Why the storage says a tune writes the study now, whoever started it (this server, a CLI `tune`, a
        worker on another machine), or None: the SQLite file's worker lock is held (tuner.storage
        lock_sqlite), or a trial is RUNNING with a heartbeat (or, without one, a start) newer than the grace
        Optuna gives a heartbeat. Asked on every read (never kept: a tune takes the lock before it writes)."""
        from tuner.storage import sqlite_path
        path = sqlite_path(r.storage)
        if path is not None:
            # every tune takes this lock first and holds it to its end (one worker per SQLite file), so where it
            # can be read it is the answer: a RUNNING trial without it was left by a worker that is gone (a
            # stop's SIGKILL, a crash) and Optuna fails it when the study is next run
            held = flock_held(path.resolve().with_name(path.name + ".lock"))
            if held is not None:
                return "a tune holds the study's SQLite lock" if held else None
        return running_trial(self._open(r), self._storage(r.storage))

    def _open(self, r: StudyRef):
        import optuna
        return optuna.load_study(study_name=r.name, storage=self._storage(r.storage))


def hardware_words(hw: dict[str, Any]) -> str:
    """A study's machine in a few words (its settings' hardware): its name and each GPU's memory."""
    gpus = hw.get("gpus") or []
    sizes = ", ".join(f"{v / 2 ** 30:.0f} GiB" for _, v in gpus)
    return f"{hw.get('name', '?')} ({sizes})" if sizes else str(hw.get("name", "?"))


def progress(study) -> dict[str, Any]:
    """Counts, the best measured speeds and the served runs so far: what a progress event carries (cheap: no
    DataFrame)."""
    from tuner.records import StudyRecord, TrialRecord
    counts: dict[str, int] = {}
    best_tg = best_pp = None
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
        m = TrialRecord.from_trial(t).measured
        if t.state.name == "COMPLETE" and m is not None and m.ok:
            best_tg = m.tg_tps if best_tg is None or m.tg_tps > best_tg else best_tg
            best_pp = m.pp_tps if best_pp is None or m.pp_tps > best_pp else best_pp
    serving = StudyRecord.of(study).serving or {}       # the served stage's runs: each one is news to the page
    return clean({"n_trials": sum(counts.values()), "counts": counts, "best_tg_tps": best_tg, "best_pp_tps": best_pp,
                  "served_runs": len(serving.get("rows") or [])})


def flock_held(path: Path) -> bool | None:
    """Whether some process holds a flock on PATH, read from /proc/locks (Linux) without taking the lock (a probe
    that took it, even for a moment, could refuse a tune starting at that moment); None where that cannot be
    read."""
    try:
        with open("/proc/locks") as f:
            text = f.read()
    except OSError:
        return None
    try:
        ino = path.stat().st_ino
    except OSError:           # no lock file: no tune ever ran on this file here
        return False
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 26847 fe:00:2146916 0 EOF"; a waiting lock's line has "->" after the id
        fields = [p for p in parts if p != "->"]
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(ino):
            return True
    return False


def running_trial(study, storage) -> str | None:
    """A RUNNING trial some process is still working on: its heartbeat (Optuna's, every HEARTBEAT_S) within the
    grace period, or, with no heartbeat yet, started within it. A RUNNING trial older than that was left by a
    worker that died (Optuna fails it when the study is next run)."""
    import datetime as dt

    from optuna.trial import TrialState

    from tuner.storage import GRACE_S
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if not running:
        return None
    beats = heartbeats(storage, [t._trial_id for t in running])
    now_db, beat = beats.pop(None, None), None
    for t in running:
        beat = beats.get(t._trial_id)
        if beat is not None and now_db is not None and (now_db - beat).total_seconds() <= GRACE_S:
            return f"trial {t.number} is running (its heartbeat is live)"
        if (beat is None and t.datetime_start is not None
                and (dt.datetime.now() - t.datetime_start).total_seconds() <= GRACE_S):
            return f"trial {t.number} is running (started within {GRACE_S} s)"
    return None


def heartbeats(storage, trial_ids: list[int]) -> dict[int | None, Any]:
    """Optuna's last heartbeat per trial id, and the database's clock under None (they are compared there, as
    Optuna's own stale check does); empty for a storage without heartbeats."""
    try:
        import sqlalchemy
        from optuna.storages._rdb import models
        with storage.engine.connect() as conn:
            now = conn.execute(sqlalchemy.select(sqlalchemy.func.now())).scalar()
            hb = models.TrialHeartbeatModel
            rows = conn.execute(sqlalchemy.select(hb.trial_id, hb.heartbeat).where(hb.trial_id.in_(trial_ids)))
            out: dict[int | None, Any] = {int(i): b.replace(tzinfo=None) for i, b in rows}
        if isinstance(now, str):         # SQLite answers CURRENT_TIMESTAMP as text
            import datetime as dt
            now = dt.datetime.fromisoformat(now)
        out[None] = now.replace(tzinfo=None) if now is not None else None
        return out
    except Exception as e:               # another storage kind, an older schema: no heartbeats to read
        log.debug("heartbeats: %s", e)
        return {}
