"""Study storage checks made before any work starts: the database driver a URL needs, the folder of an SQLite
file, and one tune worker per SQLite file (several workers share a study through PostgreSQL).

Facts: SQLAlchemy 2.1 maps `postgresql://` to psycopg (version 3; `postgresql+psycopg2://` names the old
driver); `pip install 'offload-tuner[postgres]'` installs psycopg 3. SQLite serialises writers with a file lock
and Optuna's RDB storage on it is not safe for two processes enqueueing and telling trials at once (two workers
on one file lost trials and died in 2 of 4 rounds), so a second worker on the same file is refused at start.

Opening one: make_storage (Optuna's RDBStorage with a heartbeat, SQLite in WAL mode); read_study (for `report`:
an SQLite file is read through a copy, so the file is never written, and a read-only one reads too).

Faults (docs/reliability.md): an SQLite file is read whole (PRAGMA quick_check) before Optuna opens it, so a
truncated or garbage file is one line naming it; a database server's connections are checked before each use
(pool_pre_ping), so a restarted server is reconnected to; what fails while a study runs (a full disk, a file at its
size limit, a server that is down) becomes one StorageError naming the storage (`storage_errors`). Every trial
finished before is committed; the one running is failed and retried by the next worker (the heartbeat; also when
its worker died before its first heartbeat: _storage_class).
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import importlib.util
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from planner.errors import InputError, StorageError
from planner.files import check_regular

STUDIES_DIR = Path("studies")
HEARTBEAT_S = 10
GRACE_S = 30
SCHEMA_RETRIES = 5        # opening a storage that other workers are creating at the same moment
INSTALL_HINT = "pip install 'offload-tuner[postgres]'"
# URL scheme -> (module, package that provides it). Plain postgresql:// is psycopg 3 in SQLAlchemy 2.1.
DRIVERS: dict[str, tuple[str, str]] = {
    "postgresql": ("psycopg", "psycopg[binary] (" + INSTALL_HINT + ")"),
    "postgresql+psycopg": ("psycopg", "psycopg[binary] (" + INSTALL_HINT + ")"),
    "postgresql+psycopg2": ("psycopg2", "psycopg2-binary"),
    "postgres": ("psycopg", "psycopg[binary] (" + INSTALL_HINT + ")"),
    "mysql": ("MySQLdb", "mysqlclient"),
    "mysql+pymysql": ("pymysql", "PyMySQL"),
}
log = logging.getLogger(__name__)
_LOCKS: dict[Path, IO[bytes]] = {}      # SQLite files this process holds the worker lock of (released at exit)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve_url(url: str) -> str:
    """The URL to open: a plain postgresql:// goes to whichever PostgreSQL driver is installed (psycopg 3, else
    psycopg2); a missing driver is one line naming the package to install."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if not scheme:
        raise InputError(f"bad --storage {url[:80]!r}: expected an SQLAlchemy URL such as sqlite:///studies/x.db or "
                         "postgresql://user@host/db")
    if scheme in ("postgresql", "postgres"):
        rest = url.split("://", 1)[1]
        if _installed("psycopg"):
            return "postgresql+psycopg://" + rest
        if _installed("psycopg2"):
            return "postgresql+psycopg2://" + rest
    need = DRIVERS.get(scheme)
    if need is not None and not _installed(need[0]):
        raise InputError(f"--storage {scheme}:// needs the {need[0]} driver, which is not installed: pip install "
                         f"{need[1]}" if "(" not in need[1] else
                         f"--storage {scheme}:// needs a PostgreSQL driver, which is not installed: {INSTALL_HINT}")
    return url


def in_memory(url: str) -> bool:
    """An SQLite URL of a database in memory (SQLAlchemy: an empty path, `:memory:`, or a `file:` URI with
    mode=memory): a study there would be lost with the process, however it ends."""
    scheme, _, rest = url.partition("://")
    if not scheme.lower().startswith("sqlite"):
        return False
    path = rest[1:] if rest.startswith("/") else rest
    base = path.split("?", 1)[0]
    return base in ("", ":memory:", "file::memory:") or "mode=memory" in path.lower()


def check_sqlite_folder(path: Path, create: bool) -> None:
    """The folder of an SQLite study file exists (or is created, for the default studies/) and is writable."""
    folder = path.parent
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot create the study folder {folder}: {e.strerror or e}") from e
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() or any(p.is_file() for p in folder.parents) else "does not exist"
        raise InputError(f"storage {path}: {folder} {what}; give an existing folder in --storage sqlite:///PATH")
    if path.is_dir():
        raise InputError(f"storage {path} is a folder; give a file name, e.g. sqlite:///{path}/study.db")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.R_OK | os.W_OK)):
        raise InputError(f"storage {path}: no permission to write there; pick another --storage path")


def lock_sqlite(path: Path) -> None:
    """One tune worker per SQLite file: a second one is refused at start, pointing at PostgreSQL."""
    key = path.resolve()
    if key in _LOCKS:
        return
    lock_path = key.with_name(key.name + ".lock")
    try:
        f = open(lock_path, "a+b")     # noqa: SIM115 (held open: the lock lives as long as the process)
    except OSError as e:
        raise InputError(f"cannot create the lock file {lock_path}: {e.strerror or e}") from e
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise InputError(f"another tune worker is using {path}: SQLite takes one worker at a time; for several "
                         f"workers on one study use --storage postgresql://user@host/db ({INSTALL_HINT})") from None
    _LOCKS[key] = f


def check_output_folder(folder: Path, flag: str) -> None:
    """A report folder that can be written (it, or the nearest folder above it that exists), checked before the
    study runs; nothing is created here."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"{flag} {folder}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {folder}: no permission to write in {probe}")


# ---- opening a study's storage ---------------------------------------------------------------------------------

def default_storage(study: str) -> str:
    return f"sqlite:///{STUDIES_DIR / (study + '.db')}"


def sqlite_path(url: str) -> Path | None:
    if url.startswith("sqlite:///"):
        p = url[len("sqlite:///"):]
        return None if p in ("", ":memory:") or in_memory(url) else Path(p)
    return None


def make_storage(url: str | None):
    """RDBStorage with heartbeat (stale RUNNING trials of a killed worker are failed and retried once);
    None: in-memory (benchmarks, tests)."""
    import optuna
    if url is None:
        return optuna.storages.InMemoryStorage()
    if in_memory(url):            # a study there is lost with the process: said, not done ("storage sqlite://")
        raise InputError(f"--storage {url[:80]} is a database in memory: the study and every trial in it would "
                         "be gone when the process ends; give a file, e.g. --storage sqlite:///study.db")
    path = sqlite_path(url)
    kwargs: dict[str, Any] = {}
    if path is not None:
        check_sqlite_folder(path, create=path.parent == STUDIES_DIR)
        check_sqlite_file(path)
        kwargs = {"connect_args": {"timeout": 60}}
    else:
        url = resolve_url(url)
        kwargs = {"pool_pre_ping": True}      # a restarted server: a dead pooled connection is replaced on checkout
    for attempt in range(SCHEMA_RETRIES + 1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                storage = _storage_class()(
                    url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
            break
        except Exception as e:   # sqlalchemy.exc.ArgumentError, OperationalError, ImportError of a DB driver
            # workers started together on an empty database race to create Optuna's tables; the losers see
            # "duplicate key" / "already exists" and find the tables there on a second try
            text = str(e).lower()
            if attempt < SCHEMA_RETRIES and ("duplicate" in text or "already exists" in text
                                             or "unique constraint" in text):
                time.sleep(0.5 * (attempt + 1))
                continue
            raise StorageError(f"cannot open storage {shown_url(url)}: {_reason(e)}") from e
    if path is not None:
        _sqlite_wal(storage.engine)
    return storage


@functools.cache
def _storage_class() -> type:
    """Optuna's RDBStorage with one more kind of stale trial: RUNNING without any heartbeat (its worker died between
    creating it and its first heartbeat, as when the database server goes away) and started more than the grace
    period ago. Optuna passes those over (optuna/storages/_rdb/storage.py, _get_stale_trial_ids), which would
    leave them RUNNING for ever; now they are failed and retried like any stale trial."""
    import sqlalchemy.orm
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session
    from optuna.trial import TrialState

    class Storage(RDBStorage):
        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            stale = super()._get_stale_trial_ids(study_id)
            grace = self.grace_period if self.grace_period is not None else 2 * (self.heartbeat_interval or 0)
            started_before = datetime.datetime.now() - datetime.timedelta(seconds=grace)   # as Optuna writes it
            with _create_scoped_session(self.scoped_session, True) as session:
                running = (session.query(models.TrialModel)
                           .options(sqlalchemy.orm.selectinload(models.TrialModel.heartbeats))
                           .filter(models.TrialModel.state == TrialState.RUNNING)
                           .filter(models.TrialModel.study_id == study_id).all())
                orphans = [t.trial_id for t in running if not t.heartbeats and t.datetime_start is not None
                           and t.datetime_start < started_before]
            return stale + [i for i in orphans if i not in stale]
    return Storage


def _sqlite_wal(engine) -> None:
    """WAL journal with synchronous=NORMAL: a commit no longer waits for fsync (a trial costs ~15 commits), and a
    killed process still loses no committed trial (only a power cut could lose the last ones)."""
    import sqlalchemy

    def pragmas(dbapi_conn, _record) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()
    sqlalchemy.event.listen(engine, "connect", pragmas)
    engine.dispose()          # connections opened while creating the tables predate the listener


def check_sqlite_file(path: Path) -> None:
    """An existing SQLite study file that SQLite reads whole (PRAGMA quick_check, read-only): a truncated or garbage
    file is one StorageError naming it, before Optuna writes to it. An empty or missing file is a new study."""
    import sqlite3
    if not path.exists() or check_regular(path, "storage") == 0:     # a FIFO or a device: one line, no open
        return
    try:
        con = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=60)
        try:
            rows = con.execute("PRAGMA quick_check").fetchall()
        finally:
            con.close()
    except sqlite3.Error as e:
        raise StorageError(f"storage {path} is not a readable SQLite database ({_reason(e)}): restore it from a "
                           "copy, or give another --storage") from e
    if rows != [("ok",)]:
        said = " ".join(str(rows[0][0]).replace("*** in database main ***", "").split())[:200]   # one line
        raise StorageError(f"storage {path} is damaged (PRAGMA quick_check: {said}): restore it from a copy, or "
                           "give another --storage")


# ---- faults while a study runs --------------------------------------------------------------------------------

_FULL = ("database or disk is full", "disk i/o error", "file too large", "no space left", "disk quota")
_DAMAGED = ("malformed", "not a database", "file is encrypted")
_GONE = ("server closed the connection", "connection refused", "terminating connection", "could not connect",
         "connection failed", "no connection to the server", "connection is closed", "consuming input failed",
         "the database system is", "connection to server", "ssl connection has been closed")


def is_storage_failure(e: BaseException) -> bool:
    """An exception of the database layer (SQLAlchemy, the DB driver, Optuna's storage) or of a full disk."""
    import sqlite3

    import optuna
    import sqlalchemy.exc
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    return isinstance(e, (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError, sqlite3.Error))


RESUME = "the finished trials are saved: run the same command to resume"


def storage_failure(url: str, e: BaseException, then: str = RESUME) -> StorageError:
    """One line naming the storage, saying what failed and what to do next (`then`: a study resumes, a report is
    asked for again)."""
    name, why = shown_url(url), _reason(e)
    text = why.lower()
    if any(w in text for w in _FULL) or (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG)):
        return StorageError(f"storage {name}: the disk is full or the file reached its size limit ({why}); {then} "
                            "once there is free space")
    if any(w in text for w in _DAMAGED):
        return StorageError(f"storage {name} is damaged ({why}): restore it from a copy, or give another --storage")
    if _server_gone(url, e):
        return StorageError(f"storage {name}: the database server went away ({why}); {then} once it is back")
    return StorageError(f"storage {name}: {why}; {then}")


@contextlib.contextmanager
def storage_errors(url: str, then: str = RESUME) -> Iterator[None]:
    """Storage failures inside the block as one StorageError naming the storage (storage_failure). Meanwhile a
    storage failure in another thread (Optuna's heartbeat thread) prints no traceback: the study's own next write
    meets the same failure and says it once."""
    old_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and any(is_storage_failure(c) for c in _chain(args.exc_value)):
            log.debug("storage %s failed in thread %s: %s", shown_url(url), getattr(args.thread, "name", "?"),
                      _reason(args.exc_value))
            return
        old_hook(args)
    threading.excepthook = hook
    try:
        yield
    except InputError:
        raise
    except Exception as e:
        if not any(is_storage_failure(c) for c in _chain(e)):
            raise
        raise storage_failure(url, e, then) from e
    finally:
        threading.excepthook = old_hook


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 10:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _reason(e: BaseException) -> str:
    """The first line of the innermost error's text (Optuna's StorageInternalError says only 'during the commit'),
    else the innermost error's type (a driver's error without text, such as psycopg's on a dropped connection)."""
    import optuna
    chain = [c for c in reversed(_chain(e)) if (is_storage_failure(c) or isinstance(c, OSError))
             and not isinstance(c, optuna.exceptions.StorageInternalError)] or [e]
    for c in chain:
        text = str(getattr(c, "orig", None) or c).strip()
        if any(ch.isalnum() for ch in text):
            return text.splitlines()[0][:300]
    return type(getattr(chain[0], "orig", None) or chain[0]).__name__


def _server_gone(url: str, e: BaseException) -> bool:
    """A database server's connection failed: its words, or (without any) an operational or interface error."""
    import sqlalchemy.exc
    chain = _chain(e)
    text = " ".join(str(getattr(c, "orig", None) or c) for c in chain).lower()
    if any(w in text for w in _GONE):
        return True
    return sqlite_path(url) is None and any(
        isinstance(c, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
                       sqlalchemy.exc.DisconnectionError, sqlalchemy.exc.PendingRollbackError)) for c in chain)


def shown_url(url: str) -> str:
    """The storage as the user named it: the SQLite file, or the URL without its password."""
    path = sqlite_path(url)
    if path is not None:
        return str(path)
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)[:200]


def study_exists(storage, name: str) -> bool:
    return any(s.study_name == name for s in storage.get_all_studies())


def load_study(name: str, url: str | None, storage: Any = None):
    """An existing study (for `report`); InputError naming the studies there when it is missing. `storage`: the
    opened storage of `url` (read_study's copy), else make_storage(url)."""
    import optuna
    path = sqlite_path(url) if url else None
    if path is not None and not path.exists():
        raise InputError(f"no study {name!r}: {path} does not exist (give --storage URL where the study lives)")
    storage = storage if storage is not None else make_storage(url)
    with storage_errors(url, then="run the same command again"):
        names = [s.study_name for s in storage.get_all_studies()]
    if name not in names:
        raise InputError(f"no study {name!r} in {url}; studies there: {', '.join(names) or 'none'}")
    return optuna.load_study(study_name=name, storage=storage)


# ---- reading a study without writing to it (`report`) ----------------------------------------------------------

@contextlib.contextmanager
def read_study(name: str, url: str) -> Iterator[Any]:
    """An existing study to read (load_study's checks), its database untouched. An SQLite file is copied first
    (snapshot_sqlite: SQLite's backup API on a read-only connection) into a temporary folder and the copy is opened,
    so Optuna's table creation and schema check, the WAL pragma and any lock or journal touch the copy only: the
    file keeps its bytes and mtime, and a read-only file (or folder) reads too. The copy goes when the block ends.
    Another storage (PostgreSQL, MySQL) is opened as tune opens it; reading a study writes nothing there."""
    import tempfile
    path = sqlite_path(url)
    if path is None:
        yield load_study(name, url)
        return
    if not path.exists():
        raise InputError(f"no study {name!r}: {path} does not exist (give --storage URL where the study lives)")
    with tempfile.TemporaryDirectory(prefix="offload-tuner-read-") as tmp:
        copy = Path(tmp) / "study.db"
        snapshot_sqlite(path, copy)
        storage = _open_copy(copy, url)
        try:
            yield load_study(name, url, storage)
        finally:
            storage.engine.dispose()        # the copy's connections closed before its folder goes


def snapshot_sqlite(path: Path, copy: Path) -> None:
    """A consistent copy of the SQLite file PATH (and its WAL) at COPY, PATH opened read-only, then checked whole
    (PRAGMA quick_check on the copy). Without a -wal or -journal file beside it (no writer, nothing to recover) the
    file is read as immutable: SQLite then creates no -wal/-shm beside it, which a read-only connection to a WAL
    database otherwise does (and cannot do in a folder the user may not write). A damaged file is one
    StorageError naming PATH, as check_sqlite_file says it."""
    import sqlite3
    if check_regular(path, "storage") == 0:         # a FIFO or a device: one line, no open; empty: no studies
        copy.touch()
        return
    quiet = not any(path.with_name(path.name + s).exists() for s in ("-wal", "-journal"))
    uri = path.resolve().as_uri() + ("?mode=ro&immutable=1" if quiet else "?mode=ro")
    try:
        src = sqlite3.connect(uri, uri=True, timeout=60)
        dst = sqlite3.connect(copy)
        try:
            src.backup(dst)
        finally:
            src.close()
            dst.close()
    except sqlite3.Error as e:
        if quiet or not _copy_files(path, copy):
            raise StorageError(f"storage {path} is not a readable SQLite database ({_reason(e)}): restore it from "
                               "a copy, or give another --storage") from e
    try:
        check_sqlite_file(copy)
    except StorageError as e:
        raise StorageError(str(e).replace(f"storage {copy}", f"storage {path}", 1)) from e


def _copy_files(path: Path, copy: Path) -> bool:
    """PATH with its -wal and -journal copied as files (SQLite recovers them in the copy): for a file SQLite cannot
    open read-only in place (a WAL without its -shm, or a hot journal, in a folder the user may not write). False
    when that fails too."""
    import shutil
    try:
        shutil.copyfile(path, copy)
        for suffix in ("-wal", "-journal"):
            if path.with_name(path.name + suffix).exists():
                shutil.copyfile(path.with_name(path.name + suffix), copy.with_name(copy.name + suffix))
    except OSError:
        return False
    return True


def _open_copy(copy: Path, url: str) -> Any:
    """Optuna's RDBStorage on the copy; a failure names the study's own storage."""
    from optuna.storages import RDBStorage
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return RDBStorage(f"sqlite:///{copy}")
    except Exception as e:      # sqlalchemy.exc.OperationalError, optuna's schema version check
        raise StorageError(f"cannot open storage {shown_url(url)}: {_reason(e)}") from e
