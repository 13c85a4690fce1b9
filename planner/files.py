"""The files a user names (a model and its shards, a hardware profile, a study spec, a workload, a plan JSON, a
SQLite study): opened only when they are regular files, and read up to a bound fit for their kind.

A FIFO blocks its reader at open() until a writer comes, and /dev/zero never ends (its st_size is 0, so a size
check alone lets it through): both are refused before a byte is read. The check is made on the open descriptor
(opened with O_NONBLOCK, so a FIFO's open returns at once), not on the name, so a file swapped between a check
and the open is still seen for what it is. Every refusal is one InputError line naming the file and the fix."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO, Final

from .errors import InputError

KiB: Final = 1 << 10
MiB: Final = 1 << 20
# what each kind of small input may weigh: far above any real one, far below what hurts a process
PROFILE_BYTES: Final = 1 * MiB        # a hardware profile `calibrate` writes is ~2 KiB
SPEC_BYTES: Final = 1 * MiB           # a study spec (TOML) is a few hundred bytes
PLAN_BYTES: Final = 16 * MiB          # `plan --json` of a 61-layer model with every tensor listed is ~200 KiB


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | Path, what: str, error: type[InputError] = InputError) -> BinaryIO:
    """PATH opened for reading in binary, after its descriptor proved a regular file. `error` (an InputError, one
    line) for anything else: missing, unreadable, a folder, a FIFO, a device, a socket."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"cannot read {what} {path}: {_kind(mode)}, not a file; give the path of a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str | Path, what: str) -> int:
    """PATH's size in bytes when it is a regular file (the same refusals as open_regular), by stat, never opened:
    for SQLite, which holds POSIX locks that any close() of the file in this process would drop (a second open
    and close under a live connection corrupted a study on a full disk)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"cannot read {what} {path}: {_kind(st.st_mode)}, not a file; give the path of a regular "
                         "file")
    return st.st_size


def read_bytes(path: str | Path, what: str, limit: int) -> bytes:
    """PATH's bytes, a regular file of at most LIMIT bytes (read up to LIMIT + 1, whatever its st_size says)."""
    with open_regular(path, what) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise InputError(f"{what} {path}: over {_size(limit)}, more than a {what} ever is; is it the right file?")
    return data


def read_text(path: str | Path, what: str, limit: int) -> str:
    """PATH as UTF-8 text (read_bytes' checks, then one line for bytes that are not UTF-8)."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"
