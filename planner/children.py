"""Child processes that die with us: every process offload-tuner starts (llama-bench, llama-server, nvidia-smi, a
compiler, a build, the service's tune workers) goes through `popen` or `run` here.

Each child runs in its own session and process group (we end the whole group: whatever it started goes too; a Ctrl-C
at the terminal reaches us, not it) and, on Linux, asks the kernel for a signal when its parent dies (prctl
PR_SET_PDEATHSIG), so a kill -9 of the tuner or the server leaves nothing running. Facts (prctl(2)): the signal
comes when the *thread* that started the child exits, not the process; start children from a thread that lives as
long as they should (the main thread, the service's event loop). A parent that died between fork and prctl is caught
by comparing getppid() with the pid we had.
Elsewhere (macOS) only the process group is set.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

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


def popen(argv: Sequence[str], death_signal: int = signal.SIGKILL, **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen in its own session and process group, dying with us (`death_signal`)."""
    return subprocess.Popen(list(argv), start_new_session=True, preexec_fn=die_with_parent(death_signal), **kwargs)


def run(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run in its own session and process group, killed when we die."""
    return subprocess.run(list(argv), start_new_session=True, preexec_fn=die_with_parent(), **kwargs)


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a child's whole process group (its pid); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
