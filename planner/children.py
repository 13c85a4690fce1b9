"""Child processes that die with us: every process offload-tuner starts (llama-bench, llama-server, nvidia-smi, a
compiler, a build, the service's tune workers) goes through `popen` or `run` here.

Each child runs in its own session and process group (we end the whole group: whatever it started goes too; a Ctrl-C
at the terminal reaches us, not it) and, on Linux, asks the kernel for a signal when its parent dies (prctl
PR_SET_PDEATHSIG), so a kill -9 of the tuner or the server leaves nothing running. Facts (prctl(2)): the signal
comes when the *thread* that started the child exits, not the process; start children from a thread that lives as
long as they should (the main thread, the service's event loop). A parent that died between fork and prctl is caught
by comparing getppid() with the pid we had.

PR_SET_PDEATHSIG reaches the direct child only: what *it* started (a wrapper script's llama-bench, a shell's
`sleep`) is in the same process group but would outlive a kill -9 of us. So each process that starts children also
starts one reaper (`_Reaper`: a small Python process in its own session, its signals ignored) and tells it the
process group of every child that dies by SIGKILL (see popen); the reaper reads a pipe whose only writer is us, and
when that pipe ends (we exited, however: kill -9 included) it sends each group still alive SIGKILL. It forgets a
group once nobody is left in it (checked each second), so a process group id the kernel hands out again is never
signalled.
Elsewhere (macOS) only the process group is set.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO, Any

PR_SET_PDEATHSIG = 1       # linux/prctl.h

try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def die_with_parent(death_signal: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A preexec_fn asking for `death_signal` when the parent (thread) dies; None where there is no prctl. It does
    as little as it can: Python code between fork and exec is unsafe in a process with threads (subprocess's
    docs), so the session is made by Popen's own start_new_session, in C."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def setup() -> None:
        _PRCTL(PR_SET_PDEATHSIG, int(death_signal))
        if os.getppid() != parent:       # the parent died before prctl: nobody will send the signal
            os.kill(os.getpid(), death_signal)
    return setup


# the reaper: reads "PGID SIGNAL" lines from stdin; at its end, signals each group that still has a process
_REAPER_CODE = """# offload-tuner: the reaper of a process's children (planner/children.py)
import os, select, signal
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)
groups, buf = {}, b""
while True:
    if select.select([0], [], [], 1.0)[0]:
        data = os.read(0, 65536)
        if not data:
            break
        *lines, buf = (buf + data).split(b"\\n")
        for line in lines:
            pgid, sig = map(int, line.split())
            groups[pgid] = sig
    for pgid in list(groups):
        try:
            os.killpg(pgid, 0)
        except OSError:
            del groups[pgid]
for pgid, sig in groups.items():
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass
"""


class _Reaper:
    """This process's reaper (module docstring): started with the first child, told each child's group."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pipe: IO[bytes] | None = None
        self._owner = 0                  # the pid that started it (a fork of us starts its own)

    def ready(self) -> None:
        """Started (if it can be), so that watch only writes a line."""
        with self._lock:
            if self._pipe is None or self._owner != os.getpid():
                self._start()

    def watch(self, pgid: int, death_signal: int) -> None:
        with self._lock:
            for _ in range(2):           # a reaper that died (killed by hand) is started again, once
                if self._pipe is None or self._owner != os.getpid():
                    self._start()
                if self._pipe is None:
                    return
                try:
                    self._pipe.write(b"%d %d\n" % (pgid, int(death_signal)))
                    self._pipe.flush()
                    return
                except OSError:
                    self._pipe = None

    def _start(self) -> None:
        self._pipe, self._owner = None, os.getpid()
        if not sys.executable:
            return
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER_CODE], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            return
        proc.returncode = 0              # never waited for: it ends when we do (no ResourceWarning at exit)
        self._pipe = proc.stdin


_REAPER = _Reaper()


def popen(argv: Sequence[str], death_signal: int = signal.SIGKILL, **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen in its own session and process group, dying with us (`death_signal`), and its whole
    group too (the reaper) when that is SIGKILL. A child asked to stop some other way (the service's tune workers:
    SIGINT, a resumable stop) is one of ours that ends its own children; a second signal from the reaper could
    land in that stop, so the reaper leaves it to the kernel's one."""
    watched = _PRCTL is not None and death_signal == signal.SIGKILL
    if watched:
        _REAPER.ready()                  # before the child: it is told the group the moment the child exists
    proc = subprocess.Popen(list(argv), start_new_session=True, preexec_fn=die_with_parent(death_signal), **kwargs)
    if watched:
        _REAPER.watch(proc.pid, death_signal)
    return proc


def run(argv: Sequence[str], *, input: Any = None, capture_output: bool = False, timeout: float | None = None,
        check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run in its own session and process group, killed when we die. Past `timeout`, or interrupted
    (Ctrl-C, SIGTERM: a KeyboardInterrupt), the whole group is ended, not the child alone as subprocess.run does,
    and so is whatever the child left in its group when it exits."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(argv, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            kill_group(proc.pid)
            e.output, e.stderr = proc.communicate()
            raise
        except BaseException:
            kill_group(proc.pid)
            raise
        rc = proc.poll()
        kill_group(proc.pid)            # whatever it left behind in its group
    if check and rc:
        raise subprocess.CalledProcessError(rc, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, rc, out, err)


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a child's whole process group (its pid); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
