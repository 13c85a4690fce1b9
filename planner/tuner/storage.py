"""Study storage checks made before any work starts: the database driver a URL needs, the folder of an SQLite
file, and one tune worker per SQLite file (several workers share a study through PostgreSQL).

Facts: SQLAlchemy 2.1 maps `postgresql://` to psycopg (version 3; `postgresql+psycopg2://` names the old
driver); `pip install 'offload-tuner[postgres]'` installs psycopg 3. SQLite serialises writers with a file lock
and Optuna's RDB storage on it is not safe for two processes enqueueing and telling trials at once (two workers
on one file lost trials and died in 2 of 4 rounds), so a second worker on the same file is refused at start.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path
from typing import IO

from ..errors import InputError

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
